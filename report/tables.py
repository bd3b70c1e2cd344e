"""A walkthrough as numbered parts (heading, lines, a table, a plot), built once from the report's
dict and rendered twice: rich tables in the terminal here, an HTML page in report/html_page.py."""
from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from engine.observe.hardware import roofline_side
from engine.observe.prefill_walk import WalkthroughReport, ops_by_name

PIECES_SHOWN = (32, 8)  # a long prompt shows its first and last pieces; the JSON has them all


@dataclass(slots=True)
class TableData:
    columns: list[str]
    rows: list[list[str]]
    right: tuple[str, ...] = ()  # right-aligned (numeric) columns
    bold_last: bool = False  # a totals row


@dataclass(slots=True)
class Part:
    key: str  # the HTML anchor
    heading: str
    lines: list[str] = field(default_factory=list)
    table: TableData | None = None
    image: str | None = None  # which plot belongs here: "roofline" or "sweep"


def si(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}"


def _ops_table(section: dict, ridge: float) -> TableData:
    rows = []
    for r in ops_by_name(section["ops"]):
        t, flops, nbytes = r["time_s"], r["flops"], r["bytes"]
        intensity = flops / nbytes if nbytes else float("inf")
        rows.append([r["name"], r["shapes"], str(r["count"]), si(flops, ""), si(nbytes, "B"),
                     f"{intensity:.1f}", f"{t * 1e3:.2f} ms", si(flops / t, "") if t else "-",
                     si(nbytes / t, "B") if t else "-", roofline_side(flops, nbytes, ridge)])
    wall = section["wall_s"]
    rows.append(["total", "", "", si(section["total_flops"], ""), si(section["total_bytes"], "B"),
                 f"{section['intensity']:.1f}", f"{wall * 1e3:.1f} ms",
                 si(section["total_flops"] / wall, "") if wall else "-", "", ""])
    return TableData(["op", "shape (rank 0)", "×", "FLOPs", "bytes", "FLOP/B", "time", "FLOP/s", "B/s",
                      "bound"], rows, ("×", "FLOPs", "bytes", "FLOP/B", "time", "FLOP/s", "B/s"), True)


def _prompt_part(d: dict, source: str | None) -> Part:
    p = d["prompt"]
    pairs = [f"{piece!r}:{i}" for piece, i in zip(p["pieces"], p["token_ids"])]
    head, tail = PIECES_SHOWN
    if len(pairs) > head + tail:
        pairs = pairs[:head] + [f"... {len(pairs) - head - tail} more ..."] + pairs[-tail:]
    lines = [f"Source: {source}."] if source else []
    return Part("prompt", f"1. The prompt as {len(p['token_ids'])} tokens", lines + [" ".join(pairs)])


def _model_part(d: dict) -> Part:
    m, hw = d["model"], d["hardware"]
    lines = [f"rank {r['rank']}: query heads {r['q_heads']}, KV heads {r['kv_heads']}, FFN cols {r['ffn']}, "
             f"vocab rows {r['vocab']}, {si(r['weight_bytes'], 'B')} of weights" for r in m["ranks"]]
    lines += _kernel_lines(m["ranks"][0].get("kernels", []))
    lines.append(f"roof: {hw['name']}: {si(hw['peak_flops'], 'FLOP/s')}, {si(hw['peak_bytes_per_s'], 'B/s')}, "
                 f"ridge at {hw['ridge_flops_per_byte']:.1f} FLOP/byte")
    return Part("model", f"2. The model {m['name']}: {m['layers']} layers, d_model {m['hidden']}, {m['heads']} "
                f"query / {m['kv_heads']} KV heads of dim {m['head_dim']}, FFN {m['ffn']}, vocab {m['vocab']}, "
                f"{si(m['params'], 'params')}, {m['dtype']}, tp={m['tp']}", lines)


def _kernel_lines(picks: list[str]) -> list[str]:
    """How many (shape, row bucket) cases each kernel won when timed at start-up."""
    if not picks:
        return ["kernels: the built-in choice (kernel_choice='fixed', or not a CPU)"]
    won: dict[str, dict[str, int]] = {}  # op -> kernel -> cases won, ops as first seen
    for pick in picks:
        op, kernel = pick.split(" ", 1)[0], pick.split(": ", 1)[1].split(" ", 1)[0]
        counts = won.setdefault(op, {})
        counts[kernel] = counts.get(kernel, 0) + 1
    # decode-weights: bf16 models only; prompt-weights: where oneDNN multiplies the dtype;
    # int8-rows: weights="int8"/"int4"/"gguf"; int4-rows: weights="int4"/"gguf"; graph-*:
    # compile=True, one rank. An op this list
    # does not know yet still gets its line, after these.
    known = ("linear", "attention", "decode-attention", "decode-weights", "prompt-weights",
             "int8-rows", "int4-rows", "graph-linear", "graph-prompt", "graph-decode", "graph-decode-attention")
    lines = []
    for op in [op for op in known if op in won] + [op for op in won if op not in known]:
        total = sum(won[op].values())
        lines.append(f"{op} kernels timed here at start-up (rank 0): "
                     + ", ".join(f"{k} fastest in {n} of {total} shape/row cases"
                                 for k, n in sorted(won[op].items())))
    return lines


def _kv_part(d: dict) -> Part:
    kv = d["kv_cache"]
    blocks = kv["block_table"]
    shown = str(blocks) if len(blocks) <= 12 else f"[{', '.join(map(str, blocks[:8]))}, ... {blocks[-1]}]"
    rows = [[str(r["rank"]), str(r["kv_heads"]), si(r["bytes_per_token"], "B"), si(r["bytes_held"], "B"),
             r["cache_shape"]] for r in kv["ranks"]]
    return Part("kv_cache", f"4. KV cache after prefill: {kv['tokens']} tokens in {len(blocks)} blocks of "
                f"{kv['block_size']}", [f"block table: {shown}"],
                TableData(["rank", "KV heads", "bytes/token", "bytes held", "cache tensor shape"], rows,
                          ("bytes/token", "bytes held")))


def _decode_and_cache_parts(d: dict) -> list[Part]:
    pi, di = d["prefill"]["intensity"], d["decode"]["intensity"]
    s = d["cache_savings"]
    flop_x = s["flops_recompute"] / s["flops_with_cache"]
    time_x = s["time_recompute_s"] / s["time_with_cache_s"] if s["time_with_cache_s"] else 0.0
    return [
        Part("decode", "6. One decode step: the same ops on one new token",
             [f"arithmetic intensity: prefill {pi:.1f} FLOP/byte, decode {di:.2f} FLOP/byte ({pi / di:.0f}x "
              "lower): decode reads every weight to make one token"],
             _ops_table(d["decode"], d["hardware"]["ridge_flops_per_byte"])),
        Part("cache_savings", f"7. What the cache saved over {s['tokens']} generated tokens",
             [f"{si(s['flops_with_cache'], 'FLOP')} with it, {si(s['flops_recompute'], 'FLOP')} recomputing "
              f"({flop_x:.1f}x); measured {s['time_with_cache_s']:.2f} s vs {s['time_recompute_s']:.2f} s "
              f"({time_x:.1f}x)"]),
    ]


def _comm_lines(d: dict) -> list[str]:
    """Rank 0's communication per phase: in flight in all, and exposed (the rank waiting)."""
    if d["model"]["tp"] * d["model"].get("cp", 1) == 1:
        return ["communication: none (one rank)"]
    return [f"communication on rank 0, {phase}: {c['total_s'] * 1e3:.2f} ms in flight in total, "
            f"{c['exposed_s'] * 1e3:.2f} ms exposed (waiting on it), "
            f"{(c['total_s'] - c['exposed_s']) * 1e3:.2f} ms hidden behind compute"
            for phase, c in d["comm"].items()]


def _ttft_part(d: dict) -> Part:
    total = d["ttft"]["total_s"]
    rows = [[part, f"{secs * 1e3:.2f} ms", f"{secs / total:.1%}"] for part, secs in d["ttft"]["parts"].items()]
    return Part("ttft", f"8. TTFT {total * 1e3:.1f} ms, part by part", _comm_lines(d),
                TableData(["part", "time", "share"], rows, ("time", "share")))


def _measured(numbers: dict) -> str:
    """A claim's numbers, short: shares as percentages, bytes and rates in SI units."""
    out = []
    for k, v in numbers.items():
        label = k.replace("_per_s", "/s").replace("flops", "FLOP").replace("_", " ")
        if isinstance(v, float):
            if k.endswith("_s") and not k.endswith("per_s"):
                label, v = label[:-2], f"{v * 1e3:.1f} ms"
            else:
                v = (f"{v:.1%}" if "share" in k else si(v, "B") if "bytes" in k
                     else si(v, "FLOP/s") if "per_s" in k else f"{v:.3g}")
        elif isinstance(v, int) and "bytes" in k:
            v = f"{v:,}"
        elif isinstance(v, list) and len(v) > 6:
            v = f"[{', '.join(map(str, v[:6]))}, ...] ({len(v)})"
        out.append(f"{label} {v}")
    return "; ".join(out)


def claims_part(claims: list[dict]) -> Part:
    rows = [[c["statement"], _measured(c["measured"]), c["verdict"], c["why"]] for c in claims]
    held = sum(1 for c in claims if c["holds"])
    return Part("claims", f"9. The prefill story's claims, checked against this run ({held} of {len(claims)} hold)",
                ["Each verdict comes from the numbers of this run on this hardware (engine/observe/claims.py)."],
                TableData(["claim", "measured", "verdict", "why / note"], rows))


def parts(report: WalkthroughReport | dict, claims: list[dict] | None = None,
          source: str | None = None) -> list[Part]:
    """The walkthrough's parts in reading order."""
    d = report if isinstance(report, dict) else report.to_dict()
    ridge = d["hardware"]["ridge_flops_per_byte"]
    ft = d["first_token"]
    out = [_prompt_part(d, source), _model_part(d),
           Part("prefill", f"3. Prefill of {d['prefill']['tokens']} tokens: every op, summed over layers and ranks",
                [], _ops_table(d["prefill"], ridge)),
           _kv_part(d),
           Part("first_token", f"5. The first token: {ft['text']!r} (id {ft['id']})",
                ["candidates: " + ", ".join(f"{c['text']!r} {c['prob']:.1%}" for c in ft["candidates"])]),
           *_decode_and_cache_parts(d), _ttft_part(d)]
    if claims is not None:
        out.append(claims_part(claims))
    out.append(Part("roofline", f"{len(out) + 1}. The roofline: one point per op kind", [
        "Median over layers and ranks; whiskers span the fastest and slowest instance. Ops that move "
        "data without arithmetic (embedding, kv_write) have no FLOPs and are not drawn."], image="roofline"))
    return out


def _cell(column: str, value: str) -> str:
    value = escape(value)
    if column == "bound":
        return f"[green]{value}[/]" if value == "compute" else f"[yellow]{value}[/]"
    if column == "verdict":
        return {"holds": f"[green]{value}[/]", "does not hold": f"[red]{value}[/]"}.get(value, f"[dim]{value}[/]")
    return value


def render(report: WalkthroughReport | dict, console: Console, claims: list[dict] | None = None,
           source: str | None = None, images: dict | None = None) -> None:
    """The parts in the terminal; plots are named by their file."""
    console.rule("[bold]A walk through one prefill")
    for part in parts(report, claims, source):
        console.print(f"[bold]{escape(part.heading)}[/]")
        for line in part.lines:
            console.print("   " + escape(line))
        if part.table:
            t = Table()
            for col in part.table.columns:
                t.add_column(col, justify="right" if col in part.table.right else "left",
                             overflow="fold", max_width=60 if col in ("measured", "why / note", "claim") else None)
            last = len(part.table.rows) - 1
            for i, row in enumerate(part.table.rows):
                t.add_row(*(_cell(c, v) for c, v in zip(part.table.columns, row)),
                          style="bold" if part.table.bold_last and i == last else None)
            console.print(t)
        if part.image and images and part.image in images:
            console.print(f"   (plot: {images[part.image]})")
