"""A paper model of one long prefill on a multi-node cluster, from the engine's own cost model
(engine.observe.costs.forward_flops, the H100 spec sheet in engine.observe.hardware):
TP=8 x CP=2 against TP=16 for a 128k-token Llama-3-70B prompt on 2 nodes x 8 H100.

    .venv/bin/python -m bench.scaling_model

Communication per layer, per rank (b = bytes per element, T tokens, d hidden, w ranks):
- a tensor-parallel all-reduce (ring) moves 2(w-1)/w · T_rank·d·b, twice a layer; its slowest
  link sets the pace (inter-node when the TP group spans nodes);
- the CP ring passes each rank's K/V chunk on cp-1 times: (cp-1) · T/cp · 2·hkv_rank·hd·b.
Compute is spread evenly (the balanced CP split gives every rank the same causal work).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.loading.model_config import ModelConfig
from engine.observe.costs import forward_flops
from engine.observe.hardware import SPECS

LLAMA3_70B = ModelConfig("LlamaForCausalLM", hidden_size=8192, num_layers=80, num_heads=64,
                         num_kv_heads=8, head_dim=128, intermediate_size=28672,
                         vocab_size=128256, rms_norm_eps=1e-5, rope_theta=5e5,
                         max_position_embeddings=131072, tie_word_embeddings=False)


@dataclass(frozen=True)
class Assumptions:
    mfu: float = 0.5  # share of the spec-sheet bf16 FLOP/s a prefill sustains
    nvlink_gbps: float = 450.0  # GB/s per GPU, one direction, within a node (H100 SXM NVLink 4)
    ib_gbps: float = 50.0  # GB/s per GPU between nodes (one 400 Gb/s NIC per GPU)
    bytes_per_elem: int = 2  # bf16


def tp_all_reduce_s(tokens: int, tp: int, link_gbps: float, a: Assumptions,
                    cfg: ModelConfig = LLAMA3_70B) -> float:
    """All the all-reduces of one prefill, seconds, on one rank (2 per layer)."""
    payload = tokens * cfg.hidden_size * a.bytes_per_elem
    per = 2 * (tp - 1) / tp * payload / (link_gbps * 1e9)
    return 2 * cfg.num_layers * per


def cp_ring_bytes_per_layer(tokens: int, tp: int, cp: int, a: Assumptions,
                            cfg: ModelConfig = LLAMA3_70B) -> float:
    kv_heads_rank = max(1, cfg.num_kv_heads // tp)
    return (cp - 1) * tokens / cp * 2 * kv_heads_rank * cfg.head_dim * a.bytes_per_elem


def project(tokens: int, tp: int, cp: int, a: Assumptions, gpu: str = "h100") -> dict:
    """TTFT of one prompt of `tokens` on tp x cp GPUs, 8 per node; TP spans nodes when tp > 8."""
    peak = SPECS[gpu][0]
    compute_s = forward_flops(LLAMA3_70B, tokens, tokens) / (tp * cp * peak * a.mfu)
    tp_link = a.nvlink_gbps if tp <= 8 else a.ib_gbps
    all_reduce_s = tp_all_reduce_s(tokens // cp, tp, tp_link, a)
    ring_s = LLAMA3_70B.num_layers * cp_ring_bytes_per_layer(tokens, tp, cp, a) / (a.ib_gbps * 1e9)
    # the ring's transfers overlap the attention on the chunk in hand: exposed only past it
    attention_s = _attention_flops(tokens) / (tp * cp * peak * a.mfu)
    exposed_ring = max(0.0, ring_s - attention_s)
    return {"layout": f"TP={tp} x CP={cp}" if cp > 1 else f"TP={tp}", "compute_s": compute_s,
            "all_reduce_s": all_reduce_s, "ring_s": ring_s, "ring_exposed_s": exposed_ring,
            "ttft_s": compute_s + all_reduce_s + exposed_ring,
            "ttft_overlap_s": compute_s + max(0.0, all_reduce_s - compute_s) + exposed_ring}


def _attention_flops(tokens: int) -> float:
    c = LLAMA3_70B
    return c.num_layers * 4 * c.num_heads * c.head_dim * tokens * (tokens + 1) // 2


def main() -> None:
    a = Assumptions()
    print(f"Llama-3-70B, 131072-token prompt, 2 nodes x 8 H100 (bf16 "
          f"{SPECS['h100'][0] / 1e12:.0f} TFLOP/s x MFU {a.mfu}); NVLink {a.nvlink_gbps:.0f} "
          f"GB/s, IB {a.ib_gbps:.0f} GB/s per GPU")
    print("| layout | compute s | TP all-reduce s | CP ring s (exposed) | TTFT s "
          "| TTFT, AR fully overlapped s |")
    print("|---|---|---|---|---|---|")
    for tp, cp in ((8, 2), (16, 1)):
        r = project(131072, tp, cp, a)
        print(f"| {r['layout']} | {r['compute_s']:.2f} | {r['all_reduce_s']:.2f} | "
              f"{r['ring_s']:.3f} ({r['ring_exposed_s']:.3f}) | {r['ttft_s']:.2f} | "
              f"{r['ttft_overlap_s']:.2f} |")


if __name__ == "__main__":
    main()
