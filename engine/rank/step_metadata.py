"""A step's attention metadata in device form, built once per step and read by every layer.

The scheduler hands a step over as Python lists (cu_seqlens, context lengths, block tables, slot
mapping). The kernels need them as device integers. Turning lists into device tensors in every
layer costs a few host->device copies per layer and keeps the host and the GPU in lock step
(and rules out CUDA graphs), so this module does it once: all the integers go into ONE int32
host tensor, pinned on CUDA, copied with one non-blocking transfer; each field is a view of it.

Usage, once per step on each rank (the worker does it, in `Worker.prepare`; every backend reads
the result: the torch backend its host lists and device table, the Triton kernels the rest):

    step = build_step_metadata(batch.cu_seqlens_q, batch.context_lens, batch.block_tables,
                               batch.slot_mapping, kv_head_of_q_list, device,
                               uniform_groups=uniform)
    backend.kv_store(cache, layer, k, v, step.slot_mapping)
    backend.attention(layer, q, k, v, cache, step, scale)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.rank.kernels.launch_config import KernelDefaults, defaults_for, sm_count

# no triton import here: the worker may build step metadata for the torch backend too, and
# importing triton before TRITON_INTERPRET is set would fix the interpreter off for the process


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(slots=True)
class StepMetadata:
    # the scheduler's lists, for the torch backend's per-sequence loop
    cu_seqlens_q: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [T] device slots (int32 view of the packed tensor, or as given)
    kv_head_of_q: torch.Tensor  # [hq] device
    uniform_groups: bool
    # device views of the packed tensor
    cu_q: torch.Tensor  # [B + 1]
    ctx: torch.Tensor  # [B]
    order: torch.Tensor  # [B] sequences, longest context first: the heaviest tiles launch first
    cu_sorted: torch.Tensor  # [B + 1] cumulative new-token counts in that order
    table: torch.Tensor  # [B, table_width] block tables, short rows padded with 0 (never read)
    groups: torch.Tensor  # [hkv, group_width] query heads of each KV head, padded with -1
    # host integers the launches need, so no layer asks the device for them
    num_tokens: int
    max_kv: int
    num_kv_heads: int
    group_width: int  # a power of two >= the largest group
    is_decode: bool  # exactly one new token per sequence
    decode_kv_per_split: int
    defaults: KernelDefaults
    # the step's own inputs, when the caller packed them in the same copy (the worker does)
    token_ids: torch.Tensor | None = None  # [T]
    positions: torch.Tensor | None = None  # [T]
    logits_indices: torch.Tensor | None = None  # rows that sample a token
    # per sequence, the first of its context's blocks when they are consecutive (its K/V are
    # one slice of the cache, read without a copy: KVCache.gather), else None
    first_blocks: list[int | None] | None = None
    # the first of the step's slots when they run first_slot, first_slot + 1, ... (a prompt in
    # fresh blocks): its K/V are stored as one slice copy (KVCache.store_run), else None
    first_slot: int | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


def consecutive_from(table: list[int], length: int, block_size: int) -> int | None:
    """The first block of the `length` positions' blocks in `table` if they run b, b+1, ...;
    else None."""
    used = _cdiv(length, block_size)
    if used == 0 or len(table) < used:
        return None
    first = table[0]
    return first if all(table[j] == first + j for j in range(1, used)) else None


def first_of_run(slots: list[int] | torch.Tensor) -> int | None:
    """slots[0] if the (host) slots run slots[0], slots[0] + 1, ...; else None."""
    if isinstance(slots, torch.Tensor) or not slots:
        return None
    first = slots[0]  # (a padding slot, -1, is no start: a slice from -1 would wrap)
    return first if first >= 0 and slots == list(range(first, first + len(slots))) else None


def _group_rows(kv_head_of_q: list[int]) -> tuple[int, list[list[int]]]:
    """The query heads reading each KV head (GQA groups may be uneven on a tensor-parallel
    rank), each row padded with -1 to a power-of-two width."""
    num_kv_heads = max(kv_head_of_q) + 1 if kv_head_of_q else 0
    groups: list[list[int]] = [[] for _ in range(num_kv_heads)]
    for q_head, kv_head in enumerate(kv_head_of_q):
        groups[kv_head].append(q_head)
    width = _next_power_of_2(max((len(g) for g in groups), default=1))
    return width, [g + [-1] * (width - len(g)) for g in groups]


def decode_kv_per_split(device: torch.device, defaults: KernelDefaults, num_seqs: int,
                        num_kv_heads: int, max_kv: int) -> int:
    """Keys per decode split on `device`. The interpreter gains nothing from splits: one."""
    if device.type != "cuda":
        return max(defaults.decode_block_n,
                   _cdiv(max_kv, defaults.decode_block_n) * defaults.decode_block_n)
    return split_length(sm_count(device.index or 0), defaults, num_seqs, num_kv_heads, max_kv)


def split_length(sms: int, defaults: KernelDefaults, num_seqs: int, num_kv_heads: int,
                 max_kv: int) -> int:
    """About two split programs per SM, no split under decode_min_split keys (shorter ones cost
    more in partial writes and merging than they win in parallelism), and always a multiple of
    decode_block_n, so no split loads a masked tile it did not need."""
    block_n = defaults.decode_block_n
    splits = _cdiv(2 * sms, max(1, num_seqs * num_kv_heads))
    per_split = _cdiv(_cdiv(max_kv, splits), block_n) * block_n
    return max(defaults.decode_min_split, per_split)


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """The step's one host->device copy: pinned and non-blocking on CUDA, so the host goes on
    queueing kernels while it travels (the caching host allocator keeps the pinned buffer alive
    until the copy has run)."""
    host = torch.tensor(values, dtype=torch.int32)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def pack_to_device(parts: dict[str, list[int]], device: torch.device) -> dict[str, torch.Tensor]:
    """The lists laid end to end in one int32 tensor, copied once; each name gets its view."""
    packed = _to_device([v for values in parts.values() for v in values], device)
    views, at = {}, 0
    for name, values in parts.items():
        views[name], at = packed[at:at + len(values)], at + len(values)
    return views


def build_step_metadata(cu_seqlens_q: list[int], context_lens: list[int],
                        block_tables: list[list[int]], slot_mapping: list[int] | torch.Tensor,
                        kv_head_of_q: list[int] | torch.Tensor, device: torch.device | str,
                        uniform_groups: bool = False,
                        defaults: KernelDefaults | None = None,
                        inputs: dict[str, list[int]] | None = None,
                        block_size: int | None = None) -> StepMetadata:
    """Everything the attention and KV-store kernels read, for one step, on `device`. Pass
    slot_mapping and kv_head_of_q as lists to have them in the same single copy (a device
    tensor is kept as it is; a device kv_head_of_q costs one read back here, once per step).
    `inputs` (token_ids, positions, logits_indices) ride in that copy too. `block_size`:
    the cache's, to find each context's consecutive blocks (None: not looked for)."""
    device = torch.device(device)
    defaults = defaults or defaults_for(device)
    num_seqs = len(context_lens)
    if len(cu_seqlens_q) != num_seqs + 1 or len(block_tables) != num_seqs:
        raise ValueError(f"step metadata: {len(cu_seqlens_q)} cu_seqlens_q entries and "
                         f"{len(block_tables)} block tables for {num_seqs} sequences; expected "
                         f"{num_seqs + 1} and {num_seqs}")
    heads = kv_head_of_q.tolist() if isinstance(kv_head_of_q, torch.Tensor) else list(kv_head_of_q)
    group_width, group_rows = _group_rows(heads)
    q_lens = [cu_seqlens_q[i + 1] - cu_seqlens_q[i] for i in range(num_seqs)]
    order = sorted(range(num_seqs), key=lambda i: -context_lens[i])
    cu_sorted = [0]
    for i in order:
        cu_sorted.append(cu_sorted[-1] + q_lens[i])
    width = max((len(t) for t in block_tables), default=0) or 1
    table = [b for t in block_tables for b in t + [0] * (width - len(t))]

    parts = {"cu_q": list(cu_seqlens_q), "ctx": list(context_lens), "order": order,
             "cu_sorted": cu_sorted, "table": table, "groups": [h for r in group_rows for h in r]}
    if not isinstance(slot_mapping, torch.Tensor):
        parts["slots"] = list(slot_mapping)
    if not isinstance(kv_head_of_q, torch.Tensor):
        parts["heads"] = heads
    parts.update(inputs or {})
    views = pack_to_device(parts, device)

    max_kv = max(context_lens, default=0)
    num_kv_heads = len(group_rows)
    is_decode = num_seqs > 0 and all(n == 1 for n in q_lens)
    per_split = (decode_kv_per_split(device, defaults, num_seqs, num_kv_heads, max_kv)
                 if is_decode else 0)
    return StepMetadata(
        cu_seqlens_q=list(cu_seqlens_q), context_lens=list(context_lens),
        block_tables=block_tables,
        slot_mapping=views.get("slots", slot_mapping), kv_head_of_q=views.get("heads", kv_head_of_q),
        uniform_groups=uniform_groups, cu_q=views["cu_q"], ctx=views["ctx"], order=views["order"],
        cu_sorted=views["cu_sorted"], table=views["table"].view(num_seqs, width),
        groups=views["groups"].view(num_kv_heads, group_width), num_tokens=cu_seqlens_q[-1],
        max_kv=max_kv, num_kv_heads=num_kv_heads, group_width=group_width, is_decode=is_decode,
        decode_kv_per_split=per_split, defaults=defaults, token_ids=views.get("token_ids"),
        positions=views.get("positions"), logits_indices=views.get("logits_indices"),
        first_blocks=None if block_size is None else
        [consecutive_from(t, n, block_size) for t, n in zip(block_tables, context_lens)],
        first_slot=first_of_run(slot_mapping))
