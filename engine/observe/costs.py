"""What each op of the forward costs: FLOPs (a multiply-add is 2) and bytes read + written.

Per-op functions take the op's real tensors and return (shapes, FLOPs, bytes) for the tracer.
Element-wise ops count FLOPs per output element: RMSNorm 4 (square, sum, scale, weight) plus 1
for a fused residual add; RoPE 3 (two products and a sum per rotated element); SiLU·mul 4
(negate, exp, divide, multiply). Attention counts the query-key pairs it scores: causal, so a
prompt of T tokens scores T(T+1)/2 pairs per head, each 2·d FLOPs for QKᵀ and 2·d for PV.
"""
from __future__ import annotations

import torch

from engine.loading.model_config import ModelConfig


def nbytes(*tensors: torch.Tensor) -> int:
    # .nbytes: a quantized weight (engine.rank.quantized) counts its codes and scales
    return sum(t.nbytes for t in tensors)


def shape(t: torch.Tensor | tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in (t.shape if isinstance(t, torch.Tensor) else t)) + "]"


def attention_pairs(q_len: int, kv_len: int) -> int:
    """Query-key pairs a causal attention scores when q_len new tokens end a kv_len context."""
    prefix = kv_len - q_len
    return q_len * prefix + q_len * (q_len + 1) // 2


def forward_flops(cfg: ModelConfig, q_len: int, kv_len: int, logits_rows: int = 1) -> int:
    """Matmul and attention FLOPs of one sequence: q_len new tokens over a context of kv_len,
    logits for logits_rows rows (element-wise ops are left out: they are < 1% of a layer)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    q_width, kv_width = cfg.num_heads * hd, cfg.num_kv_heads * hd
    linear = d * (q_width + 2 * kv_width) + q_width * d + 3 * d * cfg.intermediate_size
    per_layer = 2 * q_len * linear + 2 * 2 * cfg.num_heads * hd * attention_pairs(q_len, kv_len)
    return cfg.num_layers * per_layer + 2 * logits_rows * d * cfg.vocab_size


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """[T, k] x [k, n]: 2Tkn FLOPs; reads x and W (and b), writes [T, n]."""
    rows, (n, k) = x.numel() // x.shape[-1], weight.shape
    out_bytes = rows * n * x.element_size()
    extra = nbytes(bias) if bias is not None else 0
    return (f"{shape((rows, k))} x {shape((k, n))}", 2 * rows * k * n,
            nbytes(x, weight) + extra + out_bytes)


def embedding(ids: torch.Tensor, weight: torch.Tensor):
    """A gather: no FLOPs; reads the ids and one row per token, writes [T, d]."""
    row_bytes = weight.shape[1] * weight.element_size()
    return (f"{shape(ids)} -> {shape((len(ids), weight.shape[1]))}", 0,
            nbytes(ids) + 2 * len(ids) * row_bytes)


def all_reduce(x: torch.Tensor, w: int, shared: bool):
    """n elements summed over w ranks. A ring (gloo, NCCL): each rank does (w-1)·n/w additions
    and sends and receives 2(w-1)/w of the tensor's bytes. Through shared memory
    (parallel.shared_memory): each rank copies its n in (reads and writes them), then sums all w
    copies itself, (w-1)·n additions, reading w·n and writing n; it sends nothing."""
    n, size = x.numel(), x.element_size()
    if shared:
        return shape(x), (w - 1) * n, (w + 3) * n * size
    return shape(x), (w - 1) * n // w, 2 * (w - 1) * n * size // w


def gather_to_rank_zero(x: torch.Tensor, sizes: list[int], rank: int, shared: bool):
    """Slices padded to the widest; rank 0 receives every rank's slice, the others send one.
    Through shared memory each rank copies its slice in (read and written), and rank 0 reads
    every rank's and writes it out."""
    part = x.numel() // x.shape[-1] * max(sizes) * x.element_size()
    if shared:
        return shape(x), 0, 2 * part * (1 + (len(sizes) if rank == 0 else 0))
    return shape(x), 0, part * (len(sizes) if rank == 0 else 1)


def rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor):
    n = x.numel()
    if residual is None:  # read x and the weight, write the normed rows
        return shape(x), 4 * n, 2 * nbytes(x) + nbytes(weight)
    # also read the residual and write the new one (x + residual)
    return f"{shape(x)} + residual", 5 * n, 4 * nbytes(x) + nbytes(weight)


def rope(q: torch.Tensor, k: torch.Tensor):
    """Read and write q and k, and read a cos and a sin row (float32, d/2 wide) per token."""
    tables = 2 * len(q) * (q.shape[-1] // 2) * 4
    return f"q {shape(q)}, k {shape(k)}", 3 * (q.numel() + k.numel()), 2 * nbytes(q, k) + tables


def kv_write(k: torch.Tensor, v: torch.Tensor):
    """Read the new K/V, write them into their cache slots: pure data movement."""
    return f"k, v {shape(k)} -> cache", 0, 2 * nbytes(k, v)


def attention(q: torch.Tensor, k: torch.Tensor, meta) -> tuple[str, int, int]:
    """Read the queries and each sequence's whole K/V context, write the outputs."""
    heads, d = q.shape[1], q.shape[2]
    cu = meta.cu_seqlens_q
    pairs = sum(attention_pairs(cu[i + 1] - cu[i], n) for i, n in enumerate(meta.context_lens))
    kv_bytes = 2 * sum(meta.context_lens) * k.shape[1] * d * k.element_size()
    return (f"q {shape(q)} over kv [{sum(meta.context_lens)}, {k.shape[1]}, {d}]",
            4 * heads * d * pairs, 2 * nbytes(q) + kv_bytes)


def gated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """The MLP's gate/up product [T, k] x [k, 2n] with its SiLU·mul, which the op applies
    itself: the product's FLOPs plus 4 per output element; reads x and W, writes [T, n]."""
    shapes, flops, moved = linear(x, weight, bias)
    half = x.numel() // x.shape[-1] * weight.shape[0] // 2
    return (f"{shapes} -> SiLU·mul -> [{len(x)}, {weight.shape[0] // 2}]", flops + 4 * half,
            moved - half * x.element_size())


def sample(logits: torch.Tensor):
    """One comparison per vocabulary entry (argmax; softmax and filters for sampling)."""
    return shape(logits), logits.numel(), nbytes(logits)


def op_cost(op: str, module: torch.nn.Module, args: tuple) -> tuple[str, int, int]:
    """(shapes, FLOPs, bytes) of one call of a traced op, from the module and its inputs."""
    if op == "qkv_proj":
        return linear(args[0], module.weight, module.bias)
    if op == "gate_up_proj":
        return gated_linear(args[0], module.weight, module.bias)
    if op in ("o_proj", "down_proj", "lm_head"):  # the bias, if any, is added after the reduce
        return linear(args[0], module.weight)
    if op == "embedding":
        return embedding(args[0], module.weight)
    if op.endswith("norm"):
        return rmsnorm(args[0], args[1] if len(args) > 1 else None, module.weight)
    if op == "rope":
        return rope(args[1], args[2])
    if op == "kv_write":
        return kv_write(args[0], args[1])
    if op == "attention":
        return attention(args[0], args[1], args[3].meta)
    if op == "all_reduce":
        return all_reduce(args[0], module.tp.world_size(), module.tp.through_shared_memory(args[0]))
    if op == "gather_logits":
        return gather_to_rank_zero(args[0], module.sizes, module.tp.rank(),
                                   module.tp.through_shared_memory(args[0]))
    if op == "sample":
        return sample(args[0])
    raise KeyError(f"no cost formula for op {op!r}")
