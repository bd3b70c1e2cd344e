"""The same HTTP API as Ray Serve deployments: one deployment per engine replica group, each
owning an `LLM` (whose rank actors, at tp > 1, sit in their own placement group), behind one
ingress deployment running app.py's routes. The ingress routes each request by prefix affinity:
to the engine that last served the longest prefix of its prompt (its prefix cache likely holds
those blocks); a prompt no engine has seen goes to the one with the fewest requests in flight,
taking turns among equals.

With serve.disaggregated, one engine deployment prefills (`prefill_export`) and another, given
its handle, decodes: the ingress routes to the decode deployment, which has each prompt
prefilled there and streams the rest from the KVHandle (disaggregated.py)."""
from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from typing import AsyncIterator

import ray
from omegaconf import DictConfig
from ray import serve

from launcher.build_engine import CONF_DIR, engine_settings
from launcher.serve.disaggregated import remote_cause
from launcher.serve.engine_handler import REPLICA_STATS
from launcher.serve.protocol import ChatRequest, CompletionRequest

log = logging.getLogger("serve")
PREFIX_CHARS = 64  # the ingress hashes prompts in blocks of this many characters
REMEMBERED_PREFIXES = 100_000  # per ingress, least recently used forgotten first


@serve.deployment(max_ongoing_requests=1024)
class EngineDeployment:
    """One engine replica group: an `LLM` and the OpenAI handler over it. Given `prefill` (the
    prefill deployment's handle) it is a decode deployment: prompts are prefilled there."""

    def __init__(self, model: str, settings: dict, model_name: str, restart_on_failure: bool,
                 prefill=None):
        from engine import LLM
        from launcher.serve.disaggregated import RemotePrefill
        from launcher.serve.engine_handler import EngineHandler

        self.llm = LLM(model, **settings)
        tokens = None if prefill is None else RemotePrefill(prefill, self.llm)
        self.handler = EngineHandler(self.llm, model_name, restart_on_failure, tokens)

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

    async def prefill_export(self, prompt_ids: list[int], params) -> tuple[int, object, int]:
        return await self.handler.prefill_export(prompt_ids, params)

    async def release(self, kv) -> None:
        await asyncio.to_thread(self.handler.release, kv)

    def __del__(self):
        self.llm.shutdown()


class PrefixRouter:
    """EngineHandler's methods, each request sent to one engine deployment by prefix affinity;
    `stats` of every deployment in `stats_from` (default: the engines), in that order."""

    def __init__(self, engines: list, model_name: str, stats_from: list | None = None):
        self.engines, self.model_name = engines, model_name
        self.stats_from = stats_from or engines
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
        for i, engine in enumerate(self.stats_from):
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
        except ray.exceptions.RayError as e:  # the engine's refusal, or its replica gone
            raise remote_cause(e) from None
        finally:
            self.in_flight[i] -= 1

    async def _stream(self, method: str, req, text: str) -> AsyncIterator[dict]:
        i = self.pick(text)
        self.in_flight[i] += 1
        chunks = None
        try:  # the handle's call inside: one that raises at once must not keep its count
            chunks = getattr(self.engines[i].options(stream=True), method).remote(req)
            async for chunk in chunks:
                yield chunk
        except ray.exceptions.RayError as e:  # the engine's refusal, or its replica gone
            raise remote_cause(e) from None
        finally:
            if chunks is not None:  # a client gone: the engine's request is cancelled
                chunks.cancel()
            self.in_flight[i] -= 1


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
    def __init__(self, engines: list, model_name: str, api_key: str | None, max_queued: int,
                 stats_from: list | None = None):
        self.router = PrefixRouter(engines, model_name, stats_from)
        self.api_key, self.max_queued = api_key, max_queued

    def __serve_build_asgi_app__(self):
        from launcher.serve.app import build_app

        return build_app(self.router, self.api_key, self.max_queued)


def build_ray_app(model: str, settings: dict, serve_cfg: DictConfig | dict):
    """The Serve application: `serve_cfg["replicas"]` engine deployments behind the ingress, or
    with `serve_cfg["disaggregated"]` a prefill and a decode deployment (tp: `prefill_tp` and
    `decode_tp`, else `settings["tp"]`)."""
    name = serve_cfg["model_name"] or model
    settings = {k: v for k, v in settings.items() if k != "ray_address"}  # the cluster's own

    def engine(deployment: str, tp: int | None, prefill=None):
        return (EngineDeployment.options(name=deployment, num_replicas=1, ray_actor_options={
                    "num_cpus": serve_cfg["replica_cpus"]})
                .bind(model, {**settings, "tp": tp or settings.get("tp", 1)}, name,
                      serve_cfg["restart_on_failure"], prefill))
    if serve_cfg["disaggregated"]:
        prefill = engine("prefill", serve_cfg["prefill_tp"])
        engines, stats_from = [engine("decode", serve_cfg["decode_tp"], prefill)], [prefill]
    else:
        engines, stats_from = [engine(f"engine_{i}", None) for i in range(serve_cfg["replicas"])], []
    return Ingress.bind(engines, name, serve_cfg["api_key"], serve_cfg["max_queued"],
                        stats_from + engines)


def app_builder(args: dict):
    """`serve run launcher/serve/serve.yaml` (or `serve deploy` it): the app of `python -m
    launcher.serve serve.ray=true`, configured by conf/serve.yaml and `args["overrides"]`, a
    list of the same Hydra overrides (`parallel.tp=2`, `serve.disaggregated=true`, ...)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("serve", overrides=list(args.get("overrides", [])))
    return build_ray_app(cfg.model.path, engine_settings(cfg), cfg.serve)


def serve_on_ray(cfg: DictConfig, settings: dict) -> None:
    """Start the app on the cluster (parallel.ray_address, $RAY_ADDRESS or a local one) and
    keep it up until Ctrl-C, which deletes it."""
    import time

    ray.init(address=cfg.parallel.ray_address, ignore_reinit_error=True)
    serve.start(http_options={"host": cfg.serve.host, "port": cfg.serve.port})
    serve.run(build_ray_app(cfg.model.path, settings, cfg.serve), name="prefill",
              route_prefix="/")
    print(f"serving {cfg.serve.model_name or cfg.model.path} on Ray Serve at "
          f"http://{cfg.serve.host}:{cfg.serve.port}/v1", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.delete("prefill")
