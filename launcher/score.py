"""`prefill score input=docs.jsonl`: the perplexity of every document in a file.

A text file holds one document per non-empty line (or is one document with text_split=file); a
JSONL file holds one object per line whose `field` key is the text or a list of token ids. Out
comes one JSON line per document: its token count, the tokens scored, the summed negative
log-likelihood and the perplexity.

A document longer than the window (max_model_len by default) is scored with strided sliding
windows: windows start every `stride` tokens, each one at most `window` long, and each scores only
the tokens the previous windows did not, with the tokens before them in the window as context.
Every token but the first is scored exactly once; a smaller stride gives each more context.
"""
from __future__ import annotations

import launcher  # noqa: F401  first: run by its path, it relaunches preloaded before torch loads

import json
import math
from pathlib import Path

from omegaconf import DictConfig
from tqdm import tqdm

from launcher.hydra_main import BadSetting, boolean, hydra_app, integer
from launcher.build_engine import llm_from_config


class ScoreInputError(BadSetting):
    """An input file or setting of the score app that cannot be used; names it and the fix."""


def load_documents(path: str, fmt: str = "auto", field: str = "prompt",
                   text_split: str = "line") -> list[dict]:
    """[{"prompt": text or token ids, "_where": file:line, ...other JSONL keys}] from a text or
    JSONL file; at least one."""
    p = Path(path)
    if p.is_dir():
        raise ScoreInputError(f"input={path!r} is a directory; give a text or JSONL file")
    if not p.is_file():
        raise ScoreInputError(f"input={path!r}: no such file; give a text or JSONL file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ScoreInputError(f"input={path!r} is not UTF-8 ({e.reason} at byte {e.start}); "
                              f"re-encode it as UTF-8") from None
    if fmt == "auto":
        fmt = "jsonl" if p.suffix in (".jsonl", ".ndjson") else "text"
    if fmt == "text":
        if text_split not in ("line", "file"):
            raise ScoreInputError(f"text_split={text_split!r}: use 'line' or 'file'")
        docs = ([{"prompt": text, "_where": path}] if text_split == "file" and text.strip() else
                [{"prompt": ln, "_where": f"{path}:{n}"}
                 for n, ln in enumerate(text.splitlines(), 1) if ln.strip()])
    elif fmt == "jsonl":
        docs = [_jsonl_doc(path, n, line, field)
                for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    else:
        raise ScoreInputError(f"format={fmt!r}: use 'auto', 'text' or 'jsonl'")
    if not docs:
        raise ScoreInputError(f"input={path!r} holds no documents (it is empty or blank); give "
                              f"a file with text to score")
    return docs


def _jsonl_doc(path: str, lineno: int, line: str, field: str) -> dict:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ScoreInputError(f"{where} is not JSON ({e.msg}); each line must be an object "
                              f"like {{\"{field}\": \"text\"}}") from None
    if not isinstance(obj, dict) or field not in obj:
        raise ScoreInputError(f"{where}: expected an object with a {field!r} key, got "
                              f"{line.strip()[:60]!r}; set field= to the key holding the text")
    value = obj[field]
    ids = isinstance(value, list) and all(type(t) is int for t in value)
    if not isinstance(value, str) and not ids:
        raise ScoreInputError(f"{where}: {field!r} must be a string or a list of token ids, "
                              f"got {type(value).__name__}")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # a JSON escape like \ud800 the tokenizer cannot take
            raise ScoreInputError(f"{where}: {field!r} holds a lone surrogate {value[e.start]!r} "
                                  f"at character {e.start}, which is not valid UTF-8; fix or "
                                  f"remove it") from None
    return {**obj, "prompt": value, "_where": where}


def windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored token) of each window over tokens [0, num_tokens): windows
    start every `stride` tokens; each scores tokens [first, end), those no earlier window did."""
    if not 1 <= stride < window:
        raise ScoreInputError(f"stride={stride} with window={window}: use 1 <= stride < window, "
                              f"so every window has a token left to score")
    out, begin, prev_end = [], 0, 0
    while True:
        end = min(begin + window, num_tokens)
        out.append((begin, end, max(prev_end, begin + 1)))
        if end == num_tokens:
            return out
        prev_end, begin = end, begin + stride


def score_documents(llm, docs: list[list[int]], window: int, stride: int, batch_size: int = 16,
                    progress: bool = False) -> list[dict]:
    """Per document: tokens, scored tokens, summed NLL, perplexity and the number of windows.
    Windows of several documents go to the engine together, `batch_size` per call."""
    if type(batch_size) is not int or batch_size < 1:
        raise ScoreInputError(f"batch_size={batch_size!r}: use an integer >= 1")
    jobs = [(d, w) for d, ids in enumerate(docs) if len(ids) >= 2
            for w in windows(len(ids), window, stride)]
    nll = [0.0] * len(docs)
    count = [0] * len(docs)
    bar = tqdm(total=sum(len(ids) for ids in docs if len(ids) >= 2), unit="tok",
               disable=not progress)
    for i in range(0, len(jobs), batch_size):
        part = jobs[i:i + batch_size]
        outs = llm.score([docs[d][b:e] for d, (b, e, _) in part])
        for (d, (b, e, first)), out in zip(part, outs):
            # out.logprobs[j] scores token b + j + 1
            nll[d] -= math.fsum(out.logprobs[first - b - 1:e - b - 1])
            count[d] += e - first
            bar.update(e - first + (1 if b == 0 else 0))
    bar.close()
    results = []
    for d, ids in enumerate(docs):
        r = {"tokens": len(ids), "scored_tokens": count[d],
             "windows": len(windows(len(ids), window, stride)) if len(ids) >= 2 else 0}
        if count[d]:
            r.update(nll=nll[d], perplexity=math.exp(nll[d] / count[d]))
        else:
            r.update(nll=None, perplexity=None, skipped="fewer than 2 tokens: nothing to score")
        results.append(r)
    return results


def check(cfg: DictConfig) -> None:
    """The app's own keys, before the model loads (and before any scoring is lost)."""
    integer(cfg, "batch_size")
    integer(cfg, "window", minimum=2, allow_none=True)
    integer(cfg, "stride", allow_none=True)
    boolean(cfg, "progress")
    out = Path(cfg.output)
    if out.is_dir() or not out.parent.is_dir():
        why = "is a directory" if out.is_dir() else f"is in a missing directory {str(out.parent)!r}"
        raise ScoreInputError(f"output={cfg.output!r} {why}; name a file in an existing "
                              f"directory")


def _token_ids(llm, docs: list[dict]) -> list[list[int]]:
    """Each document's token ids, the given ones checked against the model's vocabulary."""
    vocab, out = llm.model_config.vocab_size, []
    for doc in docs:
        prompt = doc["prompt"]
        if isinstance(prompt, str):
            out.append(llm.tokenizer.encode(prompt))
            continue
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ScoreInputError(f"{doc['_where']}: token ids {bad[:5]} are outside the "
                                  f"vocabulary [0, {vocab}) of {llm.config.model}")
        out.append(prompt)
    return out


def run(cfg: DictConfig) -> list[dict]:
    check(cfg)
    docs = load_documents(cfg.input, cfg.format, cfg.field, cfg.text_split)
    with llm_from_config(cfg) as llm:
        window = cfg.window or llm.max_model_len
        if window > llm.max_model_len:
            raise ScoreInputError(f"window={window} exceeds max_model_len={llm.max_model_len}; "
                                  f"use at most that")
        stride = cfg.stride or max(1, window // 2)
        if any(isinstance(d["prompt"], str) for d in docs) and llm.tokenizer is None:
            raise ScoreInputError(f"{cfg.model.path} ships no tokenizer: give token-id lists "
                                  f"in a JSONL file")
        results = score_documents(llm, _token_ids(llm, docs), window, stride, cfg.batch_size,
                                  cfg.progress)
    with open(cfg.output, "w", encoding="utf-8") as f:
        for doc, r in zip(docs, results):
            extra = {k: v for k, v in doc.items() if k not in ("prompt", "_where")}  # e.g. an id
            f.write(json.dumps({**extra, **r}) + "\n")
    return results


@hydra_app("score")
def main(cfg: DictConfig) -> None:
    results = run(cfg)
    scored = [r for r in results if r["perplexity"] is not None]
    total = sum(r["scored_tokens"] for r in scored)
    mean = math.exp(sum(r["nll"] for r in scored) / total) if total else float("nan")
    print(f"{len(results)} documents, {total} tokens scored, corpus perplexity {mean:.3f} "
          f"-> {cfg.output}")


if __name__ == "__main__":
    main()
