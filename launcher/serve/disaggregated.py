"""serve.disaggregated: each choice's prompt is prefilled on the prefill deployment, its first
token sent at once, and its K/V handed over as a `KVHandle` to the decode deployment, whose
engine streams the rest (`LLM.decode_stream`). `RemotePrefill` is the decode deployment's token
source for EngineHandler, so usage, stop strings, metrics and finish reasons are the colocated
path's.

The handle's blocks on the prefill engine come back on every path: once a decode adopted it
(its lease used), or by `release` on the prefill deployment when the client left before the
decode took it or the pull failed. A decode deployment that dies holding one leaves it to
`engine.kv_handle_ttl_s`."""
from __future__ import annotations

import dataclasses
import logging
from contextlib import aclosing
from typing import AsyncIterator

import ray

from engine import LLM, EngineError, GenerateOutput, SamplingParams
from launcher.serve.protocol import ServeError
from launcher.serve.undo import finish_or_undo

log = logging.getLogger("serve")


class RemotePrefill:
    """A choice's tokens: the first from the prefill deployment, the rest decoded by `llm`."""

    def __init__(self, prefill, llm: LLM):
        self.prefill, self.llm = prefill, llm  # prefill: the prefill deployment's handle

    async def __call__(self, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[int | GenerateOutput]:
        first, kv, cached = await finish_or_undo(
            remote(self.prefill.prefill_export, prompt_ids, params),
            lambda made: remote(self.prefill.release, made[1]))
        adopted = False  # once the decode engine holds the K/V, the prefill's blocks are free
        try:
            yield first  # the time to first token is the prefill's
            async with aclosing(self.llm.decode_stream(kv, params)) as items:
                await anext(items)  # the first token again: decode's outputs start with it
                adopted = True
                async for item in items:
                    if isinstance(item, GenerateOutput):  # the prefix cache hit on the prefill
                        item = dataclasses.replace(item, cached_tokens=cached)
                    yield item
        finally:
            if not adopted:  # the client left, or the pull failed: the handle is still pinned
                await self._release(kv)

    async def _release(self, kv) -> None:
        try:
            await remote(self.prefill.release, kv)
        except Exception as e:  # noqa: BLE001  the request's own error matters more
            log.warning("could not release %r on the prefill deployment (%s); it expires "
                        "after engine.kv_handle_ttl_s", kv, e)


async def remote(method, *args):
    """A call to another deployment; its refusal (ServeError, EngineError) as itself, its
    replica gone as 503 (`remote_cause`)."""
    try:
        return await method.remote(*args)
    except ray.exceptions.RayError as e:
        raise remote_cause(e) from None


def remote_cause(e: ray.exceptions.RayError) -> BaseException:
    """What the HTTP layer maps to a status code: the engine's own refusal as itself, and a
    replica that died or is restarting as 503, which a client retries."""
    if not isinstance(e, ray.exceptions.RayTaskError):
        return ServeError(503, f"a deployment is unavailable ({type(e).__name__}); retry "
                          f"shortly", "service_unavailable")
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, (ServeError, EngineError)) else e
