"""Hugging Face `transformers` running the same weights: the baseline benchmarks compare with."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=2)
def hf_model(source: str, dtype: torch.dtype = torch.float32):
    """transformers' own model for a safetensors directory or a GGUF file, in eval mode."""
    from transformers import AutoModelForCausalLM

    path = Path(source)
    if path.suffix == ".gguf":
        m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return m.eval()


@torch.inference_mode()
def hf_prefill(model, ids: list[int]) -> torch.Tensor:
    """One forward over the prompt, logits at the last position only (as the engine computes)."""
    return model(torch.tensor([ids], device=model.device), logits_to_keep=1).logits[0, -1]
