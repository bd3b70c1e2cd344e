"""The model's shape, read from an HF config.json or from GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import ModelLoadError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def num_params(self) -> int:
        d, hd = self.hidden_size, self.head_dim
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * d * self.intermediate_size
        per_layer = attn + mlp + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + d


def _as_list(x: Any) -> list[int]:
    if x is None:
        return []
    return [int(v) for v in x] if isinstance(x, (list, tuple)) else [int(x)]


def _context_length(cfg: dict[str, Any], arch: str) -> int:
    """Positions the engine serves. It implements full causal attention only, so a model with
    sliding-window attention is served up to its window, where the two still agree."""
    length = cfg.get("max_position_embeddings", 2048)
    if cfg.get("use_sliding_window", arch == "mistral") and cfg.get("sliding_window"):
        length = min(length, cfg["sliding_window"])
    return length


def from_hf_config(cfg: dict[str, Any], source: str) -> ModelConfig:
    arch = cfg.get("model_type", "")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source}: model_type {arch!r} is not supported; this engine runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} checkpoints")
    try:
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise UnsupportedModelError(
                f"{source}: rope scaling {rope_type!r} is not supported (use default or llama3)")
        return ModelConfig(
            architecture=arch,
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            max_position_embeddings=_context_length(cfg, arch),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            rope_scaling=dict(rope) if rope_type == "llama3" else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_list(cfg.get("eos_token_id")),
        )
    except KeyError as e:
        raise ModelLoadError(f"{source}: config.json lacks required key {e.args[0]!r}") from None


def from_gguf_metadata(meta: dict[str, Any], has_output_tensor: bool, source: str) -> ModelConfig:
    arch = meta.get("general.architecture", "")
    if arch not in ("llama", "qwen2"):
        raise UnsupportedModelError(
            f"{source}: GGUF architecture {arch!r} is not supported (llama-family or qwen2 only)")
    p = f"{arch}."
    try:
        hidden, heads = meta[p + "embedding_length"], meta[p + "attention.head_count"]
        if meta.get(p + "rope.scaling.type") not in (None, "none"):
            raise UnsupportedModelError(f"{source}: GGUF rope scaling is not supported yet")
        return ModelConfig(
            architecture=arch,
            hidden_size=hidden,
            num_layers=meta[p + "block_count"],
            num_heads=heads,
            num_kv_heads=meta.get(p + "attention.head_count_kv", heads),
            head_dim=meta.get(p + "attention.key_length", hidden // heads),
            intermediate_size=meta[p + "feed_forward_length"],
            vocab_size=meta.get(p + "vocab_size") or len(meta["tokenizer.ggml.tokens"]),
            rms_norm_eps=meta[p + "attention.layer_norm_rms_epsilon"],
            rope_theta=meta.get(p + "rope.freq_base", 10000.0),
            max_position_embeddings=meta.get(p + "context_length", 2048),
            tie_word_embeddings=not has_output_tensor,
            qkv_bias=arch == "qwen2",
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_as_list(meta.get("tokenizer.ggml.eos_token_id")),
        )
    except KeyError as e:
        raise ModelLoadError(f"{source}: GGUF metadata lacks {e.args[0]!r}") from None
