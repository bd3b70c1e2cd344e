"""The walkthrough across prompt lengths: one JSON line per run, and a plot of arithmetic
intensity and achieved FLOP/s against prompt length, prefill vs decode, with the ridge marked."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from engine.observe.claims import PROJECTIONS, model_projection_intensity, projection_intensity, tokens_for_intensity


def _phase(section: dict) -> dict:
    ops = section["ops"]
    proj = [op for op in ops if op["name"] in PROJECTIONS]
    proj_s = sum(op["time_s"] for op in proj)
    op_s = sum(op["time_s"] for op in ops)
    attn = [op for op in ops if op["name"] == "attention"]
    return {"tokens": section["tokens"], "intensity": section["intensity"],
            "flops_per_s": section["total_flops"] / section["wall_s"] if section["wall_s"] else 0.0,
            "projection_intensity": projection_intensity(section),
            "projection_flops_per_s": sum(op["flops"] for op in proj) / proj_s if proj_s else 0.0,
            "attention_flop_share": sum(op["flops"] for op in attn) / max(section["total_flops"], 1),
            "attention_time_share": sum(op["time_s"] for op in attn) / op_s if op_s else 0.0}


def sweep_row(d: dict, claims: list[dict], requested_len: int | None = None) -> dict:
    """The numbers of one walkthrough that the sweep plots, plus every claim's verdict."""
    m, hw = d["model"], d["hardware"]
    return {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "model": m["name"], "dtype": m["dtype"], "tp": m["tp"],
            "model_shape": {k: m[k] for k in ("hidden", "heads", "kv_heads", "head_dim", "ffn", "dtype")},
            "hardware": hw["name"], "peak_flops": hw["peak_flops"], "peak_bytes_per_s": hw["peak_bytes_per_s"],
            "ridge": hw["ridge_flops_per_byte"], "prompt_len": d["prefill"]["tokens"],
            "requested_len": requested_len or d["prefill"]["tokens"], "ttft_s": d["ttft"]["total_s"],
            "prefill": _phase(d["prefill"]), "decode": _phase(d["decode"]),
            "claims": {c["key"]: c["verdict"] for c in claims}}


def append_row(path: Path, row: dict) -> list[dict]:
    """Append `row`; all rows of the file, a later run of the same setting replacing an earlier one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    latest: dict[tuple, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            latest[(r["model"], r["dtype"], r["tp"], r["hardware"], r["prompt_len"])] = r
    return list(latest.values())


def sweep_png(rows: list[dict], path: Path) -> Path:
    """Left: projection intensity against prompt length (and the model's curve); right: achieved FLOP/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    last = rows[-1]  # the plot is of the latest run's setting
    rows = sorted((r for r in rows if (r["model"], r["dtype"], r["tp"], r["hardware"]) ==
                   (last["model"], last["dtype"], last["tp"], last["hardware"])), key=lambda r: r["prompt_len"])
    lens = [r["prompt_len"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for phase, colour in (("prefill", "tab:blue"), ("decode", "tab:orange")):
        left.plot(lens, [r[phase]["projection_intensity"] for r in rows], "o-", color=colour,
                  label=f"{phase} projections (measured)")
        right.plot(lens, [r[phase]["projection_flops_per_s"] for r in rows], "o-", color=colour,
                   label=f"{phase} projections")
        right.plot(lens, [r[phase]["flops_per_s"] for r in rows], "x--", color=colour, alpha=0.6,
                   label=f"{phase}, whole pass")
    ts = np.unique(np.logspace(0, np.log10(max(max(lens), 16) * 2), 80).astype(int))
    left.plot(ts, [model_projection_intensity(last["model_shape"], int(t)) for t in ts], ":", color="tab:blue",
              lw=1, label="prefill, counted from the shapes")
    # a measured roof differs from run to run: the median of the runs' roofs stands for them all
    ridge, peak = statistics.median(r["ridge"] for r in rows), statistics.median(r["peak_flops"] for r in rows)
    cross = tokens_for_intensity(last["model_shape"], ridge)
    left.axhline(ridge, color="k", ls="--", lw=1, label=f"ridge of {last['hardware']}: {ridge:.1f} FLOP/B"
                 + (f" (median of {len(rows)} runs)" if len(rows) > 1 else ""))
    if cross:
        left.axvline(cross, color="grey", ls=":", lw=1)
        left.annotate(f"prefill compute-bound\nfrom ~{cross} tokens" if cross > 1 else "prefill right of\nthe ridge "
                      "at any length", (cross, ridge), xytext=(6, 12), textcoords="offset points", fontsize=8)
    right.axhline(peak, color="k", ls="--", lw=1, label=f"peak of {last['hardware']}")
    for ax, ylabel in ((left, "arithmetic intensity (FLOP/byte)"), (right, "achieved FLOP/s")):
        ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel=ylabel)
        ticks = sorted(set(lens) | ({1, 10} if ax is left else set()))  # left also draws the model's curve
        ax.set_xticks(ticks, [str(n) for n in ticks])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7.5)
    fig.suptitle(f"{last['model']} {last['dtype']} tp={last['tp']}: where prefill becomes compute-bound",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
