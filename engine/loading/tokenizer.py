"""Tokenizers from the model's own source: tokenizer.json beside safetensors, or the
vocabulary and merges embedded in a GGUF file."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from engine.loading.checkpoint import Checkpoint, GGUFCheckpoint

_GGUF_CONTROL_TOKEN = 3


class Tokenizer:
    def __init__(self, backend: HFTokenizer, bos_id: int | None = None):
        self.backend = backend
        self.bos_id = bos_id  # prepended by hand when the GGUF asks for it

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text).ids
        return [self.bos_id, *ids] if self.bos_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def piece(self, token_id: int) -> str:
        """The text one token stands for, as a reader would see it."""
        return self.backend.decode([token_id], skip_special_tokens=False)


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _from_gguf(ckpt: GGUFCheckpoint) -> Tokenizer:
    r = ckpt.reader
    kind = _field(r, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise NotImplementedError(f"{ckpt.source}: GGUF tokenizer {kind!r} is not supported "
                                  f"(byte-level BPE 'gpt2' only)")
    tokens = _field(r, "tokenizer.ggml.tokens")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in _field(r, "tokenizer.ggml.merges")]
    backend = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    # digits one at a time, as SmolLM2 and Llama 3 tokenizers split them
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    backend.decoder = decoders.ByteLevel()
    types = _field(r, "tokenizer.ggml.token_type") or []
    backend.add_special_tokens([tokens[i] for i, t in enumerate(types) if t == _GGUF_CONTROL_TOKEN])
    add_bos = bool(_field(r, "tokenizer.ggml.add_bos_token"))
    return Tokenizer(backend, ckpt.config.bos_token_id if add_bos else None)


def load_tokenizer(ckpt: Checkpoint) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it ships none (then prompts must be token ids)."""
    if isinstance(ckpt, GGUFCheckpoint):
        return _from_gguf(ckpt)
    path = Path(ckpt.source) / "tokenizer.json"
    return Tokenizer(HFTokenizer.from_file(str(path))) if path.is_file() else None
