"""Context parallelism on one rank: the step's tokens split over the context ranks, the cache
split by position (see cp_layout), attention assembled across ranks.

Each step, every rank reads the same batch and keeps its share of it: its two chunks of every
whole prompt, and every decode token (a decode row is one token; all context ranks compute it,
so its hidden state needs no exchange). The layers run unchanged on those rows: this module is
a `Backend`'s kv_store and attention, reading a `CPMetadata` where the plain metadata goes, and
`ContextParallelSteps`, which builds each step's context of this rank's rows and gathers the
logits rows of every context rank to rank 0 after the forward.

- prompt rows: each rank's new K/V travel round the context ranks (parallel/ring.py), each
  rank attends its queries to every chunk as it passes, partials merged by log-sum-exp;
- decode rows: each rank attends the token over the positions it holds, the partial outputs
  and log-sum-exps are gathered and merged; the new K/V stay on the token's owner only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from engine.batch import Batch
from engine.rank.backend import Backend
from engine.rank.kv_cache import KVCache
from engine.rank.step_context import StepContext, step_mode
from parallel import context as cpc
from parallel import cp_layout as L
from parallel.ring import Segment, lse_merge, partial_attention, ring_attention


@dataclass(slots=True)
class CPMetadata:
    groups: cpc.Groups
    slot_mapping: torch.Tensor  # [local rows] this rank's cache slot, -1: kept by another rank
    kv_head_of_q: torch.Tensor
    positions: torch.Tensor  # [local rows]
    # prompt rows: this rank's local row indices, every rank's count, every rank's chunks
    prompt_rows: torch.Tensor
    prompt_counts: list[int]
    segments: list[list[Segment]]
    # decode rows: (local row, block table, positions this rank holds after the store)
    decodes: list[tuple[int, list[int], int]] = field(default_factory=list)
    # per batch logits index: (context rank, its n-th logits row), for the gather to rank 0
    providers: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class LocalStep:
    meta: CPMetadata
    rows: list[int]  # batch rows this rank runs, in order (-1: a filler row, see below)
    logits_rows: list[int]  # local indices of the logits rows this rank provides


def _rank_prompt_rows(batch, cp: int, c: int) -> tuple[list[int], list[Segment]]:
    """Batch rows of the prompt tokens context rank c computes, and its chunks as segments."""
    rows, segments, number = [], [], 0
    for i, kv_len in enumerate(batch.context_lens):
        s, e = batch.cu_seqlens_q[i], batch.cu_seqlens_q[i + 1]
        if e - s != kv_len:
            continue
        for a, b in L.prompt_chunks(kv_len, cp, c):
            segments.append((number, a, b, len(rows)))
            rows += range(s + a, s + b)
        number += 1
    return rows, segments


def build_local_step(batch, groups: cpc.Groups, prompt_lens: dict[int, int],
                     kv_head_of_q: torch.Tensor, block_size: int, device) -> LocalStep:
    """This rank's rows of the step and everything its attention needs. `prompt_lens` (first
    block id -> prompt length) is this rank's memory of the sequences it holds; updated here."""
    cp, c = groups.cp, groups.cp_rank
    per_rank = [_rank_prompt_rows(batch, cp, r) for r in range(cp)]
    mine = set(per_rank[c][0])
    rows, slots, decodes, prompt_local = [], [], [], []
    for i, kv_len in enumerate(batch.context_lens):
        s, e, table = batch.cu_seqlens_q[i], batch.cu_seqlens_q[i + 1], batch.block_tables[i]
        if e - s == kv_len:  # a whole prompt: this rank's two chunks, kept compacted
            prompt_lens[table[0]] = kv_len
            for index, row in enumerate(r for r in range(s, e) if r in mine):
                prompt_local.append(len(rows))
                rows.append(row)
                slots.append(L.local_slot(index, table, block_size))
        elif e - s == 1:  # a decode token: every rank computes it, its owner keeps it
            prompt_len = _prompt_len(prompt_lens, table)
            held = L.local_count(kv_len, prompt_len, cp, c)
            position = kv_len - 1
            keeps = L.owner(position, prompt_len, cp) == c
            decodes.append((len(rows), table, held))
            rows.append(s)
            slots.append(L.local_slot(held - 1, table, block_size) if keeps else -1)
        else:
            raise RuntimeError(f"context parallelism got a prompt chunk ({e - s} of {kv_len} "
                               f"tokens); the scheduler must send whole prompts")
    # each logits row comes from one context rank: a prompt's last token from its owner, a
    # decode token (computed everywhere) from context rank 0
    local_of = {row: i for i, row in enumerate(rows)}
    prompt_rank = {row: r for r, p in enumerate(per_rank) for row in p[0]}
    logits_rows, providers, counts = [], [], [0] * cp
    for row in batch.logits_indices:
        rank = prompt_rank.get(row, 0)
        providers.append((rank, counts[rank]))
        counts[rank] += 1
        if rank == c:
            logits_rows.append(local_of[row])
    if not rows:  # no token here this step: one filler row keeps the layers' shapes valid
        rows, slots = [-1], [-1]
    positions = [batch.positions[r] if r >= 0 else 0 for r in rows]
    as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    meta = CPMetadata(groups, as_tensor(slots), kv_head_of_q, as_tensor(positions),
                      as_tensor(prompt_local), [len(p[0]) for p in per_rank],
                      [p[1] for p in per_rank], decodes, providers)
    return LocalStep(meta, rows, logits_rows)


def _prompt_len(prompt_lens: dict[int, int], table: list[int]) -> int:
    if table[0] not in prompt_lens:
        raise RuntimeError(f"context parallelism: a decode for a sequence (first block "
                           f"{table[0]}) whose prompt this rank never saw")
    return prompt_lens[table[0]]


def cp_kv_store(cache, layer: int, k: torch.Tensor, v: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    """Only the rows this rank keeps go into its cache."""
    keep = slot_mapping >= 0
    cache.store(layer, k[keep], v[keep], slot_mapping[keep])


def cp_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache,
                 meta: CPMetadata, scale: float) -> torch.Tensor:
    out = torch.zeros_like(q)
    g = meta.groups
    if sum(meta.prompt_counts):  # every rank takes part, with or without rows of its own
        rows = meta.prompt_rows
        out[rows] = ring_attention(q[rows], k[rows], v[rows], meta.segments, meta.kv_head_of_q,
                                   scale, g.cp_rank, g.cp_group, g.clock)
    if meta.decodes:
        partial, lse = [], []
        for row, table, held in meta.decodes:
            keys, values = cache.gather(layer, table, held) if held else (k[:0], v[:0])
            o, s = partial_attention(q[row:row + 1], keys, values, None, meta.kv_head_of_q, scale)
            partial.append(o)
            lse.append(s)
        counts = [len(meta.decodes)] * g.cp
        outs = cpc.all_gather_rows(torch.cat(partial), counts, g.cp_group, g.clock)
        lses = cpc.all_gather_rows(torch.cat(lse), counts, g.cp_group, g.clock)
        merged = lse_merge(outs, lses)
        out[[row for row, _, _ in meta.decodes]] = merged.to(q.dtype)
    return out


def context_parallel_backend(base: Backend) -> Backend:
    """`base` with the KV store and attention that know the cache is split by position."""
    return dataclasses.replace(base, name=f"{base.name}+cp", kv_store=cp_kv_store,
                               attention=cp_attention, decode_attention=cp_attention)


class ContextParallelSteps:
    """What context parallelism adds to a rank's runner: its own rows of each step, and the
    gather of the logits rows after the forward."""

    def __init__(self, groups: cpc.Groups, backend: Backend, kv_head_of_q: torch.Tensor,
                 block_size: int, vocab_size: int):
        self.groups, self.kv_head_of_q = groups, kv_head_of_q
        self.block_size, self.vocab_size = block_size, vocab_size
        self.ops = backend.step_ops(decode=False)  # one attention for prompt and decode rows
        self.prompt_lens: dict[int, int] = {}  # first block -> prompt length, per live sequence

    def prepare(self, batch: Batch, cache: KVCache) -> StepContext:
        device = self.kv_head_of_q.device
        step = build_local_step(batch, self.groups, self.prompt_lens, self.kv_head_of_q,
                                self.block_size, device)
        ids = torch.tensor([batch.token_ids[r] if r >= 0 else 0 for r in step.rows],
                           device=device)
        rows = torch.tensor(step.logits_rows, device=device, dtype=torch.long)
        return StepContext(step_mode(batch), ids, step.meta.positions, rows, cache, step.meta,
                           self.ops)

    def gather_logits(self, logits: torch.Tensor | None, meta: CPMetadata) -> torch.Tensor | None:
        """Every logits row of the batch on rank 0, in batch order (None elsewhere, or when the
        step samples nothing); each TP group's rank 0 holds its context rank's rows."""
        g = self.groups
        if not meta.providers or g.tp_rank != 0:
            return None
        counts = [sum(1 for r, _ in meta.providers if r == c) for c in range(g.cp)]
        if logits is None:
            logits = torch.empty(0, self.vocab_size, device=self.kv_head_of_q.device)
        parts = cpc.gather_rows_to_first(logits, counts, g.cp_group, g.clock)
        if parts is None:
            return None
        return torch.stack([parts[rank][n] for rank, n in meta.providers])

    def read_kv(self, cache: KVCache, layer: int, block_table: list[int], length: int):
        """The K/V this rank holds of positions [0, length) of one sequence, in position order."""
        prompt_len = self.prompt_lens.get(block_table[0], length)
        held = L.local_count(length, prompt_len, self.groups.cp, self.groups.cp_rank)
        k, v = cache.gather(layer, block_table, held)
        return k.cpu(), v.cpu()
