"""The walkthrough's default prompt: a plain-English note on prefill, KV caches and decode,
shipped as package data next to this module (so it is found under python -m, the console
script, an installed wheel and a Ray job's working directory alike)."""
from __future__ import annotations

from pathlib import Path

DOCUMENT = Path(__file__).resolve().parent / "data" / "prefill_explained.txt"


def document_prompt(tokenizer, n: int) -> tuple[list[int], str]:
    """The first `n` token ids of the document, and a line saying where they came from. Past the
    document's end it starts again from the top, and the line says so."""
    if n < 1:
        raise ValueError(f"prompt_len={n}: use a positive number of tokens")
    text = DOCUMENT.read_text()
    ids = tokenizer.encode(text)
    source = f"the first {n} tokens of {DOCUMENT.name} ({len(ids)} tokens)"
    if n > len(ids):
        repeats = -(-n // len(ids))
        source = f"{DOCUMENT.name} ({len(ids)} tokens) read {repeats} times over, cut at {n} tokens"
        # the text repeated, not the ids: one BOS at the start, as a real long prompt would have
        ids = tokenizer.encode("\n\n".join([text] * repeats))
    return ids[:n], source
