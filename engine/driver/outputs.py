"""What the public API returns."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillOutput:
    prompt_token_ids: list[int]
    first_token: int
    first_token_text: str
    logits: torch.Tensor  # float32 [vocab] at the last prompt position, on the CPU
    ttft_s: float
    cached_tokens: int  # prompt tokens whose K/V came from the prefix cache
    block_table: list[int]  # KV blocks that held the prompt on every rank (reusable until evicted)
    kv: object = None  # a KVHandle with prefill(export_kv=True), for another engine's decode()


@dataclass(slots=True)
class GenerateOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    ttft_s: float
    cached_tokens: int
    finish_reason: str  # a FinishReason: "stop" or "length"


@dataclass(slots=True)
class ScoreOutput:
    prompt_token_ids: list[int]
    logprobs: list[float]  # length T-1: log p(token[i+1] | tokens[:i+1]), natural log
    perplexity: float  # exp(-mean(logprobs))
    top_logprobs: list[list[tuple[int, float]]] | None  # per position, the k likeliest next
    # tokens as (id, logprob), most likely first; None when top_logprobs=0
    peak_logits_bytes: int = 0  # largest logits slice rank 0 held at once while scoring it
