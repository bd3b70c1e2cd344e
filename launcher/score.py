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

import json
import math
from pathlib import Path

import hydra
from omegaconf import DictConfig
from tqdm import tqdm

from launcher.common import CONF_DIR, llm_from_config


class ScoreInputError(ValueError):
    """An input file or setting of the score app that cannot be used; names it and the fix."""


def load_documents(path: str, fmt: str = "auto", field: str = "prompt",
                   text_split: str = "line") -> list[dict]:
    """[{"prompt": text or token ids, ...other JSONL keys}] from a text or JSONL file."""
    p = Path(path)
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
        docs = [text] if text_split == "file" else [ln for ln in text.splitlines() if ln.strip()]
        return [{"prompt": d} for d in docs]
    if fmt != "jsonl":
        raise ScoreInputError(f"format={fmt!r}: use 'auto', 'text' or 'jsonl'")
    return [_jsonl_doc(path, n, line, field)
            for n, line in enumerate(text.splitlines(), 1) if line.strip()]


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
    return {**obj, "prompt": value}


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


def run(cfg: DictConfig) -> list[dict]:
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
        ids = [d["prompt"] if isinstance(d["prompt"], list) else llm.tokenizer.encode(d["prompt"])
               for d in docs]
        results = score_documents(llm, ids, window, stride, cfg.batch_size, cfg.progress)
    with open(cfg.output, "w", encoding="utf-8") as f:
        for doc, r in zip(docs, results):
            extra = {k: v for k, v in doc.items() if k != "prompt"}  # e.g. the document's id
            f.write(json.dumps({**extra, **r}) + "\n")
    return results


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="score")
def main(cfg: DictConfig) -> None:
    results = run(cfg)
    scored = [r for r in results if r["perplexity"] is not None]
    total = sum(r["scored_tokens"] for r in scored)
    mean = math.exp(sum(r["nll"] for r in scored) / total) if total else float("nan")
    print(f"{len(results)} documents, {total} tokens scored, corpus perplexity {mean:.3f} "
          f"-> {cfg.output}")


if __name__ == "__main__":
    main()
