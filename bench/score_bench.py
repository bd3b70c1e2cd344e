"""Scoring throughput of the engine (LLM.score) next to transformers computing the same
log-probabilities, same weights and dtype, one run; and the engine's peak logits memory per rank
against T·vocab·4/TP bytes (what gathering the full float32 logits would hold, split over TP).
The engine's own prefill of the same prompt (last-position logits only) shows what scoring every
position costs on top of the forward.

    .venv/bin/python -m bench.score_bench --lengths 512 2048 --tp 1 2 --repeats 2
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.common import machine, random_ids
from engine import LLM
from engine.loading.checkpoint import resolve_model
from launcher.baseline import hf_model


@torch.inference_mode()
def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """transformers' way: full [T, vocab] logits, log-softmax, pick each next token."""
    logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    hf = hf_model(str(resolve_model(args.model)), getattr(torch, args.dtype))
    print(f"{machine()}; dtype={args.dtype} model={args.model}; "
          f"best of {args.repeats}, alternating")
    print(f"{'tp':>2} {'tokens':>6} {'engine tok/s':>12} {'hf tok/s':>9} {'ratio':>6} "
          f"{'prefill tok/s':>13} {'score/prefill':>13} "
          f"{'logits peak/rank':>16} {'T·V·4/TP':>10} {'share':>6} {'max |Δlogp|':>11}")
    for tp in args.tp:
        # no prefix cache: the prefill column must not hit what scoring wrote
        llm = LLM(args.model, tp=tp, dtype=args.dtype, max_num_batched_tokens=max(args.lengths),
                  enable_prefix_caching=False)
        vocab = llm.model_config.vocab_size
        # warm-up: first-call costs out of the figures
        llm.score([random_ids(16, vocab, seed=0)])
        hf_logprobs(hf, random_ids(16, vocab, seed=0))
        for n in args.lengths:
            ids = random_ids(n, vocab, seed=n)
            ours = theirs = prefill = float("inf")
            for _ in range(args.repeats):  # alternate, so a slow spell hits both alike
                start = time.perf_counter()
                [s] = llm.score([ids])
                ours = min(ours, time.perf_counter() - start)
                start = time.perf_counter()
                llm.prefill([ids])  # the same forward, logits at the last position only
                prefill = min(prefill, time.perf_counter() - start)
                start = time.perf_counter()
                hf_logprobs(hf, ids)
                theirs = min(theirs, time.perf_counter() - start)
            diff = (torch.tensor(s.logprobs) - hf_logprobs(hf, ids)).abs().max().item()
            bound = n * vocab * 4 // tp
            print(f"{tp:>2} {n:>6} {n / ours:>12.0f} {n / theirs:>9.0f} {theirs / ours:>6.2f} "
                  f"{n / prefill:>13.0f} {prefill / ours:>13.2f} "
                  f"{s.peak_logits_bytes / 2**20:>13.1f} MB {bound / 2**20:>7.1f} MB "
                  f"{s.peak_logits_bytes / bound:>6.3f} {diff:>11.2e}")
        llm.shutdown()


if __name__ == "__main__":
    main()
