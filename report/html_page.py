"""walkthrough/report.html: the walkthrough's parts as one self-contained page (plots embedded as
base64, the Chrome trace embedded too, with a button that hands it to Perfetto's UI)."""
from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from report.tables import Part

PERFETTO = "https://ui.perfetto.dev"
STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; max-width: 1300px; margin: 2em auto; padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.15em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 13px; margin: .5em 0; }
th, td { border: 1px solid #ccc; padding: 3px 7px; vertical-align: top; }
th { background: #f2f2f2; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.total td { font-weight: bold; } .compute, .holds { color: #157a15; } .memory { color: #a06a00; }
.does-not-hold { color: #b00020; font-weight: bold; } .does-not-apply { color: #777; }
p.tokens { font-family: monospace; font-size: 12px; word-break: break-all; }
img { max-width: 100%; border: 1px solid #eee; } nav a { margin-right: 1em; }
button { font-size: 14px; padding: 4px 12px; }
"""
# Perfetto's UI accepts a trace posted to its window once it answers PING with PONG
OPEN_TRACE = """
function openInPerfetto() {
  const bytes = Uint8Array.from(atob(document.getElementById('trace-data').textContent.trim()), c => c.charCodeAt(0));
  const win = window.open('%(url)s');
  const timer = setInterval(() => win.postMessage('PING', '%(url)s'), 100);
  window.addEventListener('message', function onPong(e) {
    if (e.data !== 'PONG') return;
    clearInterval(timer); window.removeEventListener('message', onPong);
    win.postMessage({perfetto: {buffer: bytes.buffer, title: 'prefill walkthrough', fileName: 'trace.json'}}, '%(url)s');
  });
}
""" % {"url": PERFETTO}


def _table(part: Part) -> str:
    t = part.table
    head = "".join(f"<th>{html.escape(c)}</th>" for c in t.columns)
    body = []
    for i, row in enumerate(t.rows):
        cells = []
        for col, value in zip(t.columns, row):
            cls = ["num"] if col in t.right else []
            if col in ("bound", "verdict") and value:
                cls.append(value.replace(" ", "-"))
            cells.append(f"<td class=\"{' '.join(cls)}\">{html.escape(value)}</td>" if cls
                         else f"<td>{html.escape(value)}</td>")
        total = ' class="total"' if t.bold_last and i == len(t.rows) - 1 else ""
        body.append(f"<tr{total}>{''.join(cells)}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _section(part: Part, images: dict[str, Path]) -> str:
    out = [f'<section id="{part.key}"><h2>{html.escape(part.heading)}</h2>']
    for line in part.lines:
        cls = ' class="tokens"' if part.key == "prompt" and not line.startswith("Source") else ""
        out.append(f"<p{cls}>{html.escape(line)}</p>")
    if part.table:
        out.append(_table(part))
    if part.image and part.image in images:
        out.append(_img(images[part.image], part.heading))
    return "".join(out) + "</section>"


def _trace_section(number: int, trace: dict) -> str:
    data = base64.b64encode(json.dumps(trace).encode()).decode()
    return (f'<section id="trace"><h2>{number}. The timeline, one track per rank</h2>'
            f"<p>The trace of this run is embedded in this page. <button onclick=\"openInPerfetto()\">Open it in "
            f"Perfetto</button> (opens <a href=\"{PERFETTO}\">{PERFETTO}</a> in a new tab and sends it there; "
            f"allow pop-ups). Or open <a href=\"trace.json\">trace.json</a>, written next to this page, by hand: "
            f"on {PERFETTO} choose <i>Open trace file</i>, or drag the file onto the page; "
            f"<code>chrome://tracing</code> reads it too.</p>"
            f'<script type="application/octet-stream" id="trace-data">{data}</script></section>')


def write_html(path: Path, parts: list[Part], images: dict[str, Path], trace: dict, title: str) -> Path:
    """One self-contained page: every part, every image inline, the trace inline."""
    sections = [_section(p, images) for p in parts]
    extra = len(parts)
    if "sweep" in images:
        extra += 1
        sections.append(f'<section id="sweep"><h2>{extra}. The sweep: intensity and FLOP/s against prompt length'
                        f"</h2><p>One row per prompt length in sweep.jsonl (python -m launcher.walkthrough -m "
                        f"prompt_len=128,512,2048,8192).</p>{_img(images['sweep'], 'sweep')}</section>")
    sections.append(_trace_section(extra + 1, trace))
    keys = [p.key for p in parts] + (["sweep"] if "sweep" in images else []) + ["trace"]
    nav = " ".join(f'<a href="#{k}">{i}. {k.replace("_", " ")}</a>' for i, k in enumerate(keys, 1))
    page = (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style><script>{OPEN_TRACE}</script></head><body><h1>{html.escape(title)}</h1>"
            f"<nav>{nav}</nav>{''.join(sections)}</body></html>")
    path.write_text(page, encoding="utf-8")
    return path
