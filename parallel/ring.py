"""Ring attention: every context rank's queries attend to every rank's keys, the K/V chunks
passing rank to rank with point-to-point send/recv while the chunk in hand is attended, the
partial results merged by log-sum-exp.

Softmax over the union of key sets A and B, from the two partial softmaxes:
    lse = log(exp(lse_A) + exp(lse_B)),  out = exp(lse_A - lse)·out_A + exp(lse_B - lse)·out_B
so attention can be computed chunk by chunk in any order, exactly up to float rounding.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from parallel import comm

_QUERY_BLOCK = 1024  # queries per score matrix: bounds its memory at long contexts


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None, kv_head_of_q: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [Tq, hq, d] over k/v [Tk, hkv, d] (query head h reads KV head
    kv_head_of_q[h]); mask [Tq, Tk] True where allowed. (out [Tq, hq, d], lse [Tq, hq]) in
    float32; a query that sees no key gets out 0 and lse -inf."""
    k = k.index_select(1, kv_head_of_q).float()
    v = v.index_select(1, kv_head_of_q).float()
    outs, lses = [], []
    for start in range(0, max(len(q), 1), _QUERY_BLOCK):
        qb = q[start:start + _QUERY_BLOCK].float()
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask[start:start + _QUERY_BLOCK].unsqueeze(0),
                                        float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [h, q]
        weights = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # -inf - -inf: no key
        outs.append(torch.einsum("hqk,khd->qhd", weights, v))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def lse_merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Merge partial attentions of the same queries over disjoint key sets."""
    lse = torch.stack(lses)  # [parts, q, h]
    top = lse.max(dim=0).values
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lse - top)  # exp(-inf) = 0: a part that saw nothing weighs nothing
    total = weights.sum(dim=0)
    out = sum(w.unsqueeze(-1) * o for w, o in zip(weights, outs))
    return out / total.unsqueeze(-1)


def _merge_into(acc: tuple | None, out: torch.Tensor, lse: torch.Tensor) -> tuple:
    if acc is None:
        return out, lse
    lse_new = torch.logaddexp(acc[1], lse)
    safe = torch.where(torch.isfinite(lse_new), lse_new, torch.zeros_like(lse_new))
    merged = (torch.exp(acc[1] - safe).unsqueeze(-1) * acc[0]
              + torch.exp(lse - safe).unsqueeze(-1) * out)
    return merged, lse_new


def _exchange(chunk: torch.Tensor, me: int, cp: int, group) -> tuple[list, torch.Tensor]:
    """Start sending `chunk` to the next rank and receiving the previous rank's."""
    incoming = torch.empty_like(chunk)
    # the receive is posted first; gloo's isend/irecv both return at once, so no pairing order
    # between neighbours can deadlock
    recv = dist.irecv(incoming, group=group, group_src=(me - 1) % cp)
    send = dist.isend(chunk, group=group, group_dst=(me + 1) % cp)
    return [recv, send], incoming


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    kv_head_of_q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q over k/v, all visible or square-causal; both non-empty. On the CPU the
    fused flash kernel returns the log-sum-exp itself; elsewhere the plain form runs."""
    if q.device.type != "cpu":
        mask = None
        if causal:
            mask = torch.ones(len(q), len(k), dtype=torch.bool, device=q.device).tril()
        return partial_attention(q, k, v, mask, kv_head_of_q, scale)
    heads = lambda x: x.index_select(1, kv_head_of_q)  # noqa: E731
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, heads(k), heads(v)))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qt, kt, vt, 0.0, causal, scale=scale)
    return out[0].transpose(0, 1).float(), lse[0].transpose(0, 1)


# one rank's piece of one prompt: (prompt number, first position, end position, first row)
Segment = tuple[int, int, int, int]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   segments: list[list[Segment]], kv_head_of_q: torch.Tensor, scale: float,
                   me: int, group, clock: comm.CollectiveClock) -> torch.Tensor:
    """Causal attention of this rank's prompt queries over every rank's prompt keys.

    segments[r]: the chunks rank r holds (every rank knows them all from the batch). Chunks of
    one prompt share boundaries, so a key chunk either precedes a query chunk (all visible), is
    it (causal), or follows it (skipped: no masked work at all). cp steps: at step s the chunk
    in hand is rank (me - s)'s, already on its way to the next rank while it is attended."""
    cp = len(segments)
    width = max(sum(b - a for _, a, b, _ in segs) for segs in segments)
    chunk = torch.zeros((2, width, *k.shape[1:]), dtype=k.dtype, device=k.device)
    chunk[0, :len(k)], chunk[1, :len(v)] = k, v
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), device=q.device)
    for step in range(cp):
        src = (me - step) % cp
        pending = None
        if step + 1 < cp:  # the next chunk travels while this one is attended
            begin = time.perf_counter()
            pending, incoming = _exchange(chunk, me, cp, group)
            clock.busy_seconds += time.perf_counter() - begin
        for prompt, qa, qb, qrow in segments[me]:
            rows = slice(qrow, qrow + qb - qa)
            for other, ka, kb, krow in segments[src]:
                if other != prompt or ka >= qb or qa == qb or ka == kb:
                    continue
                o, s = block_attention(q[rows], chunk[0, krow:krow + kb - ka],
                                       chunk[1, krow:krow + kb - ka], ka == qa, kv_head_of_q,
                                       scale)
                out[rows], lse[rows] = _merge_into((out[rows], lse[rows]), o, s)
        if pending is not None:
            begin = time.perf_counter()
            for work in pending:
                work.wait()
            clock.add_since(begin)  # the wait is exposed; the flight overlapped compute
            chunk = incoming
    return out.to(q.dtype)
