"""Tiny random checkpoints saved with `save_pretrained`, for shapes SmolLM2 does not cover,
and random prompts: what tests, benchmarks and the GPU check run on when no real data is needed."""
from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(hidden_size=64, num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-5)

SPECS = {
    # llama 3 style: GQA, llama3 rope scaling, untied head, checkpoint split into shards
    "llama": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                  vocab_size=300, tie_word_embeddings=False, rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                  shard="40KB"),
    "qwen2": dict(arch="qwen2", num_attention_heads=4, num_key_value_heads=2, intermediate_size=112,
                  vocab_size=311, tie_word_embeddings=True),
    "mistral": dict(arch="mistral", num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                    intermediate_size=128, vocab_size=257, tie_word_embeddings=False,
                    sliding_window=None),
    # llama's shapes, six layers: graphs shared across layers meet several of them
    "deep": dict(arch="llama", num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=96, vocab_size=300, tie_word_embeddings=False),
    # uneven everything for tensor parallelism: 6 query / 3 KV heads, odd vocab and FFN sizes
    "uneven": dict(arch="llama", hidden_size=72, num_attention_heads=6, num_key_value_heads=3, intermediate_size=100,
                   vocab_size=301, tie_word_embeddings=False),
}


def build(name: str, root: Path, seed: int = 0) -> Path:
    """Save the named tiny model under root/name (once) and return its directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = root / name
    if (out / "config.json").exists():
        return out
    spec = dict(SPECS[name])
    arch, shard = spec.pop("arch"), spec.pop("shard", None)
    cfg = AutoConfig.for_model(arch, **{**BASE, **spec}, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # random init is near zero: widen it so logits are not all alike
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            else:
                p.normal_(1.0 if p.dim() == 1 else 0, 0.05)
    model.save_pretrained(out, max_shard_size=shard or "1GB")
    return out


def random_token_ids(n: int, vocab: int, seed: int) -> list[int]:
    """n token ids drawn from the vocabulary past the first few special ids, reproducibly."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=generator).tolist()
