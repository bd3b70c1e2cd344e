"""The `logprobs` object of OpenAI's completions API, from `LLM.score`.

The engine does not keep the log-probabilities of the tokens it samples; scoring the prompt and
the generated tokens in one more forward pass gives them exactly (as the model's plain
log-softmax, before temperature), and with `echo` the prompt's own as well: the call eval
harnesses make for log-likelihoods."""
from __future__ import annotations

from engine import LLM


def completion_logprobs(llm: LLM, prompt_ids: list[int], generated: list[int], k: int,
                        echo: bool) -> dict:
    """tokens, token_logprobs, top_logprobs (the k likeliest and the token itself) and
    text_offset of the generated tokens, the prompt's first when `echo` (whose very first token
    has no log-probability: nothing precedes it)."""
    ids = prompt_ids + generated
    logprobs: list[float | None] = [None]
    tops: list[list[tuple[int, float]]] = [[]]
    if len(ids) >= 2:
        [scored] = llm.score([ids], top_logprobs=k)
        logprobs += scored.logprobs
        tops += scored.top_logprobs or [[] for _ in scored.logprobs]
    piece = llm.tokenizer.piece
    shown = range(0 if echo else len(prompt_ids), len(ids))
    tokens = [piece(ids[i]) for i in shown]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    top = [None if logprobs[i] is None else
           {**{piece(t): lp for t, lp in tops[i]}, piece(ids[i]): logprobs[i]} for i in shown]
    return {"tokens": tokens, "token_logprobs": [logprobs[i] for i in shown],
            "top_logprobs": top, "text_offset": offsets}
