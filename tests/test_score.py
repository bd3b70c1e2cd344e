"""LLM.score against transformers on the same weights: every position's log-probability, the
perplexity and the top-k, at TP=1/2/3, chunked, batched; the strided sliding window against a
plain-torch reference of the same method; bad input."""
from __future__ import annotations

import json
import math

import pytest
import torch

from engine import LLM, InvalidRequestError
from parallel.sharded_logprobs import TILE_BYTES, tile_shape, vocab_parallel_logprobs
from tests.reference import hf_model


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[T-1, vocab]: log-softmax of transformers' logits at every position but the last."""
    return torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)


def _assert_matches(hf, prompts: list[list[int]], outs, k: int = 0) -> None:
    assert len(outs) == len(prompts)
    for ids, s in zip(prompts, outs):
        ref = _hf_logprobs(hf, ids)
        want = ref.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
        assert s.prompt_token_ids == ids and len(s.logprobs) == len(ids) - 1
        assert (torch.tensor(s.logprobs) - want).abs().max().item() <= 1e-4
        ppl = math.exp(-want.double().mean().item())
        assert abs(s.perplexity - ppl) <= 1e-4 * ppl
        if not k:
            assert s.top_logprobs is None
            continue
        best = ref.topk(k, dim=-1).values
        assert len(s.top_logprobs) == len(ids) - 1
        for pos, cands in enumerate(s.top_logprobs):
            tids, lps = zip(*cands)
            assert len(set(tids)) == k  # k distinct tokens, most likely first
            assert (torch.tensor(lps) - best[pos]).abs().max().item() <= 1e-4
            # each is what transformers gives that token: a true top-k, ties in any order
            assert (torch.tensor(lps) - ref[pos, list(tids)]).abs().max().item() <= 1e-4


def test_vocab_parallel_math_matches_log_softmax_in_tiles():
    """World of one, tiles of 5 rows x 4 columns (the budget forces both splits): log p(target)
    and the top-7 of torch.log_softmax."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 50, generator=g) * 4
    targets = torch.randint(0, 50, (37,), generator=g)
    calls = []

    def local(a, b, c, e):
        calls.append((a, b, c, e))
        return logits[a:b, c:e].clone()

    budget = 20 * 4  # 20 float32 cells
    rows = vocab_parallel_logprobs(local, 37, targets, (0, 50), top_k=7, tile_bytes=budget)
    ref = torch.log_softmax(logits, -1)
    assert calls[:2] == [(0, 1, 0, 20), (0, 1, 20, 40)]  # 20 columns of 1 row fit
    assert rows.peak_logits_bytes == 2 * budget  # a tile and its log-softmax
    torch.testing.assert_close(rows.logprobs, ref.gather(-1, targets[:, None])[:, 0])
    top = ref.topk(7, dim=-1)
    torch.testing.assert_close(rows.top_logprobs, top.values)
    assert torch.equal(rows.top_ids, top.indices)
    whole = vocab_parallel_logprobs(local, 37, targets, (0, 50), tile_bytes=10 * 50 * 4)
    assert calls[-1] == (30, 37, 40, 50)  # 10 rows of every column fit; 20 columns at most
    torch.testing.assert_close(whole.logprobs, rows.logprobs)
    for n, vocab in [(1, 50), (3, 49152), (511, 24576), (2047, 49152), (9000, 49152)]:
        r, c = tile_shape(n, vocab)  # a tile + its log-softmax under the rows' full logits
        assert r <= n and 2 * r * c * 4 <= r * vocab * 4 and r * c * 4 <= TILE_BYTES
    narrow = vocab_parallel_logprobs(local, 37, targets, (0, 50), top_k=7, tile_bytes=4 * 4)
    assert calls[-1] == (36, 37, 48, 50)  # tiles of 4 columns, narrower than k
    torch.testing.assert_close(narrow.top_logprobs, top.values)
    assert torch.equal(narrow.top_ids, top.indices)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "uneven"])
def test_tiny_models_match_transformers_chunked_and_batched(tiny_model_dir, name):
    path = str(tiny_model_dir(name))
    hf = hf_model(path)
    vocab = hf.config.vocab_size
    prompts = [_ids(n, vocab, seed=n) for n in (2, 41, 23, 9)]
    with LLM(path, max_num_batched_tokens=16) as llm:  # every long prompt runs in chunks
        outs = llm.score(prompts, top_logprobs=4)
        _assert_matches(hf, prompts, outs, k=4)
        assert len(llm.step_timings()) >= sum(len(p) for p in prompts) // 16


@pytest.mark.parametrize("tp", [2, 3])
def test_uneven_model_tensor_parallel(ray_cluster, tiny_model_dir, tp):
    """Vocab 301 over 2 or 3 ranks; k=120 exceeds a TP=3 rank's slice of ~100 tokens, so the
    merged top-k must draw on several ranks."""
    path = str(tiny_model_dir("uneven"))
    hf = hf_model(path)
    prompts = [_ids(n, 301, seed=10 + n) for n in (37, 5, 20)]
    with LLM(path, tp=tp, max_num_batched_tokens=16) as llm:
        _assert_matches(hf, prompts, llm.score(prompts, top_logprobs=120), k=120)
        _assert_matches(hf, prompts[:1], llm.score(prompts[:1]))


def test_smollm2_matches_transformers(smollm2_path, smollm2_hf):
    texts = ["The capital of France is Paris. The capital of Germany is Berlin.",
             "Prefill computes every position of the prompt at once."]
    with LLM("smollm2", max_num_batched_tokens=8) as llm:
        prompts = [llm.tokenizer.encode(t) for t in texts]
        outs = llm.score(texts, top_logprobs=5)
    assert [s.prompt_token_ids for s in outs] == prompts
    _assert_matches(smollm2_hf, prompts, outs, k=5)


def test_prefix_cache_hit_still_scores_every_position_and_scoring_fills_the_cache(tiny_model_dir):
    path = str(tiny_model_dir("uneven"))
    hf = hf_model(path)
    ids = _ids(50, 301, seed=5)
    with LLM(path, block_size=8) as llm:
        assert llm.prefill([ids])[0].cached_tokens == 0
        _assert_matches(hf, [ids], llm.score([ids]))  # cached prefix, recomputed anyway
        fresh = _ids(43, 301, seed=6)
        llm.score([fresh])
        assert llm.prefill([fresh])[0].cached_tokens == 40  # the 5 full blocks scoring wrote


@pytest.mark.parametrize("prompts, k, needle", [
    ([[]], 0, "empty prompt"),
    ([[7, 8], [5]], 0, "prompt 1 has 1 token"),
    ([[7, 8]], True, "top_logprobs=True"),
    ([[7, 8]], -1, "top_logprobs=-1"),
    ([[7, 8]], 2.0, "top_logprobs=2.0"),
    ([[7, 8]], 302, "exceeds the vocabulary of 301"),
])
def test_bad_input_is_refused_and_the_engine_keeps_serving(tiny_model_dir, prompts, k, needle):
    path = str(tiny_model_dir("uneven"))
    with LLM(path) as llm:
        with pytest.raises(InvalidRequestError, match=needle):
            llm.score(prompts, top_logprobs=k)
        [s] = llm.score([[7, 8, 9]], top_logprobs=301)
        assert len(s.logprobs) == 2 and len(s.top_logprobs[0]) == 301


@torch.inference_mode()
def _strided_reference(hf, ids: list[int], window: int, stride: int) -> tuple[float, int]:
    """The textbook strided perplexity in plain torch: windows start every `stride` tokens;
    labels before the previous window's end are masked; NLL summed over the scored tokens."""
    total, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        x = torch.tensor([ids[begin:end]])
        labels = x.clone()
        labels[:, :-(end - prev_end)] = -100  # only tokens no earlier window scored
        logits = hf(x).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, labels[0, 1:], ignore_index=-100,
                                                reduction="sum")
        total += nll.item()
        count += int((labels[0, 1:] != -100).sum())
        prev_end = end
        if end == len(ids):
            break
    return total, count


@pytest.mark.parametrize("stride", [5, 11, 23])
def test_sliding_window_matches_plain_torch(tiny_model_dir, stride):
    from launcher.score import score_documents

    path = str(tiny_model_dir("uneven"))
    hf = hf_model(path)
    docs = [_ids(n, 301, seed=n) for n in (70, 24, 1, 31)]
    with LLM(path, max_model_len=24) as llm:
        results = score_documents(llm, docs, window=24, stride=stride, batch_size=3)
    for ids, r in zip(docs, results):
        if len(ids) < 2:
            assert r["perplexity"] is None and r["scored_tokens"] == 0
            continue
        nll, count = _strided_reference(hf, ids, 24, stride)
        assert r["scored_tokens"] == count == len(ids) - 1
        assert abs(r["nll"] - nll) <= 1e-4 * count
        assert r["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-4)
    assert results[0]["windows"] > 1


def test_score_app_writes_one_line_per_document(tiny_model_dir, tmp_path):
    from hydra import compose, initialize_config_dir

    from launcher.build_engine import CONF_DIR
    from launcher.score import run

    docs = [{"id": "a", "prompt": _ids(30, 301, 1)}, {"id": "b", "prompt": _ids(3, 301, 2)}]
    src, out = tmp_path / "docs.jsonl", tmp_path / "scores.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in docs))
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("score", [f"input={src}", f"output={out}", "window=16", "stride=6",
                                f"model.path={tiny_model_dir('uneven')}", "progress=false"])
    run(cfg)
    lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [ln["id"] for ln in lines] == ["a", "b"]
    assert [ln["tokens"] for ln in lines] == [30, 3]
    assert lines[0]["windows"] == 4  # starting at 0, 6, 12, 18
    assert lines[1]["perplexity"] > 1


@pytest.mark.parametrize("content, needle", [
    (None, "no such file"),
    (b"\xff\xfe bad", "not UTF-8"),
    (b'{"prompt": "ok"}\n[1, 2]\n', "docs.jsonl:2: expected an object with a 'prompt' key"),
    (b'{"text": "ok"}\n', "docs.jsonl:1: expected an object"),
    (b'{"prompt": 3}\n', "must be a string or a list of token ids"),
    (b'{"prompt": \n', "docs.jsonl:1 is not JSON"),
])
def test_score_app_input_errors_name_the_file_and_line(tmp_path, content, needle):
    from launcher.score import ScoreInputError, load_documents

    path = tmp_path / "docs.jsonl"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ScoreInputError, match=needle):
        load_documents(str(path))


def test_windows_cover_every_token_once():
    from launcher.score import ScoreInputError, windows

    for n, w, s in [(100, 24, 7), (24, 24, 5), (25, 24, 23), (2, 24, 1)]:
        scored = [t for _, end, first in windows(n, w, s) for t in range(first, end)]
        assert scored == list(range(1, n))
        assert all(end - begin <= w for begin, end, _ in windows(n, w, s))
    with pytest.raises(ScoreInputError, match="stride=24 with window=24"):
        windows(100, 24, 24)


def test_scheduler_packs_scored_rows_beside_a_sampling_prompt():
    """One step holding a sampled prompt and a chunk of a scored one: the scored rows (hand
    counted) never sample, and their results land by position."""
    from engine import SamplingParams
    from engine.driver.block_manager import BlockManager
    from engine.driver.scheduler import Scheduler
    from engine.driver.scoring import ScoreRequest
    from engine.driver.sequence import Sequence
    from parallel.sharded_logprobs import LogprobRows

    sched = Scheduler(BlockManager(32, 4), max_num_batched_tokens=8, max_num_seqs=8,
                      max_model_len=64, eos_token_ids=[2])
    gen = Sequence([10, 11, 12], SamplingParams(max_tokens=4))
    scored = Sequence([20, 21, 22, 23, 24, 25, 26], SamplingParams(max_tokens=1))
    scored.score = ScoreRequest(0, 7)
    sched.add(gen)
    sched.add(scored)
    step = sched.schedule()
    assert [(s.seq_id, n) for s, n in step] == [(gen.seq_id, 3), (scored.seq_id, 5)]
    batch = sched.build_batch(step)
    assert batch.logits_indices == [2] and len(batch.sampling) == 1
    assert batch.score_indices == [3, 4, 5, 6, 7] and batch.score_targets == [21, 22, 23, 24, 25]
    rows = LogprobRows(torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0]))
    assert sched.postprocess(step, [99], score=rows) == []
    step = sched.schedule()  # the rest: positions 5, 6; only position 5 has a next token
    batch = sched.build_batch(step)
    assert batch.score_indices == [1] and batch.score_targets == [26]
    done = sched.postprocess(step, [7], score=LogprobRows(torch.tensor([-6.0])))
    assert done == [scored] and scored.finish_reason == "scored"
    assert scored.score.logprobs == [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]
    assert scored.token_ids == scored.prompt_token_ids  # nothing sampled


def test_score_and_generate_from_two_threads_share_steps(tiny_model_dir):
    import threading

    from engine import SamplingParams

    path = str(tiny_model_dir("uneven"))
    hf = hf_model(path)
    gen_ids, score_ids = _ids(30, 301, seed=1), [_ids(60, 301, seed=2), _ids(17, 301, seed=3)]
    with LLM(path) as llm:
        [alone] = llm.generate([gen_ids], SamplingParams(max_tokens=12, ignore_eos=True))
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("s", llm.score(score_ids, 3)))
        t.start()
        [g] = llm.generate([gen_ids], SamplingParams(max_tokens=12, ignore_eos=True))
        t.join()
    assert g.token_ids == alone.token_ids
    _assert_matches(hf, score_ids, got["s"], k=3)


def test_prefill_score_command_line(tiny_model_dir, tmp_path):
    """`prefill score ...` through the console script's dispatcher and Hydra's main."""
    import sys

    from tests import subproc

    src, out = tmp_path / "docs.jsonl", tmp_path / "scores.jsonl"
    src.write_text(json.dumps({"prompt": _ids(40, 301, 4)}) + "\n")
    r = subproc.run([sys.executable, "-c", "from launcher.cli import main; main()", "score",
                     f"input={src}", f"output={out}", f"model.path={tiny_model_dir('uneven')}",
                     "window=16", "stride=8"], timeout=120)
    assert r.returncode == 0, r.explain()
    assert "1 documents, 39 tokens scored" in r.stdout, r.explain()
    assert json.loads(out.read_text())["windows"] == 4  # starts 0, 8, 16, 24


def _score_cfg(tmp_path, src, *overrides, model="/no/such/model"):
    from hydra import compose, initialize_config_dir

    from launcher.build_engine import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("score", [f"input={src}", f"output={tmp_path / 'scores.jsonl'}",
                                 f"model.path={model}", "progress=false", *overrides])


@pytest.mark.parametrize("overrides, needle", [
    (["batch_size=-1"], r"batch_size=-1: use an integer >= 1"),  # once: every document "skipped"
    (["batch_size=0"], r"batch_size=0: use an integer >= 1"),  # once: ValueError from range()
    (["window=0"], r"window=0: use null or an integer >= 2"),  # once: silently the default
    (["stride=0"], r"stride=0: use null or an integer >= 1"),
    (["output=/no/such/dir/scores.jsonl"], r"output=.*missing directory '/no/such/dir'"),
])
def test_score_app_bad_keys_are_refused_before_the_model_loads(tmp_path, overrides, needle):
    """The model path does not exist: each key is refused before anything loads (a missing
    output directory once failed only after every document was scored)."""
    from launcher.hydra_main import BadSetting
    from launcher.score import run

    src = tmp_path / "docs.txt"
    src.write_text("one document\n")
    with pytest.raises(BadSetting, match=needle):
        run(_score_cfg(tmp_path, src, *overrides))


@pytest.mark.parametrize("content, needle", [
    (b'{"prompt": "ok"}\n{"prompt": "bad \\ud800 here"}\n',
     r"docs.jsonl:2: 'prompt' holds a lone surrogate '\\ud800'"),  # once a TypeError
    (b"", "holds no documents"),  # once "perplexity nan", exit 0
    (b"\n  \n", "holds no documents"),
])
def test_score_app_file_problems_name_the_file(tmp_path, content, needle):
    from launcher.score import ScoreInputError, load_documents

    path = tmp_path / "docs.jsonl"
    path.write_bytes(content)
    with pytest.raises(ScoreInputError, match=needle):
        load_documents(str(path))
    with pytest.raises(ScoreInputError, match="is a directory"):  # once "no such file"
        load_documents(str(tmp_path))


def test_score_app_names_the_line_of_out_of_vocabulary_ids(tiny_model_dir, tmp_path):
    from launcher.score import ScoreInputError, run

    src = tmp_path / "docs.jsonl"
    src.write_text('{"prompt": [5, 6, 7]}\n{"prompt": [5, 999999, 7]}\n')
    with pytest.raises(ScoreInputError, match=r"docs.jsonl:2: token ids \[999999\] are outside"):
        run(_score_cfg(tmp_path, src, model=tiny_model_dir("uneven")))


def test_score_documents_refuses_a_batch_size_below_one(tiny_model_dir):
    from launcher.score import ScoreInputError, score_documents

    with LLM(str(tiny_model_dir("uneven"))) as llm:
        for bad in (-1, 0, True):
            with pytest.raises(ScoreInputError, match="batch_size"):
                score_documents(llm, [[5, 6, 7, 8]], 16, 8, batch_size=bad)
        [r] = score_documents(llm, [[5, 6, 7, 8]], 16, 8, batch_size=1)
        assert r["scored_tokens"] == 3
