"""One system for bench.peers, in a process of its own (run by the peer's interpreter: this file
imports only what that system needs). It builds the system, prints `READY {"start_s": ...}`, then
times the greedy calls bench.peers sends on stdin, one at a time (`serve`), each with the time to
its first token (each system's tokens are read as they come: the engine's request notes it,
llama.cpp's generator yields them, vLLM's engine steps return them, a streamer takes
transformers').

    <python> bench/peer_run.py --system vllm --model DIR --dtype float32 --threads 2

Every call is greedy, end-of-sequence ignored, prefix caching off, so each computes its whole
prompt; bench.peers says what is timed.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Callable

# (token ids, how many new tokens) -> (the new tokens, greedy; the seconds from the call's start
# to its first token, or None where the system does not say)
Generate = Callable[[list[int], int], tuple[list[int], float | None]]


def engine(model: str, dtype: str, threads: int, settings: dict) -> Generate:
    import torch

    from engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model, dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=2048,
              num_threads=threads, **settings)

    def generate(ids: list[int], n: int) -> tuple[list[int], float]:
        [out] = llm.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))
        return list(out.token_ids), out.ttft_s  # from the request's arrival in the engine
    return generate


def vllm(model: str, dtype: str, threads: int, settings: dict) -> Generate:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    # the context bench.peers passes (max_model_len) where a timed prompt needs more
    llm = LLM(model=model, dtype=dtype, **({"max_model_len": 4096, "enable_prefix_caching": False,
                                            "max_num_batched_tokens": 4096, "seed": 0} | settings))
    engine, calls = llm.llm_engine, itertools.count()

    def generate(ids: list[int], n: int) -> tuple[list[int], float | None]:
        # the engine's steps as LLM.generate runs them, each step's new tokens returned as it
        # ends (DELTA), so the first one's time is seen
        start = time.perf_counter()
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        request = str(next(calls))
        engine.add_request(request, TokensPrompt(prompt_token_ids=ids), params)
        tokens, first = [], None
        while engine.has_unfinished_requests():
            for out in (o for o in engine.step() if o.request_id == request):
                if out.outputs[0].token_ids and first is None:
                    first = time.perf_counter() - start
                tokens += out.outputs[0].token_ids
        return tokens, first
    return generate


def llamacpp(model: str, dtype: str, threads: int, settings: dict) -> Generate:
    from llama_cpp import Llama

    # use_extra_bufts=False: the AMX repacking path crashed (SIGILL) on a Q4_1 file on our Xeon
    # (n_ctx: bench.peers passes a longer one where a timed prompt needs it)
    llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads,
                **({"n_ctx": 4096, "n_batch": 2048, "n_ubatch": 2048, "verbose": False,
                    "use_extra_bufts": False} | settings))

    def generate(ids: list[int], n: int) -> tuple[list[int], float | None]:
        start = time.perf_counter()
        llm.reset()  # nothing kept from the last call: each call computes its whole prompt
        out, first = [], None  # this low-level loop does not stop at end-of-sequence
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if first is None:
                first = time.perf_counter() - start
            out.append(int(token))
            if len(out) == n:
                break
        return out, first
    return generate


def transformers(model: str, dtype: str, threads: int, settings: dict) -> Generate:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    from launcher.baseline import hf_model

    torch.set_num_threads(threads)
    hf = hf_model(model, getattr(torch, dtype))

    @torch.inference_mode()
    def generate(ids: list[int], n: int) -> tuple[list[int], float | None]:
        first = FirstToken()
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0, streamer=first)
        return out[0, len(ids):].tolist(), first.seconds
    return generate


class FirstToken:
    """A transformers streamer that notes when the first new token comes: generate hands it the
    prompt's ids first, then each new token."""

    def __init__(self):
        self.start, self.puts = time.perf_counter(), 0
        self.seconds: float | None = None

    def put(self, _ids) -> None:
        self.puts += 1
        if self.puts == 2:
            self.seconds = time.perf_counter() - self.start

    def end(self) -> None:
        pass


SYSTEMS = {"engine": engine, "transformers": transformers, "vllm": vllm, "llamacpp": llamacpp}


def serve(generate: Generate) -> None:
    """Answer timing requests from stdin until it closes: each line {"ids": [...], "n": k} runs
    one greedy call of k new tokens and is answered `RESULT {"seconds": s, "tokens": [...],
    "first_token_s": f}` (f: null where the system does not say). bench.peers sends the
    requests, to every system in turn."""
    for line in sys.stdin:
        request = json.loads(line)
        start = time.perf_counter()
        tokens, first = generate(request["ids"], request["n"])
        seconds = time.perf_counter() - start
        print("RESULT " + json.dumps({"seconds": seconds, "tokens": tokens,
                                      "first_token_s": first}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", choices=sorted(SYSTEMS), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--settings", default="{}", help="JSON: the system's own extra settings")
    args = ap.parse_args()
    if args.system == "engine":  # as the engine's launchers start it
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from engine.cpu_runtime import relaunch_preloaded

        relaunch_preloaded()
    started = time.perf_counter()
    generate = SYSTEMS[args.system](args.model, args.dtype, args.threads,
                                    json.loads(args.settings))
    print("READY " + json.dumps({"start_s": time.perf_counter() - started}), flush=True)
    serve(generate)


if __name__ == "__main__":
    main()
