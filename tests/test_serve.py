"""The OpenAI-compatible server (launcher.serve) driven by the official `openai` client over
real HTTP on a free 127.0.0.1 port. The references are the engine's own public calls on the
same model: `LLM.generate` for tokens and text, `LLM.score` for log-probabilities, the engine's
InvalidRequestError for the 400 message; counts of tokens come from `LLM.tokenize`."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import re
import sys
from pathlib import Path

import httpx
import openai
import pytest

from engine import InvalidRequestError, SamplingParams
from launcher.serve.app import build_app
from launcher.serve.engine_handler import EngineHandler
from tests import subproc
from tests.serve_util import metric_samples, running, wait_until

PROMPT = "The capital of France is"
KEY = "test-key"
README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def llm(smollm2_llm):
    return smollm2_llm


@pytest.fixture(scope="module")
def url(llm):
    with running(build_app(EngineHandler(llm, "smollm2"), api_key=KEY, max_queued=8)) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _generate(llm, prompt, **params):
    return llm.generate([prompt], SamplingParams(**params))[0]


def test_stream_with_output_ends_with_generate_s_output_and_counts_requests(llm):
    """LLM.stream_with_output: the token ids, then the GenerateOutput that generate() gives;
    cache_stats counts the request as running while it streams, and closing frees it."""
    import asyncio

    params = SamplingParams(max_tokens=4, ignore_eos=True)
    [want] = llm.generate([PROMPT], params)

    async def main():
        items = [x async for x in llm.stream_with_output(PROMPT, params)]
        stream = llm.stream_with_output(PROMPT, SamplingParams(max_tokens=500, ignore_eos=True))
        await anext(stream)
        running_now = await asyncio.to_thread(llm.cache_stats)
        await stream.aclose()
        return items, running_now

    items, running_now = asyncio.run(main())
    *tokens, out = items
    assert tokens == want.token_ids and out.token_ids == want.token_ids
    assert out.finish_reason == "length" and out.text == want.text
    assert running_now["requests_running"] + running_now["requests_waiting"] == 1
    wait_until(lambda: _engine_idle(llm), what="the closed stream's request to end")


def test_decode_stream_gives_decode_s_tokens_and_a_cancel_frees_both_sides(llm, ray_cluster):
    """LLM.decode_stream of a handle: generate()'s tokens one by one, then its output; closed
    early, or cancelled while the K/V are pulled, the request ends and every block (the
    exported ones included) comes back."""
    import asyncio

    params = SamplingParams(max_tokens=4, ignore_eos=True)
    [want] = llm.generate([PROMPT], params)
    endless = SamplingParams(max_tokens=2000, ignore_eos=True)

    async def main():
        [p] = llm.prefill([PROMPT], params, export_kv=True)
        items = [x async for x in llm.decode_stream(p.kv, params)]
        [p] = llm.prefill([PROMPT], endless, export_kv=True)
        stream = llm.decode_stream(p.kv, endless)
        head = [await anext(stream), await anext(stream)]
        await stream.aclose()
        [p] = llm.prefill([PROMPT], endless, export_kv=True)
        pulling = asyncio.ensure_future(anext(llm.decode_stream(p.kv, endless)))
        await asyncio.sleep(0.01)  # the pull has started on its thread
        pulling.cancel()
        return items, head

    items, head = asyncio.run(main())
    *tokens, out = items
    assert tokens == want.token_ids and out.token_ids == want.token_ids
    assert out.finish_reason == "length" and out.text == want.text
    assert head == want.token_ids[:2]
    # 2,000 tokens would take far longer: both cancelled requests ended, their blocks freed
    wait_until(lambda: _engine_idle(llm) and llm.cache_stats()["kv_handles_pinned"] == 0,
               timeout=15, what="the cancelled decodes to end")


def test_completion_and_chat_equal_generate(llm, client):
    want = _generate(llm, PROMPT, max_tokens=4, temperature=0.0)
    r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(llm.tokenize(PROMPT))
    assert r.usage.completion_tokens == len(want.token_ids)
    # token ids as the prompt give the same
    ids = llm.tokenize(PROMPT)
    r = client.completions.create(model="smollm2", prompt=ids, max_tokens=4, temperature=0)
    assert r.choices[0].text == want.text

    question = [{"role": "user", "content": "What is the capital of France?"}]
    templated = llm.tokenizer.apply_chat_template(question)
    want = _generate(llm, templated, max_tokens=8, temperature=0.0)
    r = client.chat.completions.create(model="smollm2", messages=question, max_tokens=8,
                                       temperature=0)
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(llm.tokenize(templated))
    assert "Paris" in want.text
    assert [m.id for m in client.models.list().data] == ["smollm2"]


def test_stream_gives_generate_tokens_one_chunk_each(llm, client, url):
    want = _generate(llm, PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True)
    chunks = list(client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert len(texts) == len(want.token_ids) and "".join(texts) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices

    # the raw SSE: chat chunks, ending with [DONE]
    body = {"model": "smollm2", "max_tokens": 4, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        events = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def _score_reference(llm, ids: list[int]) -> list[float]:
    [s] = llm.score([ids])
    return s.logprobs


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_equal_score(llm, client, max_tokens):
    r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=max_tokens,
                                  echo=True, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    ids = llm.tokenize(PROMPT)
    want = _score_reference(llm, ids)
    n = len(ids)
    assert lp.token_logprobs[0] is None and len(lp.tokens) == n + max_tokens
    assert all(abs(a - b) <= 1e-5 for a, b in zip(lp.token_logprobs[1:n], want)), \
        (lp.token_logprobs[1:n], want)
    [top] = llm.score([ids], top_logprobs=1)
    for i, ((best, best_lp),) in enumerate(top.top_logprobs):  # the likeliest is listed
        assert abs(lp.top_logprobs[i + 1][llm.tokenizer.piece(best)] - best_lp) <= 1e-5
    assert r.choices[0].text.startswith(PROMPT)
    if max_tokens:  # the generated token's log-probability too: greedy, so the likeliest
        greedy = _generate(llm, PROMPT, max_tokens=1)
        full = _score_reference(llm, ids + greedy.token_ids)
        assert abs(lp.token_logprobs[-1] - full[-1]) <= 1e-5
        assert lp.tokens[-1] == llm.tokenizer.piece(greedy.token_ids[0])


def test_multiple_choice_loglikelihoods_as_an_eval_harness_asks_them(llm, client):
    """lm-eval's local-completions: context + continuation as token ids, echo, logprobs=1,
    max_tokens=0; the continuation's summed log-probability, and whether it is greedy."""
    items = [("The capital of France is", [" Paris", " London", " a cat"]),
             ("Two plus two equals", [" four", " five"])]
    for context, endings in items:
        ctx = llm.tokenize(context)
        for ending in endings:
            cont = llm.tokenizer.backend.encode(ending).ids
            r = client.completions.create(model="smollm2", prompt=ctx + cont, max_tokens=0,
                                          echo=True, logprobs=1, temperature=0)
            lp = r.choices[0].logprobs
            got = sum(lp.token_logprobs[len(ctx):])
            [ref] = llm.score([ctx + cont], top_logprobs=1)
            want = sum(ref.logprobs[len(ctx) - 1:])
            assert abs(got - want) <= 1e-4, (context, ending, got, want)
            greedy = all(max(t, key=t.get) == tok for t, tok in
                         zip(lp.top_logprobs[len(ctx):], lp.tokens[len(ctx):]))
            want_greedy = all(top[0][0] == t for top, t in
                              zip(ref.top_logprobs[len(ctx) - 1:], cont))
            assert greedy == want_greedy
    # the harness's answer to the first item is the engine's
    sums = [sum(llm.score([llm.tokenize(items[0][0]) + llm.tokenizer.backend.encode(e).ids])[0]
                .logprobs[len(llm.tokenize(items[0][0])) - 1:]) for e in items[0][1]]
    assert max(range(3), key=sums.__getitem__) == 0  # Paris


def test_n_choices_and_stop_strings(llm, client):
    r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4, n=2,
                                  temperature=0.9, seed=11)
    assert [c.index for c in r.choices] == [0, 1]
    want = [_generate(llm, PROMPT, max_tokens=4, temperature=0.9, seed=11 + i) for i in (0, 1)]
    assert [c.text for c in r.choices] == [w.text for w in want]  # choice i draws with seed + i
    assert r.usage.completion_tokens == sum(len(w.token_ids) for w in want)

    full = _generate(llm, PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True).text
    stop = full[len(full) // 3: len(full) // 3 + 3]  # three characters from the middle
    cut = full[:full.index(stop)]
    r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0,
                                  stop=[stop, "zzzz"], extra_body={"ignore_eos": True})
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}) if c.choices]
    assert "".join(pieces) == cut and stop not in "".join(pieces)


def test_bad_requests_get_400_with_the_engine_message_and_never_500(llm, client, url):
    with pytest.raises(InvalidRequestError) as engine_says:
        SamplingParams(temperature=-1.0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt=PROMPT, temperature=-1.0)
    assert e.value.status_code == 400 and str(engine_says.value) in e.value.message
    with pytest.raises(InvalidRequestError) as engine_says:
        llm.tokenize([1, 10**7])
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model="smollm2", prompt=[1, 10**7])
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        client.completions.create(model="gpt-4", prompt=PROMPT)

    headers = {"Authorization": f"Bearer {KEY}"}
    hostile = [b"not json", b"[]", b"null", b'{"prompt": null}', b'{"prompt": ""}',
               b'{"prompt": []}', b'{"prompt": [[]]}', b'{"prompt": "x", "max_tokens": true}',
               b'{"prompt": "x", "max_tokens": "5"}', b'{"prompt": "x", "max_tokens": -1}',
               b'{"prompt": "x", "n": 1000}', b'{"prompt": "x", "top_p": 0}',
               b'{"prompt": "x", "stop": [""]}', b'{"prompt": "x", "logit_bias": {"1": 5}}',
               b'{"prompt": "x", "max_tokens": 0}', b'{"prompt": [1.5, 2]}',
               b'{"prompt": "x", "seed": -3}', b'{"prompt": "\\ud800"}',
               b'{"prompt": "x", "temperature": 1e-9}', b'{"prompt": "x", "echo": 1}',
               b'{"prompt": ["a", "b", "c"], "n": 100}',
               b'{"prompt": "x", "stream": true, "echo": true, "temperature": -1}',
               b'{"prompt": "x", "temperature": NaN}',
               b'{"prompt": "x", "stream_options": {"include_usage": "yes"}}']
    for body in hostile:
        r = httpx.post(f"{url}/v1/completions", content=body, headers=headers, timeout=60)
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        assert r.json()["error"]["message"], body
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": []}, headers=headers)
    assert r.status_code == 400
    r = httpx.post(f"{url}/v1/chat/completions", headers=headers, json={
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    assert r.status_code == 400 and "image_url" in r.json()["error"]["message"]
    for turns in ([{"role": "user"}], [{"role": "system", "content": None}, {"role": "user",
                                                                          "content": "hi"}]):
        r = httpx.post(f"{url}/v1/chat/completions", headers=headers, json={"messages": turns})
        assert r.status_code == 400 and "without content" in r.json()["error"]["message"], r.text
    assert client.chat.completions.create(model="smollm2", max_tokens=1, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
        {"role": "user", "content": "hi"}]).choices  # an assistant's turn may have none
    assert httpx.get(f"{url}/nowhere").status_code == 404
    # still serving
    assert client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2).choices


def test_api_key(url):
    for key in ("wrong", ""):
        bad = openai.OpenAI(base_url=f"{url}/v1", api_key=key or "x", max_retries=0,
                            default_headers={} if key else {"Authorization": ""})
        with pytest.raises(openai.AuthenticationError) as e:
            bad.completions.create(model="smollm2", prompt=PROMPT, max_tokens=1)
        assert e.value.status_code == 401
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/health").json()["status"] == "ok"  # probes need no key


def _long_stream(url: str, max_tokens: int = 2000):
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    return httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60,
                        headers={"Authorization": f"Bearer {KEY}"})


def _engine_idle(llm) -> bool:
    s = llm.cache_stats()
    return s["blocks_used"] == 0 and s["requests_running"] == 0 and s["requests_waiting"] == 0


def _post_to_a_client_gone_at_the_headers(app, path: str, body: dict) -> None:
    """One request through the app's ASGI interface whose client is gone by the time the
    headers go out: after the first token (the engine's request running), before any byte."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive():
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # the client sends nothing more

    async def send(message):
        if message["type"] == "http.response.start":
            raise OSError("the client closed the connection")

    async def request_then_idle():
        with contextlib.suppress(Exception):
            await app(scope, receive, send)

    asyncio.run(request_then_idle())


def test_a_client_gone_when_the_headers_go_out_gives_back_its_place_and_blocks(llm):
    """A client that leaves just as its stream's first token arrives: the headers' send fails,
    so the event stream is never read. Its place in the queue and its engine request must still
    be released (they were only released by the stream's own end)."""
    app = build_app(EngineHandler(llm, "smollm2"), max_queued=1)
    for _ in range(2):
        _post_to_a_client_gone_at_the_headers(app, "/v1/completions", {
            "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True})
        assert app.state.gate.held == 0
        wait_until(lambda: _engine_idle(llm), timeout=20, what="the left request cancelled")


def test_back_pressure_past_max_queued(llm):
    """max_queued=2: two long streams are held, the third request is refused with 429."""
    with running(build_app(EngineHandler(llm, "smollm2"), max_queued=2)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with _long_stream(url) as a, _long_stream(url) as b:
            # keep the line iterators: a dropped one closes its response, i.e. disconnects
            lines = a.iter_lines(), b.iter_lines()
            assert all(next(it).startswith("data: ") for it in lines)
            with pytest.raises(openai.RateLimitError) as e:
                client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=1)
            assert e.value.status_code == 429 and "max_queued=2" in e.value.message
        wait_until(lambda: _engine_idle(llm), what="the closed streams to be cancelled")
        assert client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=1).choices
        assert metric_samples(url)['prefill:requests_rejected_total{model_name=smollm2,reason=429}'] == 1


def test_client_gone_mid_request_frees_its_blocks(llm, url):
    wait_until(lambda: _engine_idle(llm), what="an idle engine")
    with _long_stream(url) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert llm.cache_stats()["blocks_used"] > 0
    # 2,000 tokens would take far longer than this: the request was cancelled
    wait_until(lambda: _engine_idle(llm), timeout=10, what="the stream's request to be cancelled")
    # a non-streamed request whose client times out is cancelled too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", timeout=1.5, headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True})
    wait_until(lambda: _engine_idle(llm), timeout=10, what="the request to be cancelled")


def test_metrics_move_with_each_request(llm, client, url):
    def name(metric: str) -> str:
        return f"{metric}{{model_name=smollm2}}"

    before = metric_samples(url)
    r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = metric_samples(url)

    def moved(metric: str) -> float:
        return after[name(metric)] - before.get(name(metric), 0.0)

    assert moved("vllm:prompt_tokens_total") == len(llm.tokenize(PROMPT))
    assert moved("vllm:generation_tokens_total") == 5 == r.usage.completion_tokens
    assert moved("vllm:time_to_first_token_seconds_count") == 1
    assert moved("vllm:inter_token_latency_seconds_count") == 4
    assert moved("vllm:e2e_request_latency_seconds_count") == 1
    engine = "engine=0,model_name=smollm2"
    queries = f"vllm:prefix_cache_queries_total{{{engine}}}"
    assert after[queries] - before[queries] == len(llm.tokenize(PROMPT))
    # a prompt again: its whole blocks (but the last token's) come from the prefix cache
    long_prompt = " ".join(["prefill"] * 40)
    client.completions.create(model="smollm2", prompt=long_prompt, max_tokens=1)
    hits = f"vllm:prefix_cache_hits_total{{{engine}}}"
    before = metric_samples(url)[hits]
    again = client.completions.create(model="smollm2", prompt=long_prompt, max_tokens=1)
    block = llm.config.block_size
    whole_blocks = (len(llm.tokenize(long_prompt)) - 1) // block * block
    assert metric_samples(url)[hits] - before == whole_blocks
    assert again.usage.prompt_tokens_details.cached_tokens == whole_blocks
    assert after[f"prefill:kv_blocks_total{{{engine}}}"] == llm.cache_stats()["blocks_total"]
    assert after[f"prefill:engine_up{{{engine}}}"] == 1
    assert f"vllm:kv_cache_usage_perc{{{engine}}}" in after


def test_concurrent_clients_all_get_their_own_answer(llm, client):
    prompts = [f"Count to {i}:" for i in range(4)]
    want = [g.text for g in llm.generate(prompts, SamplingParams(max_tokens=4))]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: client.completions.create(
            model="smollm2", prompt=p, max_tokens=4, temperature=0).choices[0].text, prompts))
    assert got == want
    wait_until(lambda: _engine_idle(llm), what="an idle engine")


def test_bench_load_fails_nothing_and_leaks_nothing(llm, url):
    """bench.serve_bench's load, smaller: 8 shared-prefix requests, 4 at a time."""
    import asyncio

    from bench.serve_bench import prompts, run_load, summarize

    texts = prompts(8, [100, 200], group_size=4, seed=0)
    results, wall = asyncio.run(run_load(f"{url}/v1", "smollm2", texts, concurrency=4, rate=0,
                                         max_tokens=4, max_seconds=300, api_key=KEY))
    summary = summarize(results, wall)
    assert summary["failed"] == 0, summary["errors"]
    assert all(r.completion_tokens == 4 and len(r.itl_s) == 3 for r in results)
    assert summary["ttft_p50_s"] > 0 and summary["itl_p99_s"] >= summary["itl_p50_s"]
    wait_until(lambda: _engine_idle(llm), what="every block back")


def test_readme_serve_block_runs_as_written():
    """The README's "Serve it" block, by bash, on a free port instead of 8000."""
    text = README.read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index("## Serve it"):], re.S).group(1)
    [port] = subproc.free_ports(1)
    venv = Path(sys.executable).parent.parent
    script = block.replace("8000", str(port)).replace(".venv/", f"{venv}/")
    r = subproc.run(["bash", "-c", script], timeout=300,
                    env=subproc.isolated_env(subproc.ray_tmpdir()))
    assert r.returncode == 0, r.explain()
    assert '"status":"ok"' in r.stdout and '"text":" Paris' in r.stdout, r.explain()
    assert "vllm:time_to_first_token_seconds_count" in r.stdout, r.explain()
    assert not r.leaked, r.leaked
