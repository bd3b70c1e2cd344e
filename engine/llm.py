"""The public entry point: check and tokenize prompts, hand them to the step loop, return outputs.

Everything above the engine (launcher/, bench/, the walkthrough) uses only the methods here.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import weakref
from contextlib import aclosing, contextmanager
from typing import AsyncIterator, Iterator, Sequence as Seq

from engine.config import EngineConfig
from engine.driver import scoring
from engine.driver.engine_core import SHUT_DOWN, EngineCore
from engine.driver.ranks import connect_if_needed
from engine.driver.outputs import GenerateOutput, PrefillOutput, ScoreOutput
from engine.driver.prompts import Prompt, PromptLimits, as_prompt_list, prompt_token_ids
from engine.driver.replica import Replica, StepTiming, start_replicas
from engine.driver.sampling_params import SamplingParams, check_params
from engine.driver.sequence import Sequence
from engine.errors import InvalidRequestError, KVPinnedError
from engine.loading.checkpoint import open_checkpoint
from engine.loading.gguf_blocks import require_q4_projections
from engine.loading import weight_digest
from engine.loading.tokenizer import load_tokenizer
from engine.plan import RankInfo, make_plan
from engine.rank.host_memory import keep_freed_memory
from engine.rank.worker import Worker
from engine.transfer.exports import ExportTable, is_pinned
from engine.transfer.handle import KVHandle, model_fingerprint
from engine.transfer.imports import adopt

log = logging.getLogger("engine")


class LLM:
    """`LLM("smollm2", tp=2)`: keyword arguments are the settings of `EngineConfig`."""

    def __init__(self, model: str = "smollm2", **settings):
        self.config = cfg = EngineConfig.from_kwargs(model=model, **settings)
        ckpt = open_checkpoint(model)
        if cfg.weights == "gguf":
            require_q4_projections(ckpt)
        self.model_config = mc = ckpt.config
        self.tokenizer = load_tokenizer(ckpt)
        self.plan = plan = make_plan(cfg, model, mc)
        self.max_model_len = plan.max_model_len
        self._limits = PromptLimits(model, mc.vocab_size, plan.max_model_len)
        # the core never refers back to this object, so an LLM dropped without shutdown() is
        # collected, and the finalizer releases its actors and placement groups
        connect_if_needed(cfg)
        if not plan.on_cuda:  # before the step thread that runs in-process ranks is started
            keep_freed_memory()
        self._core = EngineCore(
            lambda: start_replicas(plan, cfg, ckpt),
            cfg.retry_on_rank_failure, cfg.routing, plan.block_size)
        self._finalizer = weakref.finalize(self, self._core.shutdown)
        # disaggregated prefill: what a KVHandle must match here, and the handles given out
        digests = self._core.call(lambda: self._core.replicas[0].run_on_ranks(Worker.weight_digest))
        # quantized weights compute other K/V from the same checkpoint: part of the fingerprint
        weights = weight_digest.combine(digests) + (f"+{cfg.weights}" if cfg.weights else "")
        self._fingerprint = model_fingerprint(mc, weights, plan.dtype, plan.block_size)
        self._exports = ExportTable(self._core, cfg.kv_handle_ttl_s, cfg.ray_address)
        self._exports_finalizer = weakref.finalize(self, self._exports.close)
        log.info("KV cache: %d blocks of %d tokens per rank, %d replica(s) of tp=%d",
                 plan.num_blocks, cfg.block_size, cfg.dp, cfg.tp)

    # ---- requests ----------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, checked exactly as a request's would be."""
        return prompt_token_ids(prompt, self.tokenizer, self._limits)

    def prefill(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | None = None,
                export_kv: bool = False) -> list[PrefillOutput]:
        """One forward pass per prompt; the first token (chosen by `params`, greedy by default)
        and the last position's logits. With `export_kv`, each output's `.kv` is a KVHandle for
        another engine's `decode()`; its blocks stay pinned here until it is decoded, released
        (`release(kv)`) or `kv_handle_ttl_s` passes."""
        if not isinstance(export_kv, bool):  # "no" or 0.0 must not pin blocks by being truthy
            kind = type(export_kv)  # numpy's bool calls itself "bool": name its module too
            name = f"{kind.__module__}.{kind.__name__}".removeprefix("builtins.")
            raise InvalidRequestError(f"export_kv={export_kv!r} is a {name}: use True or False")
        if export_kv:
            self._refuse_with_cp("prefill(export_kv=True)")
        first = dataclasses.replace(check_params(params), max_tokens=1)
        seqs = self._sequences(prompts, first, keep_first_logits=True)
        for s in seqs:
            s.pin_kv = export_kv
        try:
            self._core.submit(seqs)
            self._wait(seqs)
        except KVPinnedError as e:
            own = sum(is_pinned(s) for s in seqs)
            self._exports.unpin(seqs)
            raise KVPinnedError(f"{e}. {self._exports.describe_pinned(own)}") from None
        except BaseException:
            self._exports.unpin(seqs)
            raise
        handles = self._exports.export(seqs, self._fingerprint) if export_kv else [None] * len(seqs)
        return [PrefillOutput(s.prompt_token_ids, s.output_token_ids[0],
                              self._text([s.output_token_ids[0]]), s.first_logits,
                              s.first_token_time - s.arrival_time, s.num_cached_tokens,
                              s.kv_block_table, kv) for s, kv in zip(seqs, handles)]

    def decode(self, handles: Seq[KVHandle],
               params: SamplingParams | None = None) -> list[GenerateOutput]:
        """Continue requests another engine prefilled (any TP size): pull each handle's K/V,
        re-partitioned for this engine's heads, then decode. Tokens start with the prefill's
        first token, as `generate` on one engine gives them (pass the prefill the same params)."""
        return [self._output(s) for s in self._wait(self._adopt(handles, params))]

    async def decode_stream(self, handle: KVHandle, params: SamplingParams | None = None
                            ) -> AsyncIterator[int | GenerateOutput]:
        """`decode([handle], params)` as a stream, items as `stream_with_output` gives them:
        each token id (the prefill's first token first) as its step ends, then the
        GenerateOutput. Closing it early, or cancelling it while the K/V are pulled, cancels the
        request and frees its blocks here; the source's blocks come back once the pull is done
        (the handle is used), so a handle whose pull failed is still the caller's to release."""
        pulled: concurrent.futures.Future = concurrent.futures.Future()

        def pull() -> None:  # a thread of its own: the pull blocks until the K/V are in
            try:
                pulled.set_result(self._adopt([handle], params))
            except BaseException as e:  # noqa: BLE001  raised again by the awaiting reader
                pulled.set_exception(e)
        threading.Thread(target=pull, name="engine-kv-pull", daemon=True).start()
        try:
            [seq] = await asyncio.shield(asyncio.wrap_future(pulled))
        except asyncio.CancelledError:  # the pull runs on, even past this event loop's end
            pulled.add_done_callback(self._cancel_adopted)
            raise
        async with aclosing(self._follow(seq)) as items:
            async for item in items:
                yield item

    def _adopt(self, handles: Seq[KVHandle], params: SamplingParams | None) -> list[Sequence]:
        """decode()'s sequences, running here with the handles' K/V pulled."""
        self._refuse_with_cp("decode()")
        params, handles = check_params(params), list(handles)
        self._exports.sync()
        if any(self._exports.owns(h) and h.ranks[0].actor is not None for h in handles):
            # its ranks would wait on themselves: they serve the pull from their own blocks
            raise InvalidRequestError("a handle exported by this engine's rank actors: decode it "
                                      "on another engine (or call generate() here)")
        return adopt(self._core, self.plan, self._fingerprint, handles, params,
                     self.config.step_timeout_s)

    def _cancel_adopted(self, pulled: concurrent.futures.Future) -> None:
        if pulled.exception() is None:
            for seq in pulled.result():
                self._core.cancel(seq)

    def release(self, kv: KVHandle) -> None:
        """Give back the blocks of a handle this engine exported and nobody will decode."""
        self._exports.release(kv)

    def generate(self, prompts: Prompt | Seq[Prompt],
                 params: SamplingParams | None = None) -> list[GenerateOutput]:
        seqs = self._sequences(prompts, params)
        self._core.submit(seqs)
        return [self._output(s) for s in self._wait(seqs)]

    async def generate_async(self, prompt: Prompt,
                             params: SamplingParams | None = None) -> GenerateOutput:
        """One request on the same step loop; cancelling the task frees its blocks."""
        [seq] = self._sequences([prompt], params)
        self._core.submit([seq])
        try:
            return self._output(await asyncio.wrap_future(seq.future))
        except asyncio.CancelledError:
            self._core.cancel(seq)
            raise

    async def stream(self, prompt: Prompt,
                     params: SamplingParams | None = None) -> AsyncIterator[int]:
        """Each generated token id as soon as its step ends."""
        async with aclosing(self.stream_with_output(prompt, params)) as items:
            async for item in items:
                if not isinstance(item, GenerateOutput):
                    yield item

    async def stream_with_output(self, prompt: Prompt, params: SamplingParams | None = None
                                 ) -> AsyncIterator[int | GenerateOutput]:
        """`stream`'s token ids, then the request's GenerateOutput (finish reason, cached
        tokens, TTFT) as the last item. Closing it early cancels the request, freeing its blocks."""
        [seq] = self._sequences([prompt], params)
        self._core.submit([seq])
        async with aclosing(self._follow(seq)) as items:
            async for item in items:
                yield item

    async def _follow(self, seq: Sequence) -> AsyncIterator[int | GenerateOutput]:
        """A submitted (or adopted) request's new token ids as its steps end, then its output;
        cancelled when closed early. It reads the tokens by count, so the ones produced before
        it listened (an adopted request may step before this starts) are not lost."""
        loop, woken = asyncio.get_running_loop(), asyncio.Event()

        def wake(_=None) -> None:  # from the step loop's thread
            try:
                loop.call_soon_threadsafe(woken.set)
            except RuntimeError:  # a reader that stopped early closed its loop: nobody listens
                pass
        seq.on_token = wake
        seq.future.add_done_callback(wake)
        woken.set()  # tokens may be in already
        sent = 0
        try:
            while True:
                await woken.wait()
                woken.clear()
                done = seq.future.done()  # before reading: no token comes after the future ends
                new = seq.output_token_ids[sent:]
                sent += len(new)
                for token in new:
                    yield token
                if done:
                    break
            yield self._output(seq.future.result())  # a failed request raises here
        finally:
            if not seq.future.done():
                self._core.cancel(seq)

    def score(self, prompts: Prompt | Seq[Prompt], top_logprobs: int = 0) -> list[ScoreOutput]:
        """Log-probability of every prompt token after the first, perplexity, and optionally the
        `top_logprobs` likeliest tokens at each position. Prompts need at least 2 tokens. A
        scored prompt is computed whole even when its prefix is cached."""
        self._refuse_with_cp("score()")
        k = scoring.check_top_logprobs(top_logprobs, self.model_config.vocab_size)
        seqs = self._sequences(prompts, SamplingParams(max_tokens=1))
        scoring.check_scorable([s.prompt_token_ids for s in seqs])
        for seq in seqs:  # before the scheduler can see them
            seq.score = scoring.ScoreRequest(k, seq.num_prompt_tokens)
        self._core.submit(seqs)
        return [scoring.score_output(s) for s in self._wait(seqs)]

    def walkthrough(self, prompt: Prompt, hardware: str = "cpu-measured", decode_tokens: int = 8,
                    top_k: int = 5):
        """A measured walk through this engine's prefill of `prompt` and one decode step: every
        op per layer per rank, the KV cache, the first token, the cache's savings, the TTFT."""
        from engine.observe.hardware import hardware as lookup
        from engine.observe.prefill_walk import run_walkthrough

        self._refuse_with_cp("walkthrough()")
        hw = lookup(hardware, self.config.device, self.config.torch_dtype)
        return run_walkthrough(self, prompt, hw, decode_tokens, top_k)

    # ---- inspection --------------------------------------------------------------------------

    def rank_info(self, replica: int = 0) -> list[RankInfo]:
        """Each rank of a replica: its heads, FFN and vocabulary slices, weight and KV bytes."""
        return list(self._replica(replica).rank_info)

    def rank_pids(self) -> list[list[int]]:
        """The process id of every rank, per replica (the driver's own for an in-process rank)."""
        return [[i.pid for i in r.rank_info] for r in self._core.replicas]

    def rank_memory(self) -> list[list[dict]]:
        """Each rank's resident (CPU) or peak allocated (CUDA) bytes, per replica."""
        return self._core.call(lambda: [r.run_on_ranks(Worker.memory) for r in self._core.replicas])

    def placement(self) -> list[list[tuple[str, str]]]:
        """(node ip, node id) of every rank, per replica."""
        return [r.node_addresses() for r in self._core.replicas]

    def step_timings(self, replica: int = 0) -> list[StepTiming]:
        return self._core.call(lambda: list(self._replica(replica).steps))

    def cache_stats(self) -> dict:
        """Blocks used/free/pinned, prefix-cache hits, preemptions, per-rank KV bytes: for the
        whole engine at the top (the same keys at any dp), each replica's under `replicas`; and
        `kv_handles_pinned`, the exported handles whose blocks this engine still holds."""
        self._exports.sync()  # blocks of handles used, released or expired come back first
        out = self._core.call(lambda: [r.stats() for r in self._core.replicas])
        if not out:
            raise InvalidRequestError(SHUT_DOWN)
        return {**_engine_stats(out), "replicas": out,
                "kv_handles_pinned": self._exports.pinned_handles}

    def read_kv(self, layer: int, block_table: list[int], length: int,
                replica: int = 0) -> list[tuple]:
        """Each rank's (K, V) of `length` positions stored in `block_table`, [length, kv heads, d]."""
        return self._core.call(
            lambda: self._replica(replica).run_on_ranks(Worker.read_kv, layer, block_table, length))

    @contextmanager
    def tracing(self) -> Iterator[list[dict]]:
        """Record every op every rank runs inside the block: the list fills when it ends."""
        # the op costs read the plain step metadata; the ring's is another kind
        self._refuse_with_cp("tracing()")
        records: list[dict] = []
        self._core.call(lambda: [r.run_on_ranks(Worker.start_tracing)
                                 for r in self._core.replicas])
        try:
            yield records
        finally:
            per_rank = self._core.call(
                lambda: [rec for r in self._core.replicas
                         for rank in r.run_on_ranks(Worker.stop_tracing) for rec in rank])
            records.extend(per_rank)

    @contextmanager
    def prefix_caching(self, enabled: bool) -> Iterator[None]:
        """Serve and record prefix-cache hits, or not, for every request inside the block."""
        if enabled and self.plan.cp > 1:  # a cached block holds one rank's slice, not a prefix
            raise InvalidRequestError(f"prefix caching is not supported with cp={self.plan.cp}")
        managers = self._core.call(lambda: [r.block_manager for r in self._core.replicas])
        saved = [bm.enable_prefix_caching for bm in managers]
        self._core.call(lambda: [setattr(bm, "enable_prefix_caching", enabled) for bm in managers])
        try:
            yield
        finally:
            self._core.call(lambda: [setattr(bm, "enable_prefix_caching", s)
                                     for bm, s in zip(managers, saved)])

    # ---- lifetime ----------------------------------------------------------------------------

    def restart(self) -> None:
        """Tear every rank down and start the groups afresh, e.g. after a RankFailure. Requests
        in flight fail with a clear error."""
        self._exports.close()  # exported K/V went with the old ranks
        connect_if_needed(self.config)  # from this thread: the step loop builds the new ranks
        self._core.restart()

    def shutdown(self) -> None:
        self._exports.close()
        self._core.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- internals ---------------------------------------------------------------------------

    def _refuse_with_cp(self, what: str) -> None:
        if self.plan.cp > 1:  # each rank holds a slice of positions: neither path reads those
            raise InvalidRequestError(f"{what} is not supported with cp={self.plan.cp} yet; use "
                                      f"an engine with cp=1 (tp may be any size)")

    def _replica(self, index: int) -> Replica:
        if not self._core.replicas:
            raise InvalidRequestError(SHUT_DOWN)
        return self._core.replicas[index]

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer else ""

    def _output(self, s: Sequence) -> GenerateOutput:
        return GenerateOutput(s.prompt_token_ids, s.output_token_ids, self._text(s.output_token_ids),
                              s.first_token_time - s.arrival_time, s.num_cached_tokens,
                              s.finish_reason)

    def _sequences(self, prompts, params: SamplingParams | None,
                   keep_first_logits: bool = False) -> list[Sequence]:
        params = check_params(params)
        self._exports.sync()
        return [Sequence(self.tokenize(p), params, keep_first_logits=keep_first_logits)
                for p in as_prompt_list(prompts)]

    def _wait(self, seqs: list[Sequence]) -> list[Sequence]:
        """Wait for every submitted request; the first failure is raised once all are done."""
        try:
            concurrent.futures.wait([s.future for s in seqs])
        except BaseException:  # e.g. Ctrl-C: the requests must not run on without a reader
            for seq in seqs:
                self._core.cancel(seq)
            raise
        for seq in seqs:
            seq.future.result()
        return seqs


def _engine_stats(per_replica: list[dict]) -> dict:
    """A replica's keys for the whole engine: counts summed over replicas, the hit rate of the
    sums, per-rank figures as every replica has them (the replicas' ranks are alike)."""
    total = dict(per_replica[0])
    for key, value in total.items():
        if isinstance(value, int):
            total[key] = sum(r[key] for r in per_replica)
    looked = total["prefix_lookup_tokens"]
    total["hit_rate"] = total["prefix_hit_tokens"] / looked if looked else 0.0
    return total
