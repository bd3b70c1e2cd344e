"""A rank's step under context parallelism: its rows of the batch as a StepContext for the
unchanged model, then the logits rows from every context rank gathered to rank 0."""
from __future__ import annotations

import dataclasses

import torch

from engine.batch import Batch
from engine.rank.backend import Backend
from engine.rank.context_parallel import CPMetadata, build_local_step, cp_attention, cp_kv_store
from engine.rank.kv_cache import KVCache
from engine.rank.step_context import StepContext, step_mode
from parallel import context as cpc
from parallel import cp_layout as L


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
