"""dp=2 routing: a prefix every prompt shares (a chat template) draws no affinity, so uniform
chat traffic spreads over the replicas; a prefix some prompts share still goes where it is
cached; and a hot prefix cannot pile up on one replica past the load slack."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.driver.router import AFFINITY_LOAD_SLACK

SMALL = dict(block_size=4, kv_cache_gb=0.01, cpus_per_rank=0.5)
TEMPLATE = [7, 1, 4, 9, 2, 8] * 4  # 24 tokens every "chat" prompt starts with: 6 full blocks
ONE = SamplingParams(max_tokens=1)


def _requests_per_replica(llm: LLM, prompt_len: int) -> list[int]:
    """Requests each replica looked up in its prefix cache (every prompt is prompt_len long)."""
    return [r["prefix_lookup_tokens"] // prompt_len for r in llm.cache_stats()["replicas"]]


@pytest.fixture(scope="module")
def llm(ray_cluster, tiny_model_dir):
    with LLM(str(tiny_model_dir("uneven")), dp=2, **SMALL) as engine:
        yield engine


def test_chat_traffic_spreads_over_the_replicas(llm):
    chat = [TEMPLATE + [20 + i, 30 + i, 40 + i, 50 + i] for i in range(17)]
    base = _requests_per_replica(llm, len(chat[0]))
    llm.prefill(chat[:1], ONE)  # replica 0 now caches the template
    llm.prefill(chat[1:], ONE)  # 16 together: before, all went to replica 0 (its template hit)
    together = [a - b for a, b in zip(_requests_per_replica(llm, len(chat[0])), base)]
    assert together in ([9, 8], [8, 9]), together
    for prompt in chat[:8]:  # one at a time: both replicas idle each time
        llm.prefill([prompt[:-1] + [99]], ONE)
    alone = [a - b for a, b in zip(_requests_per_replica(llm, len(chat[0])), base)]
    assert [a - b for a, b in zip(alone, together)] == [4, 4], alone


def test_a_prefix_beyond_the_template_still_draws_its_requests(llm):
    doc_a, doc_b = [11, 12, 13, 14] * 4, [15, 16, 17, 18] * 4  # 16 tokens: 4 blocks each
    llm.prefill([TEMPLATE + doc_a + [1], TEMPLATE + doc_b + [1]], ONE)  # one on each replica
    outs = llm.prefill([TEMPLATE + doc_b + [2], TEMPLATE + doc_a + [2]], ONE)
    assert [o.cached_tokens for o in outs] == [40, 40]  # template + document, both hits


def test_a_hot_prefix_spills_over_past_the_load_slack(llm):
    hot = [61, 62, 63, 64] * 6  # 24 tokens no earlier prompt starts with
    llm.prefill([hot + [0]], ONE)  # one replica caches it
    n = 2 * (AFFINITY_LOAD_SLACK + 2)
    before = _requests_per_replica(llm, len(hot) + 1)
    outs = llm.prefill([hot + [i + 1] for i in range(n)], ONE)  # sent together
    after = [a - b for a, b in zip(_requests_per_replica(llm, len(hot) + 1), before)]
    hits = sum(o.cached_tokens == len(hot) for o in outs)
    # the first AFFINITY_LOAD_SLACK + 1 go to the replica caching `hot` (hits), then the
    # loads stay within the slack: the other replica takes its share (before: all n, on one)
    assert hits >= AFFINITY_LOAD_SLACK + 1 and max(after) <= (n + AFFINITY_LOAD_SLACK + 1) // 2 + 1, \
        (after, hits)
