"""Rendering a walkthrough for people: rich tables in the terminal and a roofline PNG."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from engine.observe.walkthrough import Section, WalkthroughReport


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}"


def _ops_table(title: str, section: Section, ridge: float) -> Table:
    t = Table(title=title, title_justify="left")
    for col in ("op", "shape (rank 0)", "×", "FLOPs", "bytes", "FLOP/B", "time", "FLOP/s", "B/s", "bound"):
        t.add_column(col, justify="left" if col in ("op", "shape (rank 0)", "bound") else "right")
    for row in section.by_op():
        time_s, flops, nbytes = row["time_s"], row["flops"], row["bytes"]
        intensity = flops / nbytes if nbytes else float("inf")
        bound = "compute" if intensity >= ridge else "memory"
        t.add_row(row["name"], row["shapes"], str(row["count"]), _si(flops, ""), _si(nbytes, "B"),
                  f"{intensity:.1f}", f"{time_s * 1e3:.2f} ms",
                  _si(flops / time_s, "") if time_s else "-", _si(nbytes / time_s, "B") if time_s else "-",
                  f"[green]{bound}[/]" if bound == "compute" else f"[yellow]{bound}[/]")
    t.add_row("total", "", "", _si(section.total_flops, ""), _si(section.total_bytes, "B"),
              f"{section.total_flops / max(section.total_bytes, 1):.1f}", f"{section.wall_s * 1e3:.1f} ms",
              _si(section.total_flops / section.wall_s, ""), "", "", style="bold")
    return t


def _kv_table(report: WalkthroughReport) -> Table:
    kv = report.kv_cache
    t = Table(title=f"4. KV cache after prefill: {kv['tokens']} tokens in blocks {kv['block_table']}",
              title_justify="left")
    for col in ("rank", "KV heads", "bytes/token", "bytes held", "cache tensor shape"):
        t.add_column(col)
    for r in kv["ranks"]:
        t.add_row(str(r["rank"]), str(r["kv_heads"]), _si(r["bytes_per_token"], "B"),
                  _si(r["bytes_held"], "B"), r["cache_shape"])
    return t


def render(report: WalkthroughReport, console: Console) -> None:
    d = report.to_dict()
    m, hw = d["model"], d["hardware"]
    console.rule("[bold]A walk through one prefill")
    pieces = " ".join(f"[cyan]{p!r}[/]:{i}" for p, i in zip(d["prompt"]["pieces"], d["prompt"]["token_ids"]))
    console.print(f"[bold]1. The prompt[/] as {len(d['prompt']['token_ids'])} tokens: {pieces}")
    console.print(f"[bold]2. The model[/] {m['name']}: {m['layers']} layers, d_model {m['hidden']}, "
                  f"{m['heads']} query / {m['kv_heads']} KV heads of dim {m['head_dim']}, FFN {m['ffn']}, "
                  f"vocab {m['vocab']}, {_si(m['params'], 'params')}, {m['dtype']}, tp={m['tp']}")
    for r in m["ranks"]:
        console.print(f"   rank {r['rank']}: query heads {r['q_heads']}, KV heads {r['kv_heads']}, "
                      f"FFN cols {r['ffn']}, vocab rows {r['vocab']}, {_si(r['weight_bytes'], 'B')} of weights")
    console.print(f"   roof: {hw['name']}: {_si(hw['peak_flops'], 'FLOP/s')}, "
                  f"{_si(hw['peak_bytes_per_s'], 'B/s')}, ridge at {hw['ridge_flops_per_byte']:.1f} FLOP/byte")
    console.print(_ops_table(f"3. Prefill of {report.prefill.tokens} tokens: every op, summed over "
                             f"layers and ranks", report.prefill, report.hardware.ridge))
    console.print(_kv_table(report))
    cands = ", ".join(f"{c['text']!r} {c['prob']:.1%}" for c in d["first_token"]["candidates"])
    console.print(f"[bold]5. The first token[/]: {d['first_token']['text']!r} (id {d['first_token']['id']}); "
                  f"candidates: {cands}")
    console.print(_ops_table("6. One decode step: the same ops on one new token", report.decode,
                             report.hardware.ridge))
    pi, di = d["prefill"]["intensity"], d["decode"]["intensity"]
    console.print(f"   arithmetic intensity: prefill {pi:.1f} FLOP/byte, decode {di:.2f} FLOP/byte "
                  f"({pi / di:.0f}x lower): decode reads every weight to make one token")
    s = d["cache_savings"]
    console.print(f"[bold]7. What the cache saved[/] over {s['tokens']} generated tokens: "
                  f"{_si(s['flops_with_cache'], 'FLOP')} with it, {_si(s['flops_recompute'], 'FLOP')} "
                  f"recomputing ({s['flops_recompute'] / s['flops_with_cache']:.1f}x); measured "
                  f"{s['time_with_cache_s']:.2f} s vs {s['time_recompute_s']:.2f} s "
                  f"({s['time_recompute_s'] / s['time_with_cache_s']:.1f}x)")
    t = Table(title=f"8. TTFT {d['ttft']['total_s'] * 1e3:.1f} ms, part by part", title_justify="left")
    t.add_column("part")
    t.add_column("time", justify="right")
    t.add_column("share", justify="right")
    for part, secs in d["ttft"]["parts"].items():
        t.add_row(part, f"{secs * 1e3:.2f} ms", f"{secs / d['ttft']['total_s']:.1%}")
    console.print(t)


def roofline_png(report: WalkthroughReport, path: str) -> None:
    """Each op (per layer, per rank) a point: prefill and decode in two colours, under the roof."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    hw = report.hardware
    fig, ax = plt.subplots(figsize=(8, 5.5))
    xs = np.logspace(-2, 4, 200)
    ax.loglog(xs, np.minimum(hw.peak_flops, xs * hw.peak_bytes), "k-", label=f"roof ({hw.name})")
    ax.axvline(hw.ridge, color="grey", ls=":", lw=1)
    for section, colour, label in ((report.prefill, "tab:blue", "prefill"),
                                   (report.decode, "tab:orange", "decode step")):
        pts = [(op["intensity"], op["achieved_flops_per_s"]) for op in section.ops
               if op["flops"] > 0 and op["bytes"] > 0 and op["time_s"] > 0]
        if pts:
            x, y = zip(*pts)
            ax.scatter(x, y, s=12, alpha=0.6, color=colour, label=label)
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("achieved FLOP/s")
    ax.set_title("Roofline: every op of one prefill and one decode step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
