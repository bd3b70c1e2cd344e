"""Prompts as the user gives them (text, token ids, or a list of either) turned into checked
token-id lists, before anything reaches a rank."""
from __future__ import annotations

import numbers
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.loading.tokenizer import Tokenizer

Prompt = str | list[int]


@dataclass(frozen=True, slots=True)
class PromptLimits:
    """What the engine can serve: the vocabulary and the context. The KV pool needs no check
    per prompt: the start-up check (plan._num_blocks) makes it hold one request of max_model_len
    tokens, the most K/V any request holds (it ends there), so any prompt that fits the context
    fits the cache."""

    model: str
    vocab_size: int
    max_model_len: int


def as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(_is_number(t) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids (each checked later)
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise InvalidRequestError("no prompts given")
        return list(prompts)
    raise InvalidRequestError(f"prompts must be a string, token ids, or a list of them; "
                              f"got {type(prompts).__name__}")


def _is_number(x) -> bool:
    return isinstance(x, numbers.Number)  # bools and floats too, to be refused by name later


def _checked_ids(prompt) -> list[int]:
    """Token ids as plain ints (numpy integers too); a bool or float is named, not cast."""
    ids = []
    for i, t in enumerate(prompt):
        fractional = isinstance(t, numbers.Real) and not isinstance(t, numbers.Integral)
        if isinstance(t, bool) or fractional:
            kind = "bool" if isinstance(t, bool) else "float"
            raise InvalidRequestError(
                f"a prompt must be a string or a list of int token ids; token id {t!r} at "
                f"position {i} is a {kind}: pass ints (e.g. int(t) for whole-number floats)")
        if not isinstance(t, numbers.Integral):
            raise InvalidRequestError(
                f"a prompt must be a string or a list of int token ids; item {i} is "
                f"{type(t).__name__} {t!r}")
        ids.append(int(t))
    return ids


def _text_ids(text: str, tokenizer: Tokenizer | None, model: str) -> list[int]:
    if tokenizer is None:
        raise InvalidRequestError(f"{model} ships no tokenizer; pass token ids")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # the tokenizer would raise a bare TypeError
        raise InvalidRequestError(
            f"prompt text has a lone surrogate {text[e.start]!r} at position {e.start}, which "
            f"is not valid UTF-8; decode the source with errors='replace' or remove it") from None
    return tokenizer.encode(text)


def prompt_token_ids(prompt: Prompt, tokenizer: Tokenizer | None, limits: PromptLimits) -> list[int]:
    """The prompt's token ids, checked against the vocabulary and the context."""
    if isinstance(prompt, str):
        ids = _text_ids(prompt, tokenizer, limits.model)
    elif isinstance(prompt, (list, tuple)):
        ids = _checked_ids(prompt)
    else:
        raise InvalidRequestError(
            f"a prompt must be a string or a list of int token ids, got {type(prompt).__name__}")
    if not ids:
        raise InvalidRequestError("empty prompt: give at least one token")
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary "
                                  f"[0, {limits.vocab_size})")
    if len(ids) > limits.max_model_len:
        raise InvalidRequestError(
            f"prompt of {len(ids)} tokens exceeds max_model_len={limits.max_model_len}; "
            f"shorten it or raise max_model_len (at most the model's context)")
    return ids
