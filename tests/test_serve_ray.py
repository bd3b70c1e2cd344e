"""launcher.serve on Ray Serve: two engine deployments behind the ingress, and a disaggregated
prefill + decode pair, on the session's shared Ray cluster, both built from the import path and
args of launcher/serve/serve.yaml (checked against Ray's own schema), driven by the official
`openai` client; the reference is `LLM.generate`."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from engine import SamplingParams
from launcher.serve.app import build_app
from launcher.serve.ray_app import PrefixRouter
from tests import subproc
from tests.serve_util import LOCAL, metric_samples, running, wait_until

PROMPT = "The capital of France is"
SERVE_YAML = Path(__file__).resolve().parents[1] / "launcher" / "serve" / "serve.yaml"
TEST_OVERRIDES = ["serve.replica_cpus=0.5", "serve.max_queued=64"]
AGENT_WAIT_S = 60  # how long a fresh head's job agent may take to take jobs


def yaml_app(*overrides: str):
    """The application launcher/serve/serve.yaml describes, as `serve run` builds it: validated
    by Ray's schema, its import path imported and called with its args, plus `overrides`."""
    import importlib

    from ray.serve.schema import ServeDeploySchema

    [spec] = ServeDeploySchema.model_validate(yaml.safe_load(SERVE_YAML.read_text())).applications
    args = {"overrides": spec.args["overrides"] + TEST_OVERRIDES + list(overrides)}
    module, builder = spec.import_path.split(":")
    return getattr(importlib.import_module(module), builder)(args), spec


@pytest.fixture(scope="module")
def serve_port(ray_cluster):
    from ray import serve

    [port] = subproc.free_ports(1)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield port
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def ray_serve_url(serve_port):
    from ray import serve

    app, spec = yaml_app()
    serve.run(app, name=spec.name, route_prefix=spec.route_prefix)
    return f"http://127.0.0.1:{serve_port}"


@pytest.fixture(scope="module")
def disagg_url(serve_port):
    """serve.disaggregated: a prefill and a decode deployment, tp=1 each, under /disagg."""
    from ray import serve

    app, _ = yaml_app("serve.disaggregated=true")
    serve.run(app, name="disaggregated", route_prefix="/disagg")
    return f"http://127.0.0.1:{serve_port}/disagg"


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _blocks_back(url: str) -> bool:
    """Every engine's KV blocks free and no request in it, as /metrics says."""
    m = metric_samples(url)
    return all(v == 0 for k, v in m.items() if k.startswith(("prefill:kv_blocks_used",
               "vllm:num_requests_running", "vllm:num_requests_waiting")))


def _long_stream(url: str):
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 2000, "stream": True,
            "ignore_eos": True, "temperature": 0}
    return httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60)


def _disconnect_mid_stream(url: str) -> None:
    """Read three events of a 2,000-token stream, check it holds blocks, hang up, and see every
    block come back much sooner than 2,000 tokens would take."""
    with _long_stream(url) as r:
        events = (line for line in r.iter_lines() if line)  # SSE: a blank line after each
        for _ in range(3):
            assert next(events).startswith("data: ")
        used = sum(v for k, v in metric_samples(url).items()
                   if k.startswith("prefill:kv_blocks_used"))
        assert used > 0
    wait_until(lambda: _blocks_back(url), timeout=20, what="the stream's blocks back to 0")


def test_two_replicas_serve_the_same_tokens(ray_serve_url, smollm2_llm):
    client = _client(ray_serve_url)
    prompts = [PROMPT, "x" * 70 + " and then", "y" * 70 + " and so"]  # prefixes of 64+ chars
    want = [g.text for g in smollm2_llm.generate(prompts, SamplingParams(max_tokens=4))]
    got = [client.completions.create(model="smollm2", prompt=p, max_tokens=4,
                                     temperature=0).choices[0].text for p in prompts]
    assert got == want
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=4, temperature=0, stream=True) if c.choices)
    assert streamed == want[0]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="smollm2", prompt=PROMPT, temperature=-1.0)
    with pytest.raises(openai.BadRequestError, match="max_tokens=0"):  # refused by the server
        client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=0)
    # both engines served (new prompts take turns among idle engines), and each one's blocks
    # came back
    m = metric_samples(ray_serve_url)
    for engine in ("0", "1"):
        assert m[f"prefill:engine_up{{engine={engine},model_name=smollm2}}"] == 1
        assert m[f"vllm:prefix_cache_queries_total{{engine={engine},model_name=smollm2}}"] > 0
    wait_until(lambda: all(v == 0 for k, v in metric_samples(ray_serve_url).items()
                           if k.startswith("prefill:kv_blocks_used")), what="blocks back to 0")
    assert m["vllm:prompt_tokens_total{model_name=smollm2}"] == 2 * sum(
        len(smollm2_llm.tokenize(p)) for p in prompts[:1]) + sum(
        len(smollm2_llm.tokenize(p)) for p in prompts[1:])


def test_a_client_gone_mid_stream_frees_its_blocks_on_ray(ray_serve_url):
    _disconnect_mid_stream(ray_serve_url)


def test_disaggregated_serves_generate_s_tokens_and_frees_both_engines(disagg_url, smollm2_llm):
    """The first token from the prefill deployment, the rest decoded from its KVHandle by the
    decode deployment: the text, tokens one chunk each, finish reason and usage of `generate`;
    /metrics counts them, shows both engines, and every block (the exported ones too) comes
    back; a client gone mid-stream frees both engines' blocks."""
    client = _client(disagg_url)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    [want] = smollm2_llm.generate([PROMPT], params)
    r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), 5)
    chunks = list(client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True}))
    pieces = [c.choices[0].text for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert len(pieces) == 5 and "".join(pieces) == want.text
    assert chunks[-1].usage.completion_tokens == 5
    # the prompt again: its whole blocks come from the prefill engine's prefix cache
    block = smollm2_llm.config.block_size
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (
        (len(want.prompt_token_ids) - 1) // block * block)
    m = metric_samples(disagg_url)
    assert m["vllm:time_to_first_token_seconds_count{model_name=smollm2}"] == 2
    assert m["vllm:generation_tokens_total{model_name=smollm2}"] == 10
    for engine in ("0", "1"):  # 0: prefill, 1: decode
        assert m[f"prefill:engine_up{{engine={engine},model_name=smollm2}}"] == 1
    assert m["vllm:prefix_cache_queries_total{engine=0,model_name=smollm2}"] == 2 * len(
        want.prompt_token_ids)
    wait_until(lambda: _blocks_back(disagg_url), what="both engines' blocks back to 0")
    _disconnect_mid_stream(disagg_url)


def test_prefix_router_sends_a_shared_prefix_to_the_engine_that_has_it():
    router = PrefixRouter([object(), object()], "m")
    doc = "a shared system prompt that is long enough for two blocks of text " * 3
    first = router.pick(doc + "question one")
    router.in_flight[first] += 5  # even when busier, the engine holding the prefix wins
    assert router.pick(doc + "question two") == first
    assert router.pick("unrelated " * 20) != first  # a miss goes to the least loaded
    router.in_flight[first] -= 5
    assert {router.pick(f"{i} new prompt " * 10) for i in range(4)} == {0, 1}  # taking turns


def test_a_stream_whose_engine_call_fails_at_once_leaves_no_load_counted():
    """The router picks the least loaded engine by its count of requests in flight; a stream
    whose call to the engine's handle raised before it existed must not stay counted, or
    that engine looks busy for good."""
    import asyncio

    from launcher.serve.protocol import CompletionRequest

    router = PrefixRouter([object()], "m")  # a handle without .options: the call raises
    stream = router.completion_chunks(CompletionRequest(prompt="hello", stream=True))
    with pytest.raises(AttributeError):
        asyncio.run(stream.__anext__())
    assert router.in_flight == [0]


def test_a_stream_the_router_refuses_at_once_gives_back_its_place_in_the_queue():
    """The router reads a prompt's text before it streams (to pick an engine), so a bad one
    fails there, when the stream is asked for: that request's place in the server's queue
    (serve.max_queued) must come back, or a few bad requests turn the server into 429s."""
    with running(build_app(PrefixRouter([object()], "m"), max_queued=1)) as url:
        bad = [("chat/completions", {"messages": [{"role": "user"}]}),
               ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "x"}]}]}),
               ("completions", {"prompt": []})]
        for route, body in bad * 2:
            r = httpx.post(f"{url}/v1/{route}", json={**body, "stream": True}, timeout=30)
            assert r.status_code == 400, r.text


def _replica_pid(app: str, deployment: str) -> int:
    """The replica's process, by the title Ray gives an actor's worker (`ray::<class>...`)."""
    import psutil

    title = f"ray::ServeReplica:{app}:{deployment}"
    [pid] = [p.pid for p in psutil.process_iter(["cmdline"])
             if p.info["cmdline"] and p.info["cmdline"][0].startswith(title)]
    return pid


def test_a_dropped_replica_gives_503_then_serves_again(serve_port):
    """An engine deployment's replica killed with a request in it: the client gets 503 with
    Retry-After (a retry is what helps; it was a 500 'internal error'), and once Serve has
    started the replica again the same request is served."""
    from ray import serve

    app, _ = yaml_app("serve.replicas=1")
    serve.run(app, name="dropped", route_prefix="/dropped")
    url = f"http://127.0.0.1:{serve_port}/dropped"
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True}
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=120)
            wait_until(lambda: metric_samples(url).get(
                "vllm:num_requests_running{engine=0,model_name=smollm2}", 0) == 1,
                what="the request running in the replica")
            os.kill(_replica_pid("dropped", "engine_0"), signal.SIGKILL)
            r = pending.result()
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert "unavailable" in r.json()["error"]["message"]
        wait_until(lambda: LOCAL.get(f"{url}/health").status_code == 200,
                   timeout=180, what="Serve to start the replica again")
        again = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 2}, timeout=120)
        assert again.status_code == 200, again.text
    finally:
        serve.delete("dropped")


def test_a_killed_rank_gives_503_health_down_then_a_restart(ray_cluster):
    """A tp=2 engine loses a rank: the request in its way gets 503, /health says 503 while the
    rank groups restart, then the server serves again and /metrics counts both events."""
    from engine import LLM
    from launcher.serve.app import build_app
    from launcher.serve.engine_handler import EngineHandler
    from tests.serve_util import running

    with LLM("smollm2", tp=2, step_timeout_s=20) as llm, \
            running(build_app(EngineHandler(llm, "smollm2"))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        want = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=3,
                                         temperature=0).choices[0].text
        os.kill(llm.rank_pids()[0][1], signal.SIGKILL)
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=3)
        assert e.value.status_code == 503 and "rank" in e.value.message
        seen = []
        wait_until(lambda: seen.append(LOCAL.get(f"{url}/health").status_code) or seen[-1] == 200,
                   timeout=180, what="the restart")
        assert seen[0] == 503
        got = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=3,
                                        temperature=0).choices[0].text
        assert got == want
        m = metric_samples(url)
        assert m["prefill:rank_failures_total{engine=0,model_name=smollm2}"] == 1
        assert m["prefill:engine_restarts_total{engine=0,model_name=smollm2}"] == 1


def _submit_when_the_agent_is_up(cmd: list[str], env: dict) -> subproc.Result:
    """`ray job submit`, again while a fresh head's job agent is still coming up: for its first
    seconds the head answers "No available agent to submit job, please try again later" (seen
    once in a full run of the suite on 2 busy cores)."""
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        submit = subproc.run(cmd, timeout=180, env=env)
        if (submit.returncode == 0 or "No available agent" not in submit.stdout + submit.stderr
                or time.monotonic() > deadline):
            return submit
        time.sleep(2)


def test_ray_job_submit_serves_on_the_cluster():
    """The README's `ray job submit ... -- python -m launcher.serve serve.ray=true ...` on a
    `ray start` head: the job deploys the app, which answers on the head's 127.0.0.1."""
    import json
    import uuid

    from tests.test_launch import ray_head

    [port] = subproc.free_ports(1)
    ray_cli, job = str(subproc.BIN / "ray"), f"serve-test-{uuid.uuid4().hex[:8]}"
    with ray_head(dashboard=True) as head:
        submit = _submit_when_the_agent_is_up(
            [ray_cli, "job", "submit", "--no-wait", "--address", head.dashboard_url,
             "--submission-id", job, "--working-dir", ".", "--runtime-env-json",
             json.dumps({"excludes": [".venv", ".git", ".pytest_cache"]}), "--",
             "python", "-m", "launcher.serve", "serve.ray=true", "serve.replicas=1",
             "serve.replica_cpus=0.5", f"serve.port={port}"], head.env)
        assert submit.returncode == 0, submit.explain()
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            try:
                return LOCAL.get(f"{url}/health").status_code == 200
            except httpx.TransportError:
                return False
        try:
            wait_until(healthy, timeout=300, what="the job's Serve app")
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2,
                                          temperature=0)
            assert r.choices[0].text.startswith(" Paris")
        finally:
            subproc.run([ray_cli, "job", "stop", "--address", head.dashboard_url, job],
                        timeout=120, env=head.env)
