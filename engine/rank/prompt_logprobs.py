"""One rank's part of scoring a batch: the final norm of the scored rows, then this rank's slice
of the LM head one tile (positions x vocabulary block) at a time, inside the vocab-parallel
log-softmax of parallel/logprobs."""
from __future__ import annotations

import torch

from engine.batch import Batch
from parallel.sharded_logprobs import LogprobRows, vocab_parallel_logprobs


@torch.inference_mode()
def score_batch(model, hidden: torch.Tensor, residual: torch.Tensor,
                batch: Batch) -> LogprobRows | None:
    """Log-probabilities of `batch.score_targets` at rows `batch.score_indices` of the final
    layer's output (`hidden` + `residual`, [T, d], before the final norm). Every rank runs it
    (the collectives pair up); the tensors come back on the CPU, top-k on rank 0 only. None
    when the batch scores nothing, on every rank alike."""
    if not batch.score_indices:
        return None
    dev = hidden.device
    idx = torch.tensor(batch.score_indices, device=dev)
    x = model.norm(hidden[idx], residual[idx])[0]  # [n, d]: the scored rows only, small
    targets = torch.tensor(batch.score_targets, device=dev)
    head = model.lm_head  # this rank's vocabulary rows, and the product they run through

    def local_logits(a: int, b: int, c: int, e: int) -> torch.Tensor:
        return head.matmul(x[a:b], head.weight[c:e], None)

    rows = vocab_parallel_logprobs(local_logits, len(idx), targets, model.lm_head.vocab_slice,
                                   batch.score_top_k, tp=model.tp)
    rows.logprobs = rows.logprobs.cpu()
    if rows.top_ids is not None:
        rows.top_ids, rows.top_logprobs = rows.top_ids.cpu(), rows.top_logprobs.cpu()
    return rows
