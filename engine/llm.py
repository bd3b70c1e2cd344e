"""The public entry point: tokenize, schedule, run steps on the ranks, return outputs."""
from __future__ import annotations

import logging
import threading
from typing import Sequence as Seq

from engine.rank.backend import select_backend
from engine.loading.checkpoint import open_checkpoint
from engine.config import EngineConfig
from engine.errors import ConfigError, InvalidRequestError, NumericalError, RankFailure
from engine.driver import scoring
from engine.driver.executor import make_executors
from engine.driver.prompts import Prompt, PromptLimits, as_prompt_list, prompt_token_ids
from engine.driver.outputs import GenerateOutput, PrefillOutput, ScoreOutput
from engine.driver.sampling_params import SamplingParams
from engine.driver.replica import Replica, StepTiming
from engine.driver.sequence import Sequence
from engine.loading.tokenizer import load_tokenizer
from parallel.partition import partition_heads

log = logging.getLogger("engine")


class LLM:
    """`LLM("smollm2", tp=2)`: keyword arguments are the settings of `EngineConfig`."""

    def __init__(self, model: str = "smollm2", **settings):
        self.config = cfg = EngineConfig.from_kwargs(model=model, **settings)
        ckpt = open_checkpoint(model)
        self.model_config = mc = ckpt.config
        self.tokenizer = load_tokenizer(ckpt)
        try:
            partition_heads(mc.num_heads, mc.num_kv_heads, cfg.tp)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        select_backend(cfg.attention_backend, cfg.device)  # a bad choice fails here, not in a rank
        self.max_model_len = cfg.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ConfigError(f"max_model_len={cfg.max_model_len} exceeds the model's context of "
                              f"{mc.max_position_embeddings} tokens; use at most that")
        self._checkpoint = ckpt
        # one step at a time; threads that submit together are batched into the same steps
        self._lock = threading.RLock()
        self._failure: str | None = None
        self.replicas: list[Replica] = []
        self._start()

    def _start(self) -> None:
        cfg, mc = self.config, self.model_config
        self.replicas = [Replica(cfg, ex, self.max_model_len, mc.eos_token_ids)
                         for ex in make_executors(cfg, self._checkpoint)]
        self.rank_info = self.replicas[0].rank_info
        self._failure = None
        bm = self.replicas[0].block_manager
        log.info("KV cache: %d blocks of %d tokens (%d tokens) per rank, %d replica(s) of tp=%d",
                 bm.num_blocks, cfg.block_size, bm.num_blocks * cfg.block_size, cfg.dp, cfg.tp)

    def restart(self) -> None:
        """Tear every rank down and start the groups afresh, e.g. after a RankFailure."""
        with self._lock:
            self.shutdown()
            self._start()

    # ---- public API -------------------------------------------------------------------------

    def prefill(self, prompts: Prompt | Seq[Prompt]) -> list[PrefillOutput]:
        """One forward pass per prompt; the first token and the last position's logits."""
        seqs = self._submit(prompts, SamplingParams(max_tokens=1), keep_first_logits=True)
        self._run(seqs)
        return [PrefillOutput(s.prompt_token_ids, s.output_token_ids[0],
                              self._text([s.output_token_ids[0]]), s.first_logits,
                              s.first_token_time - s.arrival_time, s.num_cached_tokens,
                              s.kv_block_table)
                for s in seqs]

    def generate(self, prompts: Prompt | Seq[Prompt],
                 params: SamplingParams | None = None) -> list[GenerateOutput]:
        seqs = self._submit(prompts, params or SamplingParams())
        self._run(seqs)
        return [GenerateOutput(s.prompt_token_ids, s.output_token_ids,
                               self._text(s.output_token_ids), s.first_token_time - s.arrival_time,
                               s.num_cached_tokens, s.finish_reason) for s in seqs]

    def score(self, prompts: Prompt | Seq[Prompt], top_logprobs: int = 0) -> list[ScoreOutput]:
        """Log-probability of every prompt token after the first, perplexity, and optionally the
        `top_logprobs` likeliest tokens at each position. Prompts need at least 2 tokens. A
        scored prompt is computed whole even when its prefix is cached."""
        k = scoring.check_top_logprobs(top_logprobs, self.model_config.vocab_size)
        if not self.replicas:
            raise InvalidRequestError("this LLM was shut down; call restart() or create a new one")
        token_lists = [self._tokens(p) for p in as_prompt_list(prompts)]
        scoring.check_scorable(token_lists)
        seqs = self._submit(token_lists, SamplingParams(max_tokens=1), score_top_k=k)
        self._run(seqs)
        return [scoring.score_output(s) for s in seqs]

    def walkthrough(self, prompt: Prompt, hardware: str = "cpu-measured", decode_tokens: int = 8,
                    top_k: int = 5):
        """A measured walk through this engine's prefill of `prompt` and one decode step: every
        op per layer per rank, the KV cache, the first token, the cache's savings, the TTFT."""
        from engine.observe.hardware import hardware as lookup
        from engine.observe.walkthrough import run_walkthrough

        hw = lookup(hardware, self.config.device, self.config.torch_dtype)
        return run_walkthrough(self, prompt, hw, decode_tokens, top_k)

    def read_kv(self, layer: int, block_table: list[int], length: int,
                replica: int = 0) -> list[tuple]:
        """Each rank's (K, V) of `length` positions stored in `block_table`, [length, kv heads, d]."""
        return self.replicas[replica].executor.call("read_kv", layer, block_table, length)

    def cache_stats(self) -> dict:
        """Per replica: blocks used/free, prefix-cache hits, preemptions, per-rank KV bytes."""
        out = []
        for r in self.replicas:
            stats = r.block_manager.stats()
            stats["kv_bytes_per_token_per_rank"] = [i["kv_bytes_per_token"] for i in r.rank_info]
            stats["kv_cache_bytes_per_rank"] = [i["kv_cache_bytes"] for i in r.rank_info]
            stats["preemptions"] = r.scheduler.num_preemptions
            out.append(stats)
        return {"replicas": out, **out[0]} if len(out) == 1 else {"replicas": out}

    def step_timings(self, replica: int = 0) -> list[StepTiming]:
        return list(self.replicas[replica].steps)

    def placement(self) -> list[list[tuple[str, str]]]:
        """(node ip, node id) of every rank, per replica."""
        return [list(zip(r.executor.node_ips(), r.executor.node_ids())) for r in self.replicas]

    def shutdown(self) -> None:
        with self._lock:
            for r in self.replicas:
                r.executor.shutdown()
            self.replicas = []

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- internals --------------------------------------------------------------------------

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer else ""

    def _submit(self, prompts, params: SamplingParams, keep_first_logits: bool = False,
                score_top_k: int | None = None) -> list[Sequence]:
        if not self.replicas:
            raise InvalidRequestError("this LLM was shut down; call restart() or create a new one")
        token_lists = [self._tokens(p) for p in as_prompt_list(prompts)]
        seqs = [Sequence(t, params, keep_first_logits=keep_first_logits) for t in token_lists]
        if score_top_k is not None:  # set before the scheduler can see them
            for s in seqs:
                s.score = scoring.ScoreRequest(score_top_k, s.num_prompt_tokens)
        with self._lock:
            if self._failure is not None:
                raise RankFailure(f"{self._failure}; call restart() or create a new LLM")
            self._add(seqs)
        return seqs

    def _add(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            min(self.replicas, key=lambda r: r.load).scheduler.add(s)

    def _tokens(self, prompt: Prompt) -> list[int]:
        bm = self.replicas[0].block_manager
        limits = PromptLimits(self.config.model, self.model_config.vocab_size, self.max_model_len,
                              bm.block_size, bm.num_blocks)
        return prompt_token_ids(prompt, self.tokenizer, limits)

    def _run(self, seqs: list[Sequence]) -> None:
        """Step the engine until every one of `seqs` is done. A rank failure fails them all, or,
        with retry_on_rank_failure, restarts the groups once and runs them again from scratch."""
        try:
            self._drive(seqs)
        except RankFailure:
            if not self.config.retry_on_rank_failure:
                raise
            with self._lock:
                if self._failure is not None:  # the first thread here restarts for everyone
                    log.warning("restarting the rank groups after: %s", self._failure)
                    self.restart()
                for seq in seqs:
                    seq.reset()
                self._add(seqs)
            self._drive(seqs)
        bad = [s for s in seqs if s.finish_reason == "nonfinite"]
        if bad:
            raise NumericalError(
                f"{len(bad)} request(s) gave NaN/Inf logits (prompt lengths "
                f"{[s.num_prompt_tokens for s in bad]}): the weights or dtype overflow; try "
                f"dtype='float32'. Other requests are unaffected")

    def _drive(self, seqs: list[Sequence]) -> None:
        while True:
            with self._lock:
                if any(s.finish_reason == "rank failure" for s in seqs):
                    # another thread's step found the dead rank (and may have restarted since)
                    raise RankFailure(self._failure or "a rank failed while this request ran")
                if all(s.finish_reason is not None for s in seqs):
                    return
                try:
                    self._step()
                except RankFailure as e:
                    self._failure = str(e)
                    for r in self.replicas:  # every request in flight shares the broken group
                        r.scheduler.abort(list(r.scheduler.waiting) + r.scheduler.running,
                                          "rank failure")
                    raise
                except BaseException:
                    for r in self.replicas:
                        r.scheduler.abort([s for s in seqs if s.finish_reason is None])
                    raise

    def _step(self) -> None:
        """One step on every replica with work; the replicas run concurrently."""
        launched = [(r, r.launch()) for r in self.replicas]
        for replica, handle in launched:
            if handle is not None:
                replica.finish(handle)
