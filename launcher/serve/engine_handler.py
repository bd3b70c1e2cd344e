"""OpenAI completions and chat completions over one `LLM`, through its public methods only.

Every choice runs through one token source, streamed or not, so stop strings, timing and
cancellation work the same way in both: `LLM.stream_with_output`, or in a disaggregated decode
deployment a prefill elsewhere and `LLM.decode_stream` here (disaggregated.py). A stream closed
early (a client gone, a stop string met) cancels its request in the engine, which frees its
blocks. The HTTP layer (app.py) and the Ray Serve deployments (ray_app.py) both call this class;
a prefill deployment calls `prefill_export` and `release`."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from engine import LLM, GenerateOutput, InvalidRequestError, KVPinnedError, RankFailure, SamplingParams
from launcher.serve.logprobs import completion_logprobs
from launcher.serve.protocol import ChatRequest, CompletionRequest, ServeError, _Sampling
from launcher.serve.text_stream import TextStream
from launcher.serve.undo import finish_or_undo


@dataclass(slots=True)
class Choice:
    """One choice's state while it runs, and its result."""

    index: int
    prompt: int  # which of the request's prompts
    prompt_ids: list[int]
    params: SamplingParams
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int | None = None  # unknown when a stop string ended it before the engine
    token_times: list[float] = field(default_factory=list)  # perf_counter at each token
    logprobs: dict | None = None  # OpenAI's completions `logprobs` object, when asked for


@dataclass(slots=True)
class Delta:
    """New text of one choice; `finish_reason` set on its last."""

    choice: Choice
    text: str
    finish_reason: str | None = None


log = logging.getLogger("serve")
MAX_CHOICES = 256  # prompts x n in one request: more would bypass serve.max_queued
# what /metrics shows of each engine replica, from LLM.cache_stats()
REPLICA_STATS = ("blocks_used", "blocks_total", "requests_running", "requests_waiting",
                 "prefix_lookup_tokens", "prefix_hit_tokens")
# a choice's tokens: (prompt ids, params) -> token ids as they come, then the GenerateOutput
TokenSource = Callable[[list[int], SamplingParams], AsyncIterator[int | GenerateOutput]]


class EngineHandler:
    def __init__(self, llm: LLM, model_name: str, restart_on_failure: bool = True,
                 tokens: TokenSource | None = None):
        self.llm, self.model_name = llm, model_name
        self.tokens = tokens or llm.stream_with_output
        self.restart_on_failure = restart_on_failure
        self.rank_failures = self.restarts = 0
        self.down: str | None = None  # why requests are refused (503) until a restart ends

    # ---- requests ----------------------------------------------------------------------------

    async def completion(self, req: CompletionRequest) -> dict:
        """The whole response of a non-streamed completion."""
        start = time.perf_counter()
        choices = self._completion_choices(req)
        async for _ in self._run_all(req, choices, req.max_tokens == 0):
            pass  # each choice gathers its own text and tokens
        if req.logprobs is not None:
            await self._add_logprobs(req, choices)
        body = [{"index": c.index, "text": self._echo(req, c) + c.text, "logprobs": c.logprobs,
                 "finish_reason": c.finish_reason} for c in choices]
        return self._envelope("text_completion", body, choices, start)

    async def completion_chunks(self, req: CompletionRequest) -> AsyncIterator[dict]:
        """The chunks of a streamed completion; the last one holds `usage` (and timing)."""
        start, rid = time.perf_counter(), _request_id("cmpl")
        choices = self._completion_choices(req)
        if req.logprobs is not None:
            raise ServeError(400, "logprobs with stream=true is not supported; request the "
                             "log-probabilities without streaming", param="logprobs")
        for c in choices if req.echo else []:
            yield self._chunk(rid, "text_completion", {"index": c.index, "text": self._echo(req, c),
                                                        "logprobs": None, "finish_reason": None})
        async for d in self._run_all(req, choices, False):
            yield self._chunk(rid, "text_completion", {
                "index": d.choice.index, "text": d.text, "logprobs": None,
                "finish_reason": d.finish_reason})
        yield self._envelope("text_completion", [], choices, start, rid)

    async def chat(self, req: ChatRequest) -> dict:
        start = time.perf_counter()
        choices = self._chat_choices(req)
        async for _ in self._run_all(req, choices, False):
            pass
        body = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                 "logprobs": None, "finish_reason": c.finish_reason} for c in choices]
        return self._envelope("chat.completion", body, choices, start)

    async def chat_chunks(self, req: ChatRequest) -> AsyncIterator[dict]:
        start, rid = time.perf_counter(), _request_id("chatcmpl")
        choices = self._chat_choices(req)
        for c in choices:
            yield self._chunk(rid, "chat.completion.chunk", {
                "index": c.index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None})
        async for d in self._run_all(req, choices, False):
            delta = {"content": d.text} if d.text or d.finish_reason is None else {}
            yield self._chunk(rid, "chat.completion.chunk", {
                "index": d.choice.index, "delta": delta, "logprobs": None,
                "finish_reason": d.finish_reason})
        yield self._envelope("chat.completion.chunk", [], choices, start, rid)

    async def prefill_export(self, prompt_ids: list[int],
                             params: SamplingParams) -> tuple[int, object, int]:
        """A prefill for a decode engine elsewhere: (first token, KVHandle, cached prompt
        tokens). A caller gone before it ends gets its handle released, not left pinned."""
        self._refuse_if_down()
        try:
            return await finish_or_undo(asyncio.to_thread(self._prefill_one, prompt_ids, params),
                                        lambda made: asyncio.to_thread(self.release, made[1]))
        except RankFailure as e:
            self._on_rank_failure(e)
            raise ServeError(503, str(e), "service_unavailable") from None
        except KVPinnedError as e:  # handles not yet decoded fill the cache: it passes
            raise ServeError(503, str(e), "service_unavailable") from None

    def _prefill_one(self, prompt_ids: list[int], params: SamplingParams) -> tuple[int, object, int]:
        [p] = self.llm.prefill([prompt_ids], params, export_kv=True)
        return p.first_token, p.kv, p.cached_tokens

    def release(self, kv) -> None:
        """Give back a handle from `prefill_export` that no decode took; one a decode used,
        or already reclaimed, is let be."""
        try:
            self.llm.release(kv)
        except InvalidRequestError as e:
            log.debug("release of %r: %s", kv, e)

    async def stats(self) -> list[dict]:
        """Per engine replica: REPLICA_STATS; whether it is up, and the rank failures and
        restarts this handler saw."""
        own = {"up": int(self.down is None), "rank_failures": self.rank_failures,
               "restarts": self.restarts}
        if self.down is not None:  # the rank groups are being rebuilt: nothing to ask
            return [{**dict.fromkeys(REPLICA_STATS, 0), **own}]
        s = await asyncio.to_thread(self.llm.cache_stats)
        return [{**{k: r[k] for k in REPLICA_STATS}, **own} for r in s["replicas"]]

    def _on_rank_failure(self, error: RankFailure) -> None:
        """Refuse requests (503) and rebuild the rank groups in the background."""
        if self.down is not None:
            return  # the requests that shared the failed step report the same failure
        self.rank_failures += 1
        self.down = f"the engine is down after a rank failure ({error})"
        if not self.restart_on_failure:
            return
        self.down = "the engine is restarting after a rank failure; retry shortly"

        def restart() -> None:
            try:
                self.llm.restart()
                self.restarts += 1
                self.down = None
            except Exception as e:  # noqa: BLE001  stays down, saying why
                log.exception("restart after a rank failure failed")
                self.down = f"the engine failed to restart after a rank failure: {e}"
        threading.Thread(target=restart, name="serve-restart", daemon=True).start()

    # ---- choices -----------------------------------------------------------------------------

    def _refuse_if_down(self) -> None:
        if self.down is not None:
            raise ServeError(503, self.down, "service_unavailable")

    def _completion_choices(self, req: CompletionRequest) -> list[Choice]:
        """One per prompt and n, each checked (prompt, params, stops) before anything runs."""
        self._refuse_if_down()
        req.refuse_unknown()
        if req.max_tokens == 0 and not req.echo:
            raise ServeError(400, "max_tokens=0 generates nothing: use it with echo=true (to "
                             "score the prompt), or ask for at least 1 token", param="max_tokens")
        prompts = req.prompts()
        if len(prompts) * req.n > MAX_CHOICES:
            raise ServeError(400, f"{len(prompts)} prompts x n={req.n} is more than "
                             f"{MAX_CHOICES} choices in one request; send several requests",
                             param="prompt")
        ids = [self.llm.tokenize(p) for p in prompts]
        req.stop_strings()
        params = [req.sampling_params(16, j) for j in range(req.n)]  # OpenAI's default: 16
        return [Choice(i * req.n + j, i, p, params[j]) for i, p in enumerate(ids)
                for j in range(req.n)]

    def _chat_choices(self, req: ChatRequest) -> list[Choice]:
        self._refuse_if_down()
        req.refuse_unknown()
        if req.logprobs or req.top_logprobs:
            raise ServeError(400, "logprobs in chat completions are not supported; use "
                             "/v1/completions with logprobs", param="logprobs")
        if req.max_completion_tokens is not None:
            req.max_tokens = req.max_completion_tokens
        tokenizer = self.llm.tokenizer
        if tokenizer is None or tokenizer.chat_template is None:
            raise ServeError(400, f"{self.model_name} has no chat template; use /v1/completions",
                             param="messages")
        ids = self.llm.tokenize(tokenizer.apply_chat_template(req.turns()))
        req.stop_strings()
        return [Choice(j, 0, ids, req.sampling_params(self.llm.max_model_len, j))
                for j in range(req.n)]

    async def _run_all(self, req: _Sampling, choices: list[Choice],
                       score_only: bool) -> AsyncIterator[Delta]:
        """Every choice at once, their deltas merged as they come."""
        if score_only:  # max_tokens=0 with echo: nothing to generate
            for c in choices:
                c.finish_reason = "length"
            return
        stops = req.stop_strings()
        runs = [self._run_one(c, stops) for c in choices]
        try:
            async with aclosing(_merge(runs)) as deltas:
                async for d in deltas:
                    yield d
        except RankFailure as e:
            self._on_rank_failure(e)
            raise ServeError(503, str(e), "service_unavailable") from None

    async def _run_one(self, c: Choice, stops: list[str]) -> AsyncIterator[Delta]:
        text, last = TextStream(self.llm.tokenizer, stops), ""
        async with aclosing(self.tokens(c.prompt_ids, c.params)) as items:
            async for item in items:
                if isinstance(item, GenerateOutput):
                    c.finish_reason, c.cached_tokens = item.finish_reason, item.cached_tokens
                    break
                c.token_times.append(time.perf_counter())
                c.token_ids.append(item)
                piece = text.add(item)
                if text.stopped:  # leaving the loop cancels the request
                    c.finish_reason, last = "stop", piece
                    break
                c.text += piece
                yield Delta(c, piece)
        rest = last + text.flush()
        c.text += rest
        yield Delta(c, rest, c.finish_reason)

    async def _add_logprobs(self, req: CompletionRequest, choices: list[Choice]) -> None:
        """Scored, not sampled: one `LLM.score` over prompt + generated tokens per choice."""
        for c in choices:
            c.logprobs = await asyncio.to_thread(completion_logprobs, self.llm, c.prompt_ids,
                                                 c.token_ids, req.logprobs, req.echo)

    # ---- response bodies ---------------------------------------------------------------------

    def _echo(self, req: CompletionRequest, c: Choice) -> str:
        return self.llm.tokenizer.decode(c.prompt_ids) if req.echo else ""

    def _chunk(self, rid: str, kind: str, choice: dict) -> dict:
        return {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_name,
                "choices": [choice]}

    def _envelope(self, kind: str, body: list[dict], choices: list[Choice], start: float,
                  rid: str | None = None) -> dict:
        """A response (or the closing chunk of a stream) with usage and, under `_timing`, what
        the metrics need; the HTTP layer strips `_timing`."""
        per_prompt = {c.prompt: c for c in choices}  # n choices share one prompt
        prompt_tokens = sum(len(c.prompt_ids) for c in per_prompt.values())
        completion_tokens = sum(len(c.token_ids) for c in choices)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        cached = [c.cached_tokens for c in choices if c.cached_tokens is not None]
        if cached:
            usage["prompt_tokens_details"] = {"cached_tokens": max(cached)}
        timing = {"start": start, "end": time.perf_counter(),
                  "token_times": [c.token_times for c in choices],
                  "finish_reasons": [c.finish_reason for c in choices]}
        return {"id": rid or _request_id("cmpl" if kind == "text_completion" else "chatcmpl"),
                "object": kind, "created": int(time.time()), "model": self.model_name,
                "choices": body, "usage": usage, "_timing": timing}


def _request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def _merge(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[Delta]:
    """Items of several async iterators as each comes; closing this closes them all."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[Delta]) -> None:
        try:
            async with aclosing(stream) as items:
                async for item in items:
                    await queue.put(item)
        except BaseException as e:  # noqa: BLE001  raised again by the reader
            await queue.put(e)
            return
        await queue.put(done)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        for _ in tasks:
            while (item := await queue.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
