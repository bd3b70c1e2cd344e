"""The roofline of one walkthrough: one labelled point per op kind and phase, under the roof."""
from __future__ import annotations

import math
import statistics

COLOURS = {"prefill": "tab:blue", "decode": "tab:orange"}
COLLECTIVE = "all_reduce"


def op_points(section: dict) -> list[dict]:
    """Per op name: median intensity and achieved FLOP/s over layers and ranks, with their ranges.
    Ops with no FLOPs, no bytes or no time cannot sit on a log-log roofline and are left out."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for op in section["ops"]:
        if op["flops"] > 0 and op["bytes"] > 0 and op["time_s"] > 0:
            groups.setdefault(op["name"], []).append((op["flops"] / op["bytes"], op["flops"] / op["time_s"]))
    points = []
    for name, vals in groups.items():
        xs, ys = [v[0] for v in vals], [v[1] for v in vals]
        points.append({"name": name, "n": len(vals), "x": statistics.median(xs), "y": statistics.median(ys),
                       "x_range": (min(xs), max(xs)), "y_range": (min(ys), max(ys))})
    return points


def _spread_labels(placed: list[tuple[float, float]], x: float, y: float) -> float:
    """A label height (log10 units) clear of the labels already placed on the same side near x:
    a small greedy repel, so crowded memory-bound ops stay readable."""
    import math

    lx, ly = math.log10(x), math.log10(y)
    for _ in range(60):
        if all(abs(lx - px) > 0.5 or abs(ly - py) > 0.11 for px, py in placed):
            break
        ly += 0.11
    placed.append((lx, ly))
    return 10 ** ly


def _draw_roof(ax, hw: dict, x_lo: float, x_hi: float) -> None:
    import numpy as np

    peak, bw, ridge = hw["peak_flops"], hw["peak_bytes_per_s"], hw["ridge_flops_per_byte"]
    xs = np.logspace(np.log10(min(x_lo, ridge) / 3), np.log10(max(x_hi, ridge) * 5), 300)
    ax.loglog(xs, np.minimum(peak, xs * bw), "k-", lw=1.5,
              label=f"roof: {hw['name']} ({peak / 1e9:.0f} GFLOP/s, {bw / 1e9:.0f} GB/s)")
    ax.axvline(ridge, color="grey", ls=":", lw=1)
    ax.text(ridge * 1.08, peak * 1.15, f"ridge {ridge:.1f} FLOP/B", color="grey", fontsize=8)


def roofline_png(d: dict, path: str) -> None:
    """One point per op kind for prefill and for the decode step, labelled, whiskers for the spread."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6.5))
    points = {phase: op_points(d[phase]) for phase in ("prefill", "decode")}
    xs = [p["x"] for ps in points.values() for p in ps] or [1.0]
    _draw_roof(ax, d["hardware"], min(xs), max(xs))
    placed: dict[str, list[tuple[float, float]]] = {"prefill": [], "decode": []}
    for phase, ps in points.items():
        # prefill labelled to the right of its points, decode to the left: the phases overlap in x
        right = phase == "prefill"
        for p in ps:
            reduce = p["name"] == COLLECTIVE
            colour = "tab:red" if reduce else COLOURS[phase]
            xerr = [[p["x"] - p["x_range"][0]], [p["x_range"][1] - p["x"]]]
            yerr = [[p["y"] - p["y_range"][0]], [p["y_range"][1] - p["y"]]]
            ax.errorbar(p["x"], p["y"], xerr=xerr, yerr=yerr, fmt="D" if reduce else "o", ms=7 if reduce else 6,
                        color=colour, mfc=colour if phase == "prefill" else "white", ecolor=colour,
                        elinewidth=0.8, capsize=2)
            ly = _spread_labels(placed[phase], p["x"], p["y"])
            # the label clears every neighbouring point on its side, so a cluster's labels form a column
            near = [q["x"] for q in ps
                    if abs(math.log10(q["x"] / p["x"])) < 0.4 and abs(math.log10(q["y"] / p["y"])) < 0.5]
            lx = max(near) * 1.15 if right else min(near) * 0.87
            ax.annotate(p["name"], (p["x"], p["y"]), xytext=(lx, ly),
                        fontsize=7.5, color=colour, ha="left" if right else "right", va="center",
                        arrowprops={"arrowstyle": "-", "color": colour, "lw": 0.4}
                        if (ly, lx) != (p["y"], p["x"] * (1.15 if right else 0.87)) else None)
    handles = [plt.Line2D([], [], color="k", lw=1.5, label=ax.get_legend_handles_labels()[1][0]),
               plt.Line2D([], [], marker="o", ls="", color=COLOURS["prefill"],
                          label=f"prefill, {d['prefill']['tokens']} tokens"),
               plt.Line2D([], [], marker="o", ls="", color=COLOURS["decode"], mfc="white", label="one decode step"),
               plt.Line2D([], [], marker="D", ls="", color="tab:red", label="all-reduce (filled: prefill)")]
    if not any(p["name"] == COLLECTIVE for ps in points.values() for p in ps):
        handles.pop()  # tp=1: no all-reduce to show
    ax.legend(handles=handles, loc="lower right", fontsize=8)
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("achieved FLOP/s")
    ax.set_title(f"Roofline of {d['model']['name']} ({d['model']['dtype']}, tp={d['model']['tp']}): "
                 "median per op kind, whiskers = range over layers and ranks", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
