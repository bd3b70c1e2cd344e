"""`prefill walkthrough`: run one real prefill, explain it op by op, check the prefill story's
claims against it, and write files to keep (JSON, trace, roofline, sweep row and plot, HTML)."""
from __future__ import annotations

import launcher  # noqa: F401  first: run by its path, it relaunches preloaded before torch loads

import json
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from engine.observe.claims import check_claims
from launcher.hydra_main import hydra_app, integer, text
from launcher.build_engine import llm_from_config
from launcher.document import document_prompt
from report.html_page import write_html
from report.tables import parts, render
from report.roofline import roofline_png
from launcher.sweep import append_row, sweep_png, sweep_row


def _prompt(cfg: DictConfig, llm, console: Console) -> tuple[object, str | None]:
    """The prompt to walk through, and where it came from: `prompt` as given, else the first
    `prompt_len` tokens of the shipped document (cut to leave room for the decode tokens)."""
    if cfg.prompt is not None:
        prompt = cfg.prompt if isinstance(cfg.prompt, str) else list(OmegaConf.to_container(cfg.prompt))
        return prompt, None
    if llm.tokenizer is None:
        raise ValueError(f"{cfg.model.path} has no tokenizer to read the document with: "
                         "give prompt=[id,id,...] instead")
    room = llm.max_model_len - max(cfg.decode_tokens, 2)
    n = int(cfg.prompt_len)
    if n > room:
        console.print(f"[yellow]prompt_len={n} leaves no room for {max(cfg.decode_tokens, 2)} generated tokens "
                      f"in the model's {llm.max_model_len}-token context: using {room}[/]")
        n = room
    return document_prompt(llm.tokenizer, n)


def _shorter_run(cfg: DictConfig, llm, prompt) -> dict | None:
    """A second, shorter walkthrough of the same text for the attention-share claim."""
    ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    n = cfg.short_len if cfg.short_len is not None else max(16, len(ids) // 8)
    if n <= 0 or n >= len(ids):
        return None
    return llm.walkthrough(ids[:n], hardware=cfg.hardware, decode_tokens=1, top_k=1).to_dict()


def check(cfg: DictConfig) -> None:
    """The app's own keys, before any model loads (the engine checks engine.* and parallel.*)."""
    integer(cfg, "decode_tokens")
    integer(cfg, "top_k")
    integer(cfg, "short_len", minimum=0, allow_none=True)
    if cfg.prompt is None:
        integer(cfg, "prompt_len")
    elif isinstance(cfg.prompt, str):
        text(cfg, "prompt")


def run(cfg: DictConfig, console: Console) -> dict[str, Path]:
    check(cfg)
    with llm_from_config(cfg) as llm:
        prompt, source = _prompt(cfg, llm, console)
        report = llm.walkthrough(prompt, hardware=cfg.hardware, decode_tokens=cfg.decode_tokens, top_k=cfg.top_k)
        shorter = _shorter_run(cfg, llm, prompt)
    d = report.to_dict()
    claims = [c.to_dict() for c in check_claims(d, shorter)]
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "walkthrough.json", "trace": out / "trace.json", "roofline": out / "roofline.png",
             "sweep_rows": Path(cfg.sweep_results), "sweep": out / "sweep.png", "html": out / "report.html"}
    rows = append_row(files["sweep_rows"], sweep_row(d, claims, cfg.prompt_len if source else None))
    sweep_png(rows, files["sweep"])
    roofline_png(d, str(files["roofline"]))
    render(d, console, claims, source, {"roofline": files["roofline"], "sweep": files["sweep"]})
    files["json"].write_text(json.dumps({**d, "claims": claims, "source": source,
                                         "shorter_run": _summary(shorter)}, indent=1))
    trace = report.chrome_trace()
    files["trace"].write_text(json.dumps(trace))
    write_html(files["html"], parts(d, claims, source), {"roofline": files["roofline"], "sweep": files["sweep"]},
               trace, f"A walk through one prefill: {d['model']['name']}, {d['prefill']['tokens']} tokens")
    console.print(f"wrote {files['json']} (every number), {files['trace']} (open in ui.perfetto.dev), "
                  f"{files['roofline']}, {files['html']} (the page to share); appended a row to "
                  f"{files['sweep_rows']}, redrew {files['sweep']}")
    return files


def _summary(shorter: dict | None) -> dict | None:
    """The shorter run's totals (its per-op detail stays out of the JSON: the claims quote it)."""
    if shorter is None:
        return None
    return {phase: {k: shorter[phase][k] for k in ("tokens", "wall_s", "total_flops", "total_bytes", "intensity")}
            for phase in ("prefill", "decode")}


@hydra_app("walkthrough")
def main(cfg: DictConfig) -> None:
    # the tables need ~150 columns; a pipe or a log file gets that width instead of rich's 80
    run(cfg, Console() if sys.stdout.isatty() else Console(width=150))


if __name__ == "__main__":
    main()
