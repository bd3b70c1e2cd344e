"""Plots of the benchmark results file: TTFT against prompt length, and TP scaling."""
from __future__ import annotations

import json
from pathlib import Path


def bench_plots(results: Path, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    out_dir.mkdir(parents=True, exist_ok=True)
    latest: dict[tuple, dict] = {}
    for r in rows:  # a later run of the same configuration replaces an earlier one
        latest[(r["model"], r["dtype"], r["tp"], r["prompt_len"])] = r
    series: dict[tuple, list[dict]] = {}
    for (model, dtype, tp, _), r in sorted(latest.items()):
        series.setdefault((model, dtype, tp), []).append(r)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (model, dtype, tp), rs in series.items():
        ax.plot([r["prompt_len"] for r in rs], [r["ttft_s"] * 1e3 for r in rs], "o-",
                label=f"{model} {dtype} tp={tp}")
        if rs[0].get("transformers_ttft_s") and tp == 1:
            ax.plot([r["prompt_len"] for r in rs], [r["transformers_ttft_s"] * 1e3 for r in rs],
                    "x--", label=f"transformers {dtype}")
    ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="TTFT (ms)",
           title="Time to first token against prompt length")
    ax.legend()
    ttft_png = out_dir / "ttft_vs_prompt_len.png"
    fig.tight_layout()
    fig.savefig(ttft_png, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_len: dict[tuple, list[dict]] = {}
    for (model, dtype, tp, length), r in sorted(latest.items()):
        by_len.setdefault((model, dtype, length), []).append(r)
    for (model, dtype, length), rs in by_len.items():
        ax.plot([r["tp"] for r in rs], [r["prefill_tok_s"] for r in rs], "o-", label=f"{length} tokens")
    ax.set(xlabel="tensor-parallel ranks", ylabel="prefill tokens/s", title="TP scaling of prefill")
    ax.legend()
    scaling_png = out_dir / "tp_scaling.png"
    fig.tight_layout()
    fig.savefig(scaling_png, dpi=100)
    plt.close(fig)
    return [ttft_png, scaling_png]
