"""Which tokens run in the next step, under a token budget, and what a step's results mean.

Prefill and decode are one thing here: each sequence has some tokens without K/V yet (a whole
prompt, the rest of a chunked prompt, or the one token sampled last step). Sequences with a
single pending token (decodes) go first so a long prompt never stalls them; prompts are then cut
into chunks that fill what is left of `max_num_batched_tokens`.
"""
from __future__ import annotations

import time
from collections import deque

from engine.batch import Batch
from engine.driver import scoring
from engine.driver.block_manager import BlockManager
from engine.driver.sequence import FinishReason, Sequence, Status


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int,
                 max_num_seqs: int, max_model_len: int, eos_token_ids: list[int]):
        self.blocks = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        budget, scheduled = self.max_num_batched_tokens, []
        for seq in [s for s in self.running if s.num_pending_tokens == 1]:  # decodes
            if budget == 0:
                break
            if seq.status is not Status.RUNNING or not self._make_room(seq):
                continue
            scheduled.append((seq, 1))
            budget -= 1
        self._admit()
        # the budget goes to prompts shortest remaining first, so a short prompt is not stuck
        # behind every chunk of a long one that came earlier (which takes whatever is left);
        # the batch keeps arrival order
        # (a newly admitted prompt whose prefix was cached may have a single token left)
        decoding = {s.seq_id for s, _ in scheduled}
        prompts = [s for s in self.running if s.seq_id not in decoding and s.num_pending_tokens > 0]
        grant: dict[int, int] = {}
        for seq in sorted(prompts, key=lambda s: s.num_pending_tokens):
            grant[seq.seq_id] = min(seq.num_pending_tokens, budget)
            budget -= grant[seq.seq_id]
        return scheduled + [(s, grant[s.seq_id]) for s in prompts if grant[s.seq_id]]

    def _admit(self) -> None:
        """Waiting sequences become running, oldest first, while their blocks fit."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # a scored prompt needs every position's hidden state: no prefix hit may skip any
            if not self.blocks.allocate(seq, use_prefix_cache=seq.score is None):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)

    def _make_room(self, seq: Sequence) -> bool:
        """Find a block for a decode that needs one, preempting the newest sequences if the pool
        is full. False if `seq` itself had to give way."""
        while not self.blocks.ensure_capacity(seq):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Drop the sequence's blocks; it is recomputed from its tokens when readmitted (its
        full blocks usually come back from the prefix cache)."""
        self.blocks.free(seq)
        self.running.remove(seq)
        seq.status, seq.num_computed_tokens = Status.WAITING, 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """The cache slots of positions [start, end) of `seq`."""
        bs = self.blocks.block_size
        return [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def build_batch(self, scheduled: list[tuple[Sequence, int]]) -> Batch:
        batch = Batch([], [], [0], [], [], [], [])
        for seq, n in scheduled:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            batch.token_ids += seq.token_ids[start:end]
            batch.positions += range(start, end)
            batch.slot_mapping += self.slots(seq, start, end)
            batch.cu_seqlens_q.append(batch.cu_seqlens_q[-1] + n)
            batch.context_lens.append(end)
            batch.block_tables.append(seq.block_table)
            if seq.score is not None:  # scored: log-probs of the next tokens, never a sample
                scoring.add_score_rows(batch, seq, start, end)
                continue
            if end == seq.num_tokens:  # this chunk completes the sequence: sample its next token
                batch.logits_indices.append(batch.cu_seqlens_q[-1] - 1)
                batch.sampling.append(seq.params.spec(len(seq.output_token_ids)))
                batch.return_logits |= seq.keep_first_logits and not seq.output_token_ids
        return batch

    def postprocess(self, scheduled: list[tuple[Sequence, int]], token_ids: list[int],
                    logits=None, nonfinite_rows: set[int] = frozenset(),
                    row_errors: dict[int, str] | None = None, score=None) -> list[Sequence]:
        """Advance every scheduled sequence; returns those that finished."""
        now, finished, row, row_errors = time.perf_counter(), [], 0, row_errors or {}
        score_row = 0
        for seq, n in scheduled:
            if seq.score is not None:
                start = seq.num_computed_tokens
                score_row = scoring.take_score_rows(seq, start, start + n, score, score_row)
                seq.num_computed_tokens += n
                self.blocks.register_computed(seq)  # scored prompts still fill the prefix cache
                if seq.num_computed_tokens == seq.num_tokens:
                    seq.first_token_time = now
                    self._finish(seq, FinishReason.SCORED if scoring.is_finite(seq)
                                 else FinishReason.NONFINITE, finished)
                continue
            seq.num_computed_tokens += n
            if seq.num_computed_tokens < seq.num_tokens:
                self.blocks.register_computed(seq)
                continue  # a chunk of a prompt: nothing sampled yet
            if row in nonfinite_rows:  # fail this request alone; its K/V are never cached
                row += 1
                self._finish(seq, FinishReason.NONFINITE, finished)
                continue
            if row in row_errors:
                seq.error = row_errors[row]
                row += 1
                self._finish(seq, FinishReason.ERROR, finished)
                continue
            self.blocks.register_computed(seq)
            if not seq.output_token_ids:
                seq.first_token_time = now
                if seq.keep_first_logits and logits is not None:
                    seq.first_logits = logits[row]
            seq.token_ids.append(token_ids[row])
            row += 1
            if seq.on_token is not None:
                seq.on_token(token_ids[row - 1])
            reason = self._finish_reason(seq)
            if reason:
                self._finish(seq, reason, finished)
        return finished

    def _finish(self, seq: Sequence, reason: FinishReason, finished: list[Sequence]) -> None:
        exported = seq.pin_kv and reason in (FinishReason.STOP, FinishReason.LENGTH)
        if exported and not self._may_pin(seq):
            reason, exported = FinishReason.EXPORT_REFUSED, False
        seq.finish_reason, seq.status = reason, Status.FINISHED
        seq.kv_block_table = list(seq.block_table)
        if exported:  # its references pass to the KV export, which unpins them
            self.blocks.pin(seq.block_table)
            seq.block_table = []
        else:
            self.blocks.free(seq)
        self.running.remove(seq)
        finished.append(seq)

    def _may_pin(self, seq: Sequence) -> bool:
        """Whether an exported sequence's blocks may stay pinned: not if that left fewer free
        than one max_model_len request needs (the request then fails, saying why), so pins
        never starve requests that export nothing."""
        keep = self.blocks.blocks_needed(self.max_model_len)
        if self.blocks.can_pin(seq.block_table, keep):
            return True
        seq.error = (f"exporting this request's K/V would pin its {len(seq.block_table)} blocks "
                     f"while exports already pin {len(self.blocks.pins)} of the cache's "
                     f"{self.blocks.num_blocks}; {keep} must stay free for one "
                     f"max_model_len={self.max_model_len} request")
        return False

    def _finish_reason(self, seq: Sequence) -> FinishReason | None:
        if not seq.params.ignore_eos and seq.token_ids[-1] in self.eos_token_ids:
            return FinishReason.STOP
        if len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def adopt(self, seq: Sequence) -> bool:
        """Enter a sequence whose prompt K/V another engine computed (blocks already held, first
        token already sampled) as running. True if it is finished at once (EOS or max_tokens)."""
        seq.status = Status.RUNNING
        self.running.append(seq)
        reason = self._finish_reason(seq)
        if reason:
            self._finish(seq, reason, [])
        return reason is not None

    def abort(self, seqs: list[Sequence], reason: FinishReason = FinishReason.ABORTED) -> None:
        """Forget sequences whose step failed; their blocks go back, never half-registered."""
        for seq in seqs:
            if seq in self.running:
                self.blocks.free(seq)
                self.running.remove(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
            else:
                continue  # another replica's
            seq.status = Status.FINISHED
            seq.finish_reason = reason
