"""One system's timings for bench.peers, in a process of its own (run by the peer's interpreter:
this file imports only what that system needs). Prints one JSON line.

    <python> bench/peer_run.py --system vllm --model DIR --dtype float32 --inputs inputs.json

Protocol, the same for every system: prefill = one call over the whole prompt that returns the
first token, best of `repeats`; decode = n greedy tokens (64) after a prompt (256 tokens), timed as
the best call of n + 1 tokens less the best call of 1 token (the time after the first token). Greedy,
end-of-sequence ignored, prefix caching off, so every call computes the whole prompt.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

# (token ids, how many new tokens) -> the new tokens, greedy
Generate = Callable[[list[int], int], list[int]]


def engine(model: str, dtype: str, threads: int, settings: dict) -> Generate:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    from engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model, dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=2048,
              num_threads=threads, **settings)

    def generate(ids: list[int], n: int) -> list[int]:
        [out] = llm.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))
        return list(out.token_ids)
    return generate


def vllm(model: str, dtype: str, threads: int, settings: dict) -> Generate:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype=dtype, max_model_len=4096, enable_prefix_caching=False,
              max_num_batched_tokens=4096, seed=0, **settings)

    def generate(ids: list[int], n: int) -> list[int]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        [out] = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        return list(out.outputs[0].token_ids)
    return generate


def llamacpp(model: str, dtype: str, threads: int, settings: dict) -> Generate:
    from llama_cpp import Llama

    # use_extra_bufts=False: the AMX repacking path crashed (SIGILL) on a Q4_1 file on our Xeon
    llm = Llama(model_path=model, n_ctx=4096, n_batch=2048, n_ubatch=2048, n_threads=threads,
                n_threads_batch=threads, verbose=False, use_extra_bufts=False, **settings)

    def generate(ids: list[int], n: int) -> list[int]:
        llm.reset()  # nothing kept from the last call: each call computes its whole prompt
        out = []  # this low-level loop does not stop at end-of-sequence
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            out.append(int(token))
            if len(out) == n:
                break
        return out
    return generate


def transformers(model: str, dtype: str, threads: int, settings: dict) -> Generate:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    from launcher.baseline import hf_model

    torch.set_num_threads(threads)
    hf = hf_model(model, getattr(torch, dtype))

    @torch.inference_mode()
    def generate(ids: list[int], n: int) -> list[int]:
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)
        return out[0, len(ids):].tolist()
    return generate


SYSTEMS = {"engine": engine, "transformers": transformers, "vllm": vllm, "llamacpp": llamacpp}


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """(engine.observe.hardware has the same, but a peer's venv cannot import the engine)"""
    return min(_seconds(fn) for _ in range(repeats))


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(generate: Generate, inputs: dict, repeats: int) -> dict:
    result: dict = {"prefill_tok_s": {}, "first_tokens": {}}
    for name, ids in inputs["prefill"].items():
        result["first_tokens"][name] = generate(ids, 1)  # also the warm-up of this length
        seconds = best_seconds(lambda: generate(ids, 1), repeats)
        result["prefill_tok_s"][name] = len(ids) / seconds
    ids, n = inputs["decode"], inputs["decode_tokens"]
    result["decode_tokens"] = generate(ids, n + 1)
    first = best_seconds(lambda: generate(ids, 1), repeats)
    whole = best_seconds(lambda: generate(ids, n + 1), max(2, repeats // 2))
    result["decode_tok_s"] = n / max(whole - first, 1e-9)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", choices=sorted(SYSTEMS), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--inputs", required=True,
                    help="JSON: {prefill: {name: ids}, decode: ids, decode_tokens: n}")
    ap.add_argument("--settings", default="{}", help="JSON: the system's own extra settings")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    started = time.perf_counter()
    generate = SYSTEMS[args.system](args.model, args.dtype, args.threads,
                                    json.loads(args.settings))
    start_s = time.perf_counter() - started
    result = measure(generate, json.loads(Path(args.inputs).read_text()), args.repeats)
    print("RESULT " + json.dumps({"start_s": start_s, **result}), flush=True)


if __name__ == "__main__":
    main()
