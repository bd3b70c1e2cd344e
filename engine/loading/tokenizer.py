"""Tokenizers from the model's own source: tokenizer.json beside safetensors, or the
vocabulary and merges embedded in a GGUF file."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from engine.loading.checkpoint import Checkpoint, GGUFCheckpoint

_GGUF_CONTROL_TOKEN = 3


class Tokenizer:
    def __init__(self, backend: HFTokenizer, bos_id: int | None = None,
                 chat_template: str | None = None):
        self.backend = backend
        self.bos_id = bos_id  # prepended by hand when the GGUF asks for it
        self.chat_template = chat_template  # Jinja, as the model's authors wrote it

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The conversation as the text the model was trained to read, e.g. a user turn
        followed by the start of the assistant's."""
        if self.chat_template is None:
            raise ValueError("this model ships no chat template; send the raw prompt")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return template.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text).ids
        return [self.bos_id, *ids] if self.bos_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def piece(self, token_id: int) -> str:
        """The text one token stands for, as a reader would see it."""
        return self.backend.decode([token_id], skip_special_tokens=False)


def _from_gguf(ckpt: GGUFCheckpoint) -> Tokenizer:
    field = ckpt.file.metadata.get
    kind = field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise NotImplementedError(f"{ckpt.source}: GGUF tokenizer {kind!r} is not supported "
                                  f"(byte-level BPE 'gpt2' only)")
    tokens = field("tokenizer.ggml.tokens")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
    backend = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    # digits one at a time, as SmolLM2 and Llama 3 tokenizers split them
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    backend.decoder = decoders.ByteLevel()
    types = field("tokenizer.ggml.token_type") or []
    backend.add_special_tokens([tokens[i] for i, t in enumerate(types) if t == _GGUF_CONTROL_TOKEN])
    add_bos = bool(field("tokenizer.ggml.add_bos_token"))
    return Tokenizer(backend, ckpt.config.bos_token_id if add_bos else None,
                     field("tokenizer.chat_template"))


def load_tokenizer(ckpt: Checkpoint) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it ships none (then prompts must be token ids)."""
    if isinstance(ckpt, GGUFCheckpoint):
        return _from_gguf(ckpt)
    path = Path(ckpt.source) / "tokenizer.json"
    if not path.is_file():
        return None
    config = Path(ckpt.source) / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    return Tokenizer(HFTokenizer.from_file(str(path)), chat_template=template)
