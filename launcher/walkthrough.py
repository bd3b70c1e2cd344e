"""`prefill walkthrough`: run one real prefill, then explain it op by op, with files to keep."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig
from rich.console import Console

from launcher.common import CONF_DIR, llm_from_config
from launcher.report import render, roofline_png


def run(cfg: DictConfig, console: Console) -> dict[str, Path]:
    with llm_from_config(cfg) as llm:
        report = llm.walkthrough(cfg.prompt, hardware=cfg.hardware,
                                 decode_tokens=cfg.decode_tokens, top_k=cfg.top_k)
    render(report, console)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "walkthrough.json", "trace": out / "trace.json",
             "roofline": out / "roofline.png"}
    files["json"].write_text(json.dumps(report.to_dict(), indent=1))
    files["trace"].write_text(json.dumps(report.chrome_trace()))
    roofline_png(report, str(files["roofline"]))
    console.print(f"wrote {files['json']} (every number), {files['trace']} (open in "
                  f"ui.perfetto.dev or chrome://tracing), {files['roofline']}")
    return files


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="walkthrough")
def main(cfg: DictConfig) -> None:
    # the tables need ~150 columns; a pipe or a log file gets that width instead of rich's 80
    run(cfg, Console() if sys.stdout.isatty() else Console(width=150))


if __name__ == "__main__":
    main()
