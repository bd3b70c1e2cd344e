"""The walkthrough's claims against a hand count, a claim that fails when its numbers say so,
the sweep's rows, and the HTML page's structure (parsed with the standard library)."""
from __future__ import annotations

import base64
import json
from html.parser import HTMLParser

import pytest

from engine.observe.claims import check_claims
from engine.observe.hardware import Hardware

HW = Hardware("test-roof", peak_flops=1e11, peak_bytes=1e10)  # ridge at 10 FLOP/byte


def hand_projection_intensity(hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int,
                              tokens: int, layers: int = 30, elem: int = 4) -> float:
    """The four weight matmuls of every layer, counted by hand at TP=1: qkv [T, d] x
    [d, (h + 2·kv)·hd], o [M, h·hd] x [h·hd, d], gate/up [M, d] x [d, 2·ffn], down [M, ffn] x
    [ffn, d], where M is T except in the last layer of a prompt of 2 or more, whose o_proj
    and MLP run the sampled row only (M = 1). Each is 2·rows·k·n FLOPs and reads the
    activations (rows·k) and the weights (k·n), writes rows·n elements; but gate/up, which
    applies the SiLU·mul itself (4 FLOPs per output element), writes its M·ffn results only."""
    qkv = (heads + 2 * kv_heads) * head_dim
    flops = elements = 0
    for layer in range(layers):
        m = 1 if layer == layers - 1 and tokens >= 2 else tokens
        flops += 2 * tokens * hidden * qkv + 2 * m * heads * head_dim * hidden
        flops += 2 * m * (hidden * 2 * ffn + ffn * hidden) + 4 * m * ffn
        elements += (tokens * hidden + hidden * qkv + tokens * qkv) \
            + (m * heads * head_dim + heads * head_dim * hidden + m * hidden) \
            + (m * hidden + hidden * 2 * ffn + m * ffn) \
            + (m * ffn + ffn * hidden + m * hidden)
    return flops / (elements * elem)


def _claims(report) -> dict[str, dict]:
    return {c.key: c.to_dict() for c in check_claims(report.to_dict())}


def test_smollm2_2048_tokens_prefill_compute_bound_decode_memory_bound(smollm2_llm):
    from engine.observe.prefill_walk import run_walkthrough
    from launcher.document import document_prompt

    ids, _ = document_prompt(smollm2_llm.tokenizer, 2048)
    assert len(ids) == 2048
    report = run_walkthrough(smollm2_llm, ids, HW, decode_tokens=1, top_k=1)
    claims = _claims(report)
    # SmolLM2-135M: d 576, 9 query / 3 KV heads of 64, FFN 1536; float32 on the CPU
    prefill = claims["prefill_compute_bound"]["measured"]["intensity"]
    decode = claims["decode_memory_bound"]["measured"]["intensity"]
    assert prefill >= 100 and decode <= 2
    assert prefill == pytest.approx(hand_projection_intensity(576, 9, 3, 64, 1536, 2048), rel=1e-9)
    assert decode == pytest.approx(hand_projection_intensity(576, 9, 3, 64, 1536, 1), rel=1e-9)
    assert claims["prefill_compute_bound"]["holds"] and claims["decode_memory_bound"]["holds"]
    one = claims["one_pass"]["measured"]
    assert one["passes"] == 1 and one["tokens_per_pass"] == [2048]
    kv = claims["kv_written_once"]
    assert kv["holds"] and kv["measured"]["written_bytes"] == 2 * 30 * 3 * 64 * 2048 * 4
    assert claims["all_reduce_per_layer"]["holds"] is None  # tp=1
    # the same counts under an H100's roof: its ridge (989 TFLOP/s / 3.35 TB/s = 295) is above 203
    d = report.to_dict()
    d["hardware"] = Hardware("h100", 989e12, 3.35e12).to_dict()
    on_h100 = {c.key: c for c in check_claims(d)}["prefill_compute_bound"]
    assert on_h100.holds is False and "ridge is 295" in on_h100.why


def test_a_12_token_prompt_does_not_reach_100_flop_per_byte(smollm2_llm):
    from engine.observe.prefill_walk import run_walkthrough

    ids = smollm2_llm.tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    assert len(ids) == 12
    report = run_walkthrough(smollm2_llm, ids, HW, decode_tokens=1, top_k=1)
    claim = _claims(report)["prefill_compute_bound"]
    x = claim["measured"]["intensity"]
    assert x == pytest.approx(hand_projection_intensity(576, 9, 3, 64, 1536, 12), rel=1e-9)
    assert x < 10  # below the test roof's ridge too: memory-bound on this roof
    assert claim["holds"] is False and claim["verdict"] == "does not hold"
    assert "only 12 prompt tokens" in claim["why"]


def test_attention_share_claim_needs_and_uses_a_shorter_run(tiny_model_dir):
    from engine import LLM

    with LLM(str(tiny_model_dir("llama"))) as llm:
        long = llm.walkthrough(list(range(3, 3 + 96)), hardware="cpu-measured", decode_tokens=1).to_dict()
        short = llm.walkthrough(list(range(3, 3 + 12)), hardware="cpu-measured", decode_tokens=1).to_dict()
    alone = {c.key: c for c in check_claims(long)}["attention_share_grows"]
    assert alone.holds is None and "shorter run" in alone.why
    both = {c.key: c for c in check_claims(long, short)}["attention_share_grows"]
    m = both.measured
    # attention's FLOPs are quadratic in the prompt, the rest linear: its share must grow
    assert m["flop_share_long"] > m["flop_share_short"] > 0
    assert both.holds == (m["time_share_long"] > m["time_share_short"])


class _Page(HTMLParser):
    """Section ids, headings, tables and images of the page."""

    def __init__(self):
        super().__init__()
        self.sections, self.headings, self.images, self.tables, self.links = [], [], [], 0, []
        self._in_h2 = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section":
            self.sections.append(a.get("id"))
        elif tag == "h2":
            self._in_h2 = True
            self.headings.append("")
        elif tag == "img":
            self.images.append(a.get("src", ""))
        elif tag == "table":
            self.tables += 1
        elif tag == "a":
            self.links.append(a.get("href"))

    def handle_endtag(self, tag):
        self._in_h2 = self._in_h2 and tag != "h2"

    def handle_data(self, data):
        if self._in_h2:
            self.headings[-1] += data


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from launcher.build_engine import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("walkthrough", overrides=overrides)


def test_sweep_rows_and_html_page(tmp_path, tiny_model_dir):
    from rich.console import Console

    from launcher.walkthrough import run

    model = tiny_model_dir("qwen2")
    for length in (10, 24):
        prompt = "[" + ",".join(str(3 + i) for i in range(length)) + "]"
        cfg = _compose([f"model.path={model}", f"prompt={prompt}", "decode_tokens=1", "top_k=2",
                        f"out_dir={tmp_path}", "short_len=8"])
        files = run(cfg, Console(record=True, width=150))
    rows = [json.loads(line) for line in files["sweep_rows"].read_text().splitlines()]
    assert [r["prompt_len"] for r in rows] == [10, 24]
    for r in rows:
        assert r["prefill"]["projection_intensity"] > r["decode"]["projection_intensity"] > 0
        assert set(r["claims"].values()) <= {"holds", "does not hold", "does not apply"}
    assert files["sweep"].read_bytes()[:4] == b"\x89PNG"

    page = _Page()
    page.feed(files["html"].read_text())
    expected = ["prompt", "model", "prefill", "kv_cache", "first_token", "decode", "cache_savings", "ttft",
                "claims", "roofline", "sweep", "trace"]
    assert page.sections == expected
    assert len(page.headings) == len(expected) and page.headings[8].startswith("9. The prefill story's claims")
    assert page.tables == 5  # prefill ops, KV cache, decode ops, TTFT, claims
    assert len(page.images) == 2
    for src in page.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert "trace.json" in page.links and "https://ui.perfetto.dev" in page.links
    data = json.loads(files["json"].read_text())
    assert len(data["claims"]) == 8 and data["shorter_run"]["prefill"]["tokens"] == 8


def test_default_prompt_is_the_shipped_document(smollm2_llm):
    from launcher.document import DOCUMENT, document_prompt

    cfg = _compose([])
    assert cfg.prompt is None and cfg.prompt_len == 2048
    tok = smollm2_llm.tokenizer
    whole = tok.encode(DOCUMENT.read_text())
    assert len(whole) >= 2048  # the default is real text, not a repeat
    ids, source = document_prompt(tok, 128)
    assert ids == whole[:128] and "first 128 tokens" in source
    longer, source = document_prompt(tok, len(whole) + 50)
    assert len(longer) == len(whole) + 50 and "read 2 times over" in source
