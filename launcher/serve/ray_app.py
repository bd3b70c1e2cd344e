"""The same HTTP API as Ray Serve deployments: one deployment per engine replica group, each
owning an `LLM` (whose rank actors, at tp > 1, sit in their own placement group), behind one
ingress deployment running app.py's routes. The ingress routes each request by prefix affinity:
to the engine that last served the longest prefix of its prompt (its prefix cache likely holds
those blocks); a prompt no engine has seen goes to the one with the fewest requests in flight,
taking turns among equals."""
from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from typing import AsyncIterator

import ray
from omegaconf import DictConfig
from ray import serve

from engine import EngineError
from launcher.serve.engine_handler import REPLICA_STATS
from launcher.serve.protocol import ChatRequest, CompletionRequest, ServeError

log = logging.getLogger("serve")
PREFIX_CHARS = 64  # the ingress hashes prompts in blocks of this many characters
REMEMBERED_PREFIXES = 100_000  # per ingress, least recently used forgotten first


@serve.deployment(max_ongoing_requests=1024)
class EngineDeployment:
    """One engine replica group: an `LLM` and the OpenAI handler over it."""

    def __init__(self, model: str, settings: dict, model_name: str, restart_on_failure: bool):
        from engine import LLM
        from launcher.serve.engine_handler import EngineHandler

        self.llm = LLM(model, **settings)
        self.handler = EngineHandler(self.llm, model_name, restart_on_failure)

    async def completion(self, req: CompletionRequest) -> dict:
        return await self.handler.completion(req)

    async def completion_chunks(self, req: CompletionRequest) -> AsyncIterator[dict]:
        async for chunk in self.handler.completion_chunks(req):
            yield chunk

    async def chat(self, req: ChatRequest) -> dict:
        return await self.handler.chat(req)

    async def chat_chunks(self, req: ChatRequest) -> AsyncIterator[dict]:
        async for chunk in self.handler.chat_chunks(req):
            yield chunk

    async def stats(self) -> list[dict]:
        return await self.handler.stats()

    def __del__(self):
        self.llm.shutdown()


class PrefixRouter:
    """EngineHandler's methods, each request sent to one engine deployment by prefix affinity."""

    def __init__(self, engines: list, model_name: str):
        self.engines, self.model_name = engines, model_name
        self.in_flight = [0] * len(engines)
        self.last_miss = -1
        self.owner: OrderedDict[bytes, int] = OrderedDict()  # prefix-block hash -> engine

    def pick(self, text: str) -> int:
        hashes = _block_hashes(text)
        best = None
        for h in hashes:  # the deepest block known wins
            if h in self.owner:
                best = self.owner[h]
        if best is None:  # the least loaded; among equals, the next after the last so chosen
            n = len(self.engines)
            order = [(self.last_miss + 1 + k) % n for k in range(n)]
            best = self.last_miss = min(order, key=self.in_flight.__getitem__)
        for h in hashes:  # the whole prompt now lives in that engine's cache
            self.owner[h] = best
            self.owner.move_to_end(h)
        while len(self.owner) > REMEMBERED_PREFIXES:
            self.owner.popitem(last=False)
        return best

    async def completion(self, req: CompletionRequest) -> dict:
        return await self._call("completion", req, _prompt_text(req))

    def completion_chunks(self, req: CompletionRequest) -> AsyncIterator[dict]:
        return self._stream("completion_chunks", req, _prompt_text(req))

    async def chat(self, req: ChatRequest) -> dict:
        return await self._call("chat", req, _chat_text(req))

    def chat_chunks(self, req: ChatRequest) -> AsyncIterator[dict]:
        return self._stream("chat_chunks", req, _chat_text(req))

    async def stats(self) -> list[dict]:
        out = []
        for i, engine in enumerate(self.engines):
            try:
                out += await engine.stats.remote()
            except Exception as e:  # noqa: BLE001  an engine deployment down or restarting
                log.warning("engine %d gave no stats: %s", i, e)
                out.append({**dict.fromkeys(REPLICA_STATS, 0), "up": 0, "rank_failures": 0,
                            "restarts": 0})
        return out

    async def _call(self, method: str, req, text: str) -> dict:
        i = self.pick(text)
        self.in_flight[i] += 1
        try:
            return await getattr(self.engines[i], method).remote(req)
        except ray.exceptions.RayTaskError as e:
            raise _cause(e) from None
        finally:
            self.in_flight[i] -= 1

    async def _stream(self, method: str, req, text: str) -> AsyncIterator[dict]:
        i = self.pick(text)
        self.in_flight[i] += 1
        chunks = getattr(self.engines[i].options(stream=True), method).remote(req)
        try:
            async for chunk in chunks:
                yield chunk
        except ray.exceptions.RayTaskError as e:
            raise _cause(e) from None
        finally:
            chunks.cancel()  # a client gone: the engine's request is cancelled, blocks freed
            self.in_flight[i] -= 1


def _cause(e: ray.exceptions.RayTaskError) -> BaseException:
    """The engine's own refusal, for the HTTP layer to map to its status code."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, (ServeError, EngineError)) else e


def _block_hashes(text: str) -> list[bytes]:
    """Chained hashes of the text's whole PREFIX_CHARS blocks: equal hashes, equal prefixes."""
    out, h = [], b""
    for start in range(0, len(text) - PREFIX_CHARS + 1, PREFIX_CHARS):
        h = hashlib.blake2b(h + text[start:start + PREFIX_CHARS].encode("utf-8", "replace"),
                            digest_size=16).digest()
        out.append(h)
    return out


def _prompt_text(req: CompletionRequest) -> str:
    first = req.prompts()[0]
    return first if isinstance(first, str) else " ".join(map(str, first))


def _chat_text(req: ChatRequest) -> str:
    return "\n".join(f"{m.role}: {m.text()}" for m in req.messages)


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    def __init__(self, engines: list, model_name: str, api_key: str | None, max_queued: int):
        self.router = PrefixRouter(engines, model_name)
        self.api_key, self.max_queued = api_key, max_queued

    def __serve_build_asgi_app__(self):
        from launcher.serve.app import build_app

        return build_app(self.router, self.api_key, self.max_queued)


def build_ray_app(model: str, settings: dict, serve_cfg: DictConfig | dict):
    """The Serve application: `serve_cfg["replicas"]` engine deployments behind the ingress."""
    name = serve_cfg["model_name"] or model
    engines = [EngineDeployment.options(name=f"engine_{i}", num_replicas=1,
                                        ray_actor_options={"num_cpus": serve_cfg["replica_cpus"]})
               .bind(model, settings, name, serve_cfg["restart_on_failure"])
               for i in range(serve_cfg["replicas"])]
    return Ingress.bind(engines, name, serve_cfg["api_key"], serve_cfg["max_queued"])


def serve_on_ray(cfg: DictConfig, settings: dict) -> None:
    """Start the app on the cluster (parallel.ray_address, $RAY_ADDRESS or a local one) and
    keep it up until Ctrl-C, which deletes it."""
    import time

    ray.init(address=cfg.parallel.ray_address, ignore_reinit_error=True)
    serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
    settings = {k: v for k, v in settings.items() if k != "ray_address"}
    serve.run(build_ray_app(cfg.model.path, settings, cfg.serve), name="prefill",
              route_prefix="/")
    print(f"serving {cfg.serve.model_name or cfg.model.path} on Ray Serve at "
          f"http://{cfg.serve.host}:{cfg.serve.port}/v1", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.delete("prefill")
