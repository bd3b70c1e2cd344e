"""The prefill story's claims, each checked against the numbers of one walkthrough run.

Every claim is evaluated from `WalkthroughReport.to_dict()` alone (plus, for the attention-share
claim, the dict of a second, shorter run), so a saved walkthrough.json can be re-checked later.
A claim holds, does not hold (and says why, from the numbers), or does not apply to this run.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

# the matmuls that carry the weights: their reuse (tokens per weight read) is the prefill story
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
PREFILL_MIN_INTENSITY = 100.0  # FLOP/byte the story promises at ~2,000 tokens
DECODE_MAX_INTENSITY = 2.0
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(slots=True)
class Claim:
    key: str
    statement: str
    measured: dict = field(default_factory=dict)  # the numbers the verdict rests on
    holds: bool | None = None  # None: does not apply to this run
    why: str = ""  # why it does not hold or apply; notes where it holds

    @property
    def verdict(self) -> str:
        return {True: "holds", False: "does not hold", None: "does not apply"}[self.holds]

    def to_dict(self) -> dict:
        return {**asdict(self), "verdict": self.verdict}


def _sum(ops: list[dict], names: tuple[str, ...], key: str, rank: int | None = None) -> float:
    return sum(op[key] for op in ops if op["name"] in names and (rank is None or op["rank"] == rank))


def projection_intensity(section: dict) -> float:
    """FLOPs over bytes of the projection matmuls of one pass, summed over layers and ranks."""
    flops = _sum(section["ops"], PROJECTIONS, "flops")
    nbytes = _sum(section["ops"], PROJECTIONS, "bytes")
    return flops / nbytes if nbytes else 0.0


def model_projection_intensity(model: dict, tokens: int) -> float:
    """The same ratio written out from the model's shapes: [T, k] x [k, n] reads T·k + k·n and
    writes T·n elements for 2·T·k·n FLOPs (tensor parallelism splits n or k, not the ratio's form)."""
    d, hd, elem = model["hidden"], model["head_dim"], ELEMENT_BYTES.get(model["dtype"], 4)
    shapes = [(d, (model["heads"] + 2 * model["kv_heads"]) * hd), (model["heads"] * hd, d),
              (d, 2 * model["ffn"]), (model["ffn"], d)]
    flops = sum(2 * tokens * k * n for k, n in shapes)
    return flops / sum(elem * (tokens * k + k * n + tokens * n) for k, n in shapes)


def tokens_for_intensity(model: dict, target: float, limit: int = 1 << 20) -> int | None:
    """The fewest prompt tokens at which the projections reach `target` FLOP/byte (None: never)."""
    lo, hi = 1, limit
    if model_projection_intensity(model, hi) < target:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if model_projection_intensity(model, mid) < target else (lo, mid)
    return lo


def _prefill_projections(d: dict) -> Claim:
    ridge, tokens = d["hardware"]["ridge_flops_per_byte"], d["prefill"]["tokens"]
    x = projection_intensity(d["prefill"])
    t = sum(op["time_s"] for op in d["prefill"]["ops"] if op["name"] in PROJECTIONS)
    rate = _sum(d["prefill"]["ops"], PROJECTIONS, "flops") / t if t else 0.0
    c = Claim("prefill_compute_bound",
              f"Prefill's projection matmuls reach >= {PREFILL_MIN_INTENSITY:.0f} FLOP/byte at ~2,000 "
              "tokens and sit right of the ridge (compute-bound)",
              {"tokens": tokens, "intensity": x, "ridge": ridge, "achieved_flops_per_s": rate,
               "share_of_peak": rate / d["hardware"]["peak_flops"]})
    c.holds = x >= PREFILL_MIN_INTENSITY and x >= ridge
    if x < PREFILL_MIN_INTENSITY:
        need = tokens_for_intensity(d["model"], PREFILL_MIN_INTENSITY)
        c.why = (f"only {tokens} prompt tokens: each weight read is reused {tokens} times, giving "
                 f"{x:.1f} FLOP/byte; " + (f"this model reaches {PREFILL_MIN_INTENSITY:.0f} at ~{need} tokens"
                                           if need else "this model's matrices are too small ever to reach "
                                           f"{PREFILL_MIN_INTENSITY:.0f}"))
        if x >= ridge:
            c.why += f" (still right of this roof's low ridge, {ridge:.1f}: compute-bound here)"
    elif x < ridge:
        need = tokens_for_intensity(d["model"], ridge)
        c.why = (f"{d['hardware']['name']}'s ridge is {ridge:.0f} FLOP/byte, above the prefill's {x:.0f}: "
                 + (f"this hardware needs ~{need} tokens" if need else
                    f"this model's {d['model']['dtype']} matrices never get there (a narrower dtype doubles it)"))
    return c


def _decode_projections(d: dict) -> Claim:
    ridge, x = d["hardware"]["ridge_flops_per_byte"], projection_intensity(d["decode"])
    c = Claim("decode_memory_bound",
              f"Decode's projections are matrix-vector: <= {DECODE_MAX_INTENSITY:.0f} FLOP/byte, "
              "left of the ridge (memory-bound)",
              {"tokens": d["decode"]["tokens"], "intensity": x, "ridge": ridge,
               "prefill_over_decode": projection_intensity(d["prefill"]) / x if x else 0.0})
    c.holds = x <= DECODE_MAX_INTENSITY and x < ridge
    if x > DECODE_MAX_INTENSITY:
        c.why = f"{d['decode']['tokens']} tokens per decode step reuse each weight read: {x:.1f} FLOP/byte"
    elif x >= ridge:
        c.why = (f"this roof's ridge ({ridge:.2f} FLOP/byte) is below even decode's {x:.2f}: "
                 "a processor with little arithmetic per byte of bandwidth")
    return c


def _pass_tokens(shapes: str) -> int:
    """Tokens of one forward pass, from the embedding's input shape '[T] -> [T, d]'."""
    m = re.match(r"\[(\d+)\]", shapes)
    return int(m.group(1)) if m else 0


def _one_pass(d: dict) -> Claim:
    passes = [_pass_tokens(op["shapes"]) for op in d["prefill"]["ops"]
              if op["name"] == "embedding" and op["rank"] == 0]
    tokens = d["prefill"]["tokens"]
    c = Claim("one_pass", "Prefill processes all prompt positions in one forward pass",
              {"prompt_tokens": tokens, "passes": len(passes), "tokens_per_pass": passes})
    c.holds = passes == [tokens]
    if not c.holds:
        c.why = (f"the scheduler cut the prompt into {len(passes)} chunks of {passes} tokens "
                 "(raise engine.max_num_batched_tokens to prefill it in one pass)")
    return c


def _kv_written_once(d: dict) -> Claim:
    m, tokens = d["model"], d["prefill"]["tokens"]
    elem = ELEMENT_BYTES.get(m["dtype"], 4)
    formula = 2 * m["layers"] * m["kv_heads"] * m["head_dim"] * tokens * elem
    # the kv_write op's bytes count the new K/V read once and written once: half is the write
    written = _sum(d["prefill"]["ops"], ("kv_write",), "bytes") // 2
    c = Claim("kv_written_once",
              "K/V are written once per position: prefill writes 2·layers·kv_heads·head_dim·T·dtype bytes",
              {"written_bytes": written, "formula_bytes": formula, "cache_holds_bytes": d["kv_cache"]["bytes_total"],
               "layers": m["layers"], "kv_heads": m["kv_heads"], "head_dim": m["head_dim"],
               "tokens": tokens, "dtype_bytes": elem})
    c.holds = written == formula == d["kv_cache"]["bytes_total"]
    if not c.holds:
        c.why = (f"{written} bytes written against {formula} by the formula: "
                 + ("KV heads are replicated across ranks at this TP size"
                    if written > formula and m["tp"] > m["kv_heads"] else "see the kv_write ops"))
    return c


def _cache_saves(d: dict) -> Claim:
    s = d["cache_savings"]
    n, ratio = s["tokens"], s["flops_recompute"] / s["flops_with_cache"]
    time_ratio = s["time_recompute_s"] / s["time_with_cache_s"] if s["time_with_cache_s"] else 0.0
    c = Claim("cache_saves_n_times",
              f"Without the cache, decoding N={n} tokens costs ~N x the FLOPs (every step recomputes "
              "the whole sequence)",
              {"n": n, "flop_ratio_model": ratio, "time_ratio_measured": time_ratio})
    c.holds = ratio >= 0.75 * n  # the cached run's n-1 decode steps add ~(n-1)/T of a prefill
    if not c.holds:
        c.why = (f"with {d['prefill']['tokens']} prompt tokens the {n - 1} cached decode steps are a "
                 f"large part of a prefill, so recomputing costs only {ratio:.1f}x")
    elif time_ratio > 2 * ratio:
        c.why = (f"the measured time ratio ({time_ratio:.0f}x) far exceeds the FLOP ratio: the with-cache run "
                 "cannot have spent its prefill's FLOPs, so it found the prompt already in the prefix cache")
    elif time_ratio < 0.5 * ratio:
        c.why = (f"the measured time ratio ({time_ratio:.1f}x) trails the FLOP ratio: decode steps "
                 "are memory-bound and pay per-step overhead, so they cost more than their FLOPs")
    return c


FORWARD_PARTS = ("forward (layers)", "collectives", "final norm + LM head")


def _ttft_dominated(d: dict) -> Claim:
    parts, total = d["ttft"]["parts"], d["ttft"]["total_s"]
    forward = sum(parts.get(p, 0.0) for p in FORWARD_PARTS)
    c = Claim("ttft_is_prefill", "TTFT is dominated by the prefill forward pass",
              {"ttft_s": total, "forward_s": forward, "forward_share": forward / total if total else 0.0})
    c.holds = forward > 0.5 * total
    if not c.holds:
        other = max((p for p in parts if p not in FORWARD_PARTS), key=lambda p: parts[p])
        c.why = f"'{other}' took {parts[other] * 1e3:.1f} ms of {total * 1e3:.1f} ms: the prompt is short"
    return c


def _attention_shares(section: dict) -> tuple[float, float]:
    ops = section["ops"]
    flops, secs = sum(op["flops"] for op in ops), sum(op["time_s"] for op in ops)
    return (_sum(ops, ("attention",), "flops") / flops if flops else 0.0,
            _sum(ops, ("attention",), "time_s") / secs if secs else 0.0)


def _attention_grows(d: dict, shorter: dict | None) -> Claim:
    c = Claim("attention_share_grows",
              "Attention's share of prefill FLOPs and time grows with prompt length (it is quadratic, "
              "the projections linear)")
    if shorter is None or shorter["prefill"]["tokens"] >= d["prefill"]["tokens"]:
        c.why = "needs a second, shorter run of the same model (the walkthrough's short_len)"
        return c
    (f_short, t_short), (f_long, t_long) = _attention_shares(shorter["prefill"]), _attention_shares(d["prefill"])
    c.measured = {"short_tokens": shorter["prefill"]["tokens"], "long_tokens": d["prefill"]["tokens"],
                  "flop_share_short": f_short, "flop_share_long": f_long,
                  "time_share_short": t_short, "time_share_long": t_long}
    c.holds = f_long > f_short and t_long > t_short
    if f_long <= f_short:
        c.why = "the longer run's attention FLOP share is not larger: the runs differ in more than length"
    elif t_long <= t_short:
        c.why = (f"the FLOP share grew ({f_short:.1%} -> {f_long:.1%}) but the time share did not "
                 f"({t_short:.1%} -> {t_long:.1%}): at these lengths attention's time is per-call overhead")
    return c


def _all_reduces(d: dict) -> Claim:
    tp, layers = d["model"]["tp"], d["model"]["layers"]
    c = Claim("all_reduce_per_layer",
              "At TP>1 each layer all-reduces twice (after o_proj and after down_proj); their share of the step")
    if tp == 1:
        c.why = "tp=1: one rank holds every head and FFN column, so there is nothing to reduce"
        return c
    ops = [op for op in d["prefill"]["ops"] if op["rank"] == 0]
    per_layer = [sum(1 for op in ops if op["name"] == "all_reduce" and op["layer"] == i) for i in range(layers)]
    total_s = sum(op["time_s"] for op in ops)
    reduce_s = _sum(ops, ("all_reduce",), "time_s")
    comm = d["comm"]["prefill"]
    c.measured = {"tp": tp, "per_layer": sorted(set(per_layer)), "all_reduce_s": reduce_s,
                  "share_of_step": reduce_s / total_s if total_s else 0.0,
                  "comm_total_s": comm["total_s"], "comm_exposed_s": comm["exposed_s"]}
    c.holds = set(per_layer) == {2}
    c.why = ("all-reduce time is the traced ops' on rank 0; comm total is every collective of the "
             "step in flight, comm exposed the part rank 0 waited on (less only with overlap_comm)"
             if c.holds else f"all-reduces per layer: {sorted(set(per_layer))}, expected 2")
    return c


def check_claims(report: dict, shorter: dict | None = None) -> list[Claim]:
    """Every claim of the prefill story against `report` (a walkthrough's to_dict()); `shorter` is
    a run of fewer tokens on the same engine, for the attention-share claim."""
    return [_prefill_projections(report), _decode_projections(report), _one_pass(report),
            _kv_written_once(report), _cache_saves(report), _ttft_dominated(report),
            _attention_grows(report, shorter), _all_reduces(report)]
