"""The model's shape, read from an HF config.json or from GGUF metadata."""
from __future__ import annotations

import math
import numbers
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


_REQUIRED = object()


class _Fields:
    """Typed reads of one config's keys. Each error names the file and the key, so a corrupt or
    hand-edited config is a ModelLoadError rather than a TypeError deep in the model."""

    def __init__(self, data: dict[str, Any], source: str):
        self.data, self.source = data, source

    def error(self, message: str) -> ModelLoadError:
        return ModelLoadError(f"{self.source}: {message}; fix the file or fetch it again")

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self.data.get(key)
        if value is None:  # null counts as absent, as in HF configs ("head_dim": null)
            if default is _REQUIRED:
                raise self.error(f"lacks required key {key!r}")
            return default
        return value

    def integer(self, key: str, default: Any = _REQUIRED, minimum: int = 1) -> Any:
        return self.check_integer(key, self.get(key, default), minimum)

    def check_integer(self, key: str, value: Any, minimum: int = 1) -> Any:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
            want = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise self.error(f"{key}={value!r} must be {want}")
        return int(value)

    def number(self, key: str, default: Any = _REQUIRED, value: Any = _REQUIRED) -> float:
        value = self.get(key, default) if value is _REQUIRED else value
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not (ok and math.isfinite(value) and value > 0):
            raise self.error(f"{key}={value!r} must be a positive, finite number")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.error(f"{key}={value!r} must be true or false")
        return value

    def token_ids(self, key: str) -> list[int]:
        value = self.get(key, [])
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        return [self.check_integer(key if len(values) == 1 else f"{key}[{i}]", v, 0)
                for i, v in enumerate(values)]


def _head_layout(f: _Fields, hidden: str, heads: str, kv_heads: str,
                 head_dim: str) -> tuple[int, int, int, int]:
    """(hidden size, query heads, KV heads, head dim), consistent with one another."""
    d, h = f.integer(hidden), f.integer(heads)
    kv, hd = f.integer(kv_heads, h), f.integer(head_dim, None)
    if h % kv:
        raise f.error(f"{heads}={h} is not a multiple of {kv_heads}={kv}; grouped-query "
                      f"attention needs every KV head to serve the same number of query heads")
    if hd is None:
        if d % h:
            raise f.error(f"{hidden}={d} is not a multiple of {heads}={h} and no {head_dim} "
                          f"is given, so the head size is unknown")
        hd = d // h
    if hd % 2:
        raise f.error(f"{head_dim}={hd} must be even: rotary embeddings rotate pairs")
    return d, h, kv, hd


def _context_length(f: _Fields, arch: str) -> int:
    """Positions the engine serves. It implements full causal attention only, so a model with
    sliding-window attention is served up to its window, where the two still agree."""
    length = f.integer("max_position_embeddings", 2048)
    window = f.integer("sliding_window", None)
    if f.flag("use_sliding_window", arch == "mistral") and window:
        length = min(length, window)
    return length


def _rope(f: _Fields) -> tuple[dict[str, Any], str]:
    key = "rope_parameters" if f.data.get("rope_parameters") else "rope_scaling"
    rope = f.get(key, {})
    if not isinstance(rope, dict):
        raise f.error(f"{key}={rope!r} must be a JSON object (or null)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise UnsupportedModelError(
            f"{f.source}: rope scaling {rope_type!r} is not supported (use default or llama3)")
    if rope_type == "llama3":  # the keys the llama3 frequency ramp reads, checked here
        r = _Fields(rope, f"{f.source} ({key})")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            r.number(name)
        r.integer("original_max_position_embeddings")
    return rope, rope_type


def from_hf_config(cfg: dict[str, Any], source: str) -> ModelConfig:
    """`source` names the config.json file."""
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{source}: holds a JSON {type(cfg).__name__}, not the JSON object "
                             f"of an HF config; fix the file or fetch it again")
    arch = cfg.get("model_type", "")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source}: model_type {arch!r} is not supported; this engine runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} checkpoints")
    f = _Fields(cfg, source)
    hidden, heads, kv_heads, head_dim = _head_layout(
        f, "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    rope, rope_type = _rope(f)
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return ModelConfig(
        architecture=arch, hidden_size=hidden, num_layers=f.integer("num_hidden_layers"),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=f.integer("intermediate_size"), vocab_size=f.integer("vocab_size"),
        rms_norm_eps=f.number("rms_norm_eps", 1e-6),
        rope_theta=f.number("rope_theta", value=theta),
        max_position_embeddings=_context_length(f, arch),
        tie_word_embeddings=f.flag("tie_word_embeddings", False),
        qkv_bias=arch == "qwen2" or f.flag("attention_bias", False),
        rope_scaling=dict(rope) if rope_type == "llama3" else None,
        bos_token_id=f.integer("bos_token_id", None, minimum=0),
        eos_token_ids=f.token_ids("eos_token_id"),
    )


def from_gguf_metadata(meta: dict[str, Any], has_output_tensor: bool, source: str) -> ModelConfig:
    arch = meta.get("general.architecture", "")
    if arch not in ("llama", "qwen2"):
        raise UnsupportedModelError(
            f"{source}: GGUF architecture {arch!r} is not supported (llama-family or qwen2 only)")
    p, f = f"{arch}.", _Fields(meta, source)
    if meta.get(p + "rope.scaling.type") not in (None, "none"):
        raise UnsupportedModelError(f"{source}: GGUF rope scaling is not supported yet")
    hidden, heads, kv_heads, head_dim = _head_layout(
        f, p + "embedding_length", p + "attention.head_count", p + "attention.head_count_kv",
        p + "attention.key_length")
    return ModelConfig(
        architecture=arch, hidden_size=hidden, num_layers=f.integer(p + "block_count"),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=f.integer(p + "feed_forward_length"),
        vocab_size=f.integer(p + "vocab_size"),
        rms_norm_eps=f.number(p + "attention.layer_norm_rms_epsilon"),
        rope_theta=f.number(p + "rope.freq_base", 10000.0),
        max_position_embeddings=f.integer(p + "context_length", 2048),
        tie_word_embeddings=not has_output_tensor,
        qkv_bias=arch == "qwen2",
        bos_token_id=f.integer("tokenizer.ggml.bos_token_id", None, minimum=0),
        eos_token_ids=f.token_ids("tokenizer.ggml.eos_token_id"),
    )
