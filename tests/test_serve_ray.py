"""launcher.serve on Ray Serve: two engine deployments behind the ingress, on the session's
shared Ray cluster, driven by the official `openai` client; the reference is `LLM.generate`."""
from __future__ import annotations

import os
import signal

import httpx
import openai
import pytest

from engine import SamplingParams
from launcher.serve.ray_app import PrefixRouter, build_ray_app
from tests import subproc
from tests.serve_util import metric_samples, wait_until

PROMPT = "The capital of France is"
SERVE_CFG = {"model_name": None, "replicas": 2, "replica_cpus": 0.5, "restart_on_failure": True,
             "api_key": None, "max_queued": 64}


@pytest.fixture(scope="module")
def ray_serve_url(ray_cluster):
    from ray import serve

    [port] = subproc.free_ports(1)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_ray_app("smollm2", {"tp": 1}, SERVE_CFG), name="prefill-test",
                  route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


def test_two_replicas_serve_the_same_tokens(ray_serve_url, smollm2_llm):
    client = openai.OpenAI(base_url=f"{ray_serve_url}/v1", api_key="none", max_retries=0,
                           timeout=120)
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


def test_prefix_router_sends_a_shared_prefix_to_the_engine_that_has_it():
    router = PrefixRouter([object(), object()], "m")
    doc = "a shared system prompt that is long enough for two blocks of text " * 3
    first = router.pick(doc + "question one")
    router.in_flight[first] += 5  # even when busier, the engine holding the prefix wins
    assert router.pick(doc + "question two") == first
    assert router.pick("unrelated " * 20) != first  # a miss goes to the least loaded
    router.in_flight[first] -= 5
    assert {router.pick(f"{i} new prompt " * 10) for i in range(4)} == {0, 1}  # taking turns


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
        wait_until(lambda: seen.append(httpx.get(f"{url}/health").status_code) or seen[-1] == 200,
                   timeout=180, what="the restart")
        assert seen[0] == 503
        got = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=3,
                                        temperature=0).choices[0].text
        assert got == want
        m = metric_samples(url)
        assert m["prefill:rank_failures_total{engine=0,model_name=smollm2}"] == 1
        assert m["prefill:engine_restarts_total{engine=0,model_name=smollm2}"] == 1


def test_ray_job_submit_serves_on_the_cluster():
    """The README's `ray job submit ... -- python -m launcher.serve serve.ray=true ...` on a
    `ray start` head: the job deploys the app, which answers on the head's 127.0.0.1."""
    import json
    import uuid

    from tests.test_launch import ray_head

    [port] = subproc.free_ports(1)
    ray_cli, job = str(subproc.BIN / "ray"), f"serve-test-{uuid.uuid4().hex[:8]}"
    with ray_head(dashboard=True) as head:
        submit = subproc.run(
            [ray_cli, "job", "submit", "--no-wait", "--address", head.dashboard_url,
             "--submission-id", job, "--working-dir", ".", "--runtime-env-json",
             json.dumps({"excludes": [".venv", ".git", ".pytest_cache"]}), "--",
             "python", "-m", "launcher.serve", "serve.ray=true", "serve.replicas=1",
             "serve.replica_cpus=0.5", f"serve.port={port}"], timeout=180, env=head.env)
        assert submit.returncode == 0, submit.explain()
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            try:
                return httpx.get(f"{url}/health").status_code == 200
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
