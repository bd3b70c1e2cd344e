"""What a CPU can prove of the decode step's CUDA graphs (engine/rank/cuda_graphs.py): the
padding of a step into a graph's static inputs, the widths, and the fallback when capturing
fails. Capture and replay on (fake) CUDA are in test_fake_cuda.py."""
from __future__ import annotations

import torch

from engine.batch import Batch, SamplingSpec
from engine.rank.cuda_graphs import DecodeGraphs, padded_inputs, table_width, widths_up_to
from engine.rank.kv_cache import KVCache


def _decode_batch() -> Batch:
    # two sequences: contexts 5 (blocks [3]) and 20 (blocks [7, 9]), blocks of 16 tokens
    return Batch([11, 12], [4, 19], [0, 1, 2], [5, 20], [3 * 16 + 4, 9 * 16 + 3], [[3], [7, 9]],
                 [0, 1], [SamplingSpec(), SamplingSpec()])


def test_table_widths_are_powers_of_two_from_two():
    assert [table_width(n, 16) for n in (1, 16, 32, 33, 64, 65, 129)] == [2, 2, 2, 4, 4, 8, 16]
    assert widths_up_to(256, 16) == [2, 4, 8, 16]
    assert widths_up_to(8192, 16) == [2, 4, 8, 16, 32, 64, 128, 256, 512]


def test_padding_repeats_the_last_row_and_masks_the_table_with_block_zero():
    got = padded_inputs(_decode_batch(), rows=4, width=4)
    expected = ([11, 12, 12, 12] + [4, 19, 19, 19] + [52, 147, 147, 147] + [5, 20, 20, 20]
                + [3, 0, 0, 0] + [7, 9, 0, 0] + [7, 9, 0, 0] + [7, 9, 0, 0])
    assert got == expected


def test_a_failed_capture_leaves_every_step_to_the_uncaptured_graph(caplog):
    """Here capturing fails at once (no CUDA): no graph is kept, no step finds one (the caller
    runs the uncaptured compiled graph), and one warning says so."""
    cache = KVCache(1, 4, 16, 1, 8, torch.float32, "cpu")
    calls = []
    graphs = DecodeGraphs(lambda *a: calls.append(a), cache, torch.zeros(1, dtype=torch.long))
    with caplog.at_level("WARNING", logger="engine"):
        graphs.capture([1, 2], [2])
    assert not graphs.usable and graphs.graphs == {}
    assert graphs.load(_decode_batch(), 2) is None
    assert "CUDA graph capture failed" in caplog.text
