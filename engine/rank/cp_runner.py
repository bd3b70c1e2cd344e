"""A rank's step under context parallelism: its rows through the unchanged model, then the
logits rows from every context rank gathered to rank 0, which samples for the replica."""
from __future__ import annotations

import dataclasses

import torch

from engine.batch import Batch, StepResult
from parallel import cp_layout as L
from engine.rank.attention import StepContext
from engine.rank.backend import Backend
from engine.rank.context_parallel import build_local_step, cp_attention, cp_kv_store
from parallel import context as cpc


def context_parallel_backend(base: Backend) -> Backend:
    """`base` with the KV store and attention that know the cache is split by position."""
    return dataclasses.replace(base, name=f"{base.name}+cp", kv_store=cp_kv_store,
                               attention=cp_attention)


class ContextParallelRunner:
    def __init__(self, worker, groups: cpc.Groups):
        self.worker, self.groups = worker, groups
        self.kv_head_of_q = torch.tensor(worker.kv_head_of_q, device=worker.device)
        self.prompt_lens: dict[int, int] = {}  # first block -> prompt length, per live sequence

    def execute(self, batch: Batch) -> StepResult | None:
        w, g = self.worker, self.groups
        started = w.step_clocks()
        step = build_local_step(batch, g, self.prompt_lens, self.kv_head_of_q,
                                w.plan.block_size, w.device)
        ids = torch.tensor([batch.token_ids[r] if r >= 0 else 0 for r in step.rows],
                           device=w.device)
        logits = w.model(ids, step.meta.positions, StepContext(w.cache, step.meta),
                         torch.tensor(step.logits_rows, device=w.device, dtype=torch.long))
        gathered = None
        if batch.logits_indices and g.tp_rank == 0:  # each TP group's rank 0 holds its logits
            gathered = self._gather_logits(logits, step.providers)
        result = w.step_result(started)
        if result is not None and gathered is not None:
            w._sample(gathered.cpu(), batch, result)
        return result

    def _gather_logits(self, logits: torch.Tensor | None, providers: list[tuple[int, int]]):
        g, vocab = self.groups, self.worker.plan.model.vocab_size
        counts = [sum(1 for r, _ in providers if r == c) for c in range(g.cp)]
        if logits is None:
            logits = torch.empty(0, vocab, device=self.worker.device)
        parts = cpc.gather_rows_to_first(logits, counts, g.cp_group)
        if parts is None:
            return None
        return torch.stack([parts[rank][n] for rank, n in providers])

    def read_kv(self, layer: int, block_table: list[int], length: int):
        """The K/V this rank holds of positions [0, length) of one sequence, in position order."""
        prompt_len = self.prompt_lens.get(block_table[0], length)
        held = L.local_count(length, prompt_len, self.groups.cp, self.groups.cp_rank)
        k, v = self.worker.cache.gather(layer, block_table, held)
        return k.cpu(), v.cpu()
