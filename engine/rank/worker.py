"""One rank: its shard of the model, its slice of the paged KV cache, and the step it runs.

The same class runs in the driver's process (one rank) or inside a Ray actor (one per rank)."""
from __future__ import annotations

import os
import time

import torch

from engine.rank.attention import AttentionMetadata
from engine.batch import Batch, StepResult
from engine.rank.backend import select_backend
from engine.loading.checkpoint import Checkpoint, open_checkpoint
from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.rank.kv_cache import KVCache
from engine.rank.model import CausalLM, ShardPlan
from engine.observe import costs
from engine.rank.sampler import sample
from engine.rank.scoring import score_batch
from parallel import comm
from parallel.partition import partition_heads
from parallel.trace import TRACER


class Worker:
    def __init__(self, cfg: EngineConfig, rank: int = 0, world_size: int = 1,
                 checkpoint: Checkpoint | None = None):
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.rank, self.device, self.dtype = rank, torch.device(cfg.device), cfg.torch_dtype
        ckpt = checkpoint or open_checkpoint(cfg.model)
        self.model_cfg = mc = ckpt.config
        self.max_model_len = cfg.max_model_len or mc.max_position_embeddings
        self.plan = ShardPlan.for_rank(mc, rank, world_size)
        self.backend = select_backend(cfg.attention_backend, cfg.device)
        self.model = CausalLM(mc, self.plan, self.max_model_len, self.backend)
        self._load(ckpt)
        for p in self.model.parameters():  # buffers (rotary tables) stay float32
            p.data = p.data.to(self.device, self.dtype)
        self.model.to(self.device)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        heads = self.plan.heads.num_kv_heads
        self.kv_bytes_per_token = KVCache.bytes_per_token(mc.num_layers, heads, mc.head_dim, self.dtype)
        # every rank gets the same number of blocks, as many as the rank with most KV heads fits
        widest = max(p.num_kv_heads for p in partition_heads(mc.num_heads, mc.num_kv_heads, world_size))
        widest_bytes = KVCache.bytes_per_token(mc.num_layers, widest, mc.head_dim, self.dtype)
        num_blocks = int(cfg.kv_cache_gb * 2**30) // (widest_bytes * cfg.block_size)
        self.cache = KVCache(mc.num_layers, num_blocks, cfg.block_size, heads, mc.head_dim,
                             self.dtype, self.device)
        mapping = self.plan.heads.kv_head_of_q_head()
        self.kv_head_of_q = torch.tensor(mapping, device=self.device)
        group = len(mapping) // self.plan.heads.num_kv_heads
        self.uniform_groups = mapping == [h // group for h in range(len(mapping))]

    def _load(self, ckpt: Checkpoint) -> None:
        """Every tensor the model needs, each exactly as expected, and no tensor left over."""
        used: set[str] = set()

        def read(name, dim, start, stop):
            used.add(name)
            tensor = ckpt.read(name, dim, start, stop)
            if not torch.isfinite(tensor).all():
                raise ModelLoadError(f"{ckpt.source}: tensor {name} holds NaN or Inf values; "
                                     f"the checkpoint is corrupt")
            return tensor

        try:
            self.model.load(read)
        except ValueError as e:
            raise ModelLoadError(f"{ckpt.source}: {e}") from None
        extra = sorted(ckpt.names() - used)
        if extra:
            raise ModelLoadError(f"{ckpt.source}: {len(extra)} tensor(s) this architecture does not "
                                 f"use, e.g. {extra[:3]}; is config.json for another model?")

    def info(self) -> dict:
        h = self.plan.heads
        return {"rank": self.rank, "q_heads": h.q_heads, "kv_heads": h.kv_heads,
                "ffn": self.plan.ffn, "vocab": self.plan.vocab_ranges[self.rank],
                "weight_bytes": self.weight_bytes, "kv_bytes_per_token": self.kv_bytes_per_token,
                "num_blocks": self.cache.num_blocks, "kv_cache_bytes": self.cache.nbytes}

    def execute(self, batch: Batch) -> StepResult | None:
        dev, start = self.device, time.perf_counter()
        comm.collective_seconds()  # start this step's count from zero
        meta = AttentionMetadata(
            cu_seqlens_q=batch.cu_seqlens_q, context_lens=batch.context_lens,
            block_tables=batch.block_tables,
            slot_mapping=torch.tensor(batch.slot_mapping, device=dev),
            kv_head_of_q=self.kv_head_of_q, uniform_groups=self.uniform_groups)
        h, residual = self.model.hidden_states(torch.tensor(batch.token_ids, device=dev),
                                               torch.tensor(batch.positions, device=dev),
                                               self.cache, meta)
        logits = self.model.logits(h, residual, torch.tensor(batch.logits_indices, device=dev,
                                                             dtype=torch.long))
        score = score_batch(self.model, h, residual, batch)  # None unless the batch scores rows
        if self.rank != 0:
            return None
        forward_s, collective_s = time.perf_counter() - start, comm.collective_seconds()
        tokens, nonfinite, start = [], [], time.perf_counter()
        if logits is not None:  # None: every sequence is mid-prompt, nothing to sample
            logits = logits.cpu()
            # a row of NaN/Inf would "sample" garbage: flag it, and sample from a safe stand-in
            nonfinite = (~torch.isfinite(logits).all(-1)).nonzero().flatten().tolist()
            safe = logits.nan_to_num(0.0, 0.0, 0.0) if nonfinite else logits
            with TRACER.op("sample", lambda: costs.sample(logits), logits.device):
                tokens = sample(safe, batch.sampling)
        return StepResult(tokens, logits if batch.return_logits else None, forward_s, collective_s,
                          time.perf_counter() - start, nonfinite, score)

    def memory(self) -> dict:
        """This rank's resident memory (CPU) or peak allocated memory (CUDA), in bytes."""
        if self.device.type == "cuda":
            return {"rank": self.rank, "resident_bytes": torch.cuda.max_memory_allocated(self.device)}
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return {"rank": self.rank, "resident_bytes": pages * os.sysconf("SC_PAGE_SIZE")}

    def trace_start(self) -> None:
        TRACER.start(self.rank)

    def trace_stop(self) -> list[dict]:
        """Every op this rank ran since trace_start, with shapes, FLOPs, bytes and time."""
        return [r.to_dict() for r in TRACER.stop()]

    def read_kv(self, layer: int, block_table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's K/V of one sequence ([length, local kv heads, d]), for inspection."""
        k, v = self.cache.gather(layer, block_table, length)
        return k.cpu(), v.cpu()
