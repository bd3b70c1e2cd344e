"""Head and size partitions, checked against hand-worked splits."""
import pytest

from parallel.partition import even_ranges, partition_heads


def test_even_ranges_cover_uneven_sizes():
    assert even_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert even_ranges(49152, 1) == [(0, 49152)]
    assert even_ranges(301, 2) == [(0, 151), (151, 301)]


def test_smollm2_heads_split_by_kv_group():
    # 9 query heads in 3 groups of 3: TP=2 takes groups {0,1} and {2}
    tp2 = partition_heads(9, 3, 2)
    assert [(p.q_heads, p.kv_heads) for p in tp2] == [((0, 6), (0, 2)), ((6, 9), (2, 3))]
    assert tp2[0].kv_head_of_q_head() == [0, 0, 0, 1, 1, 1]
    assert tp2[1].kv_head_of_q_head() == [0, 0, 0]
    tp3 = partition_heads(9, 3, 3)
    assert [(p.q_heads, p.kv_heads) for p in tp3] == [((0, 3), (0, 1)), ((3, 6), (1, 2)), ((6, 9), (2, 3))]


def test_kv_heads_replicated_beyond_kv_count():
    # TP=4 > 3 KV heads: query heads 3,2,2,2; rank 2 holds q5 (group 1) and q6 (group 2)
    tp4 = partition_heads(9, 3, 4)
    assert [p.q_heads for p in tp4] == [(0, 3), (3, 5), (5, 7), (7, 9)]
    assert [p.kv_heads for p in tp4] == [(0, 1), (1, 2), (1, 3), (2, 3)]
    assert tp4[2].kv_head_of_q_head() == [0, 1]


def test_impossible_splits_are_refused():
    with pytest.raises(ValueError, match="exceeds the 9 attention heads"):
        partition_heads(9, 3, 10)
    with pytest.raises(ValueError, match="at least 1"):
        partition_heads(9, 3, 0)
