"""engine.rank.kept_graphs: a compiled graph kept on disk is loaded by the next start instead of
compiled; a kept graph that does not fit its call (its guards reject it) is replaced, one that
cannot be read is compiled again with a warning, and every answer equals the function's own
(an eager reference). Keys: another setup, another source, another file."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine.rank import kept_graphs
from engine.rank.kept_graphs import KeptGraph, graph_file


def scaled_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x * w).sum(-1) * 0.5


@pytest.fixture(autouse=True)
def own_inductor_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)


def test_a_kept_graph_is_loaded_not_compiled(tmp_path):
    path = tmp_path / "g.bin"
    x, w = torch.randn(4, 8), torch.randn(8)
    first = KeptGraph(scaled_sum, path)
    torch.testing.assert_close(first(x, w), scaled_sum(x, w))
    assert first.compiles == 1 and path.exists()
    second = KeptGraph(scaled_sum, path)  # a later start
    torch.testing.assert_close(second(x, w), scaled_sum(x, w))
    second.trust()
    torch.testing.assert_close(second(x + 1, w), scaled_sum(x + 1, w))
    assert second.compiles == 0 and not second.fell_back


def test_a_kept_graph_that_does_not_fit_is_replaced(tmp_path):
    """A kept file whose guards reject the call (here: float64 inputs for a float32 graph, as
    a key that missed a setting would give) is compiled again and kept in its place; within one
    run, a second misfit falls back to plain torch.compile, still right."""
    path = tmp_path / "g.bin"
    KeptGraph(scaled_sum, path)(torch.randn(4, 8), torch.randn(8))
    x, w = torch.randn(4, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    stale = KeptGraph(scaled_sum, path)
    torch.testing.assert_close(stale(x, w), scaled_sum(x, w))
    assert stale.compiles == 1 and not stale.fell_back
    x16, w16 = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8, dtype=torch.bfloat16)
    # against float32 math: the graph sums bf16 products in float32, eager in bf16
    torch.testing.assert_close(stale(x16, w16).float(), scaled_sum(x16.float(), w16.float()),
                               rtol=0.02, atol=0.02)
    assert stale.fell_back
    again = KeptGraph(scaled_sum, path)  # the float64 graph was kept
    torch.testing.assert_close(again(x, w), scaled_sum(x, w))
    assert again.compiles == 0


def test_an_unreadable_kept_graph_is_compiled_again(tmp_path, caplog):
    path = tmp_path / "g.bin"
    x, w = torch.randn(4, 8), torch.randn(8)
    KeptGraph(scaled_sum, path)(x, w)
    path.write_bytes(path.read_bytes()[:100])  # cut, as a killed write would leave it
    graph = KeptGraph(scaled_sum, path)
    with caplog.at_level(logging.WARNING, logger="engine"):
        torch.testing.assert_close(graph(x, w), scaled_sum(x, w))
    assert graph.compiles == 1
    assert "could not load the compiled graph" in caplog.text and str(path) in caplog.text
    assert KeptGraph(scaled_sum, path)(x, w) is not None  # rewritten whole


def test_dynamic_sizes_are_marked_before_compiling_only(tmp_path):
    """A kept graph compiled with a dynamic size serves other sizes after loading, unmarked."""
    path = tmp_path / "g.bin"

    def mark(x, w):
        torch._dynamo.mark_dynamic(x, 0)

    KeptGraph(scaled_sum, path, mark=mark)(torch.randn(4, 8), torch.randn(8))
    loaded = KeptGraph(scaled_sum, path, mark=mark)
    for rows in (3, 9):
        x, w = torch.randn(rows, 8), torch.randn(8)
        torch.testing.assert_close(loaded(x, w), scaled_sum(x, w))
    assert loaded.compiles == 0 and not loaded.fell_back


def test_keys_name_the_setup_and_the_source_and_newer_code_replaces_older(tmp_path,
                                                                         monkeypatch):
    a = graph_file(tmp_path, "layer", "setup A")
    assert a == graph_file(tmp_path, "layer", "setup A")
    assert a != graph_file(tmp_path, "layer", "setup B")
    assert a != graph_file(tmp_path, "decode1", "setup A")
    x, w = torch.randn(4, 8), torch.randn(8)
    other_setup = graph_file(tmp_path, "layer", "setup B")
    for path in (a, other_setup):
        KeptGraph(scaled_sum, path)(x, w)
    monkeypatch.setattr(kept_graphs, "source_digest", lambda: "an edited engine")
    edited = graph_file(tmp_path, "layer", "setup A")
    assert edited != a
    KeptGraph(scaled_sum, edited)(x, w)
    # the edited engine's graph replaced its older self; setup B's is another setup's
    assert sorted(tmp_path.glob("*.bin")) == sorted([edited, other_setup])


def test_a_graph_being_kept_never_shows_half_written(tmp_path, monkeypatch):
    """Ranks of one setup starting together compile and keep the same graph: while one writes
    its file, another start reading the path finds the earlier whole graph, never a part."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    path = tmp_path / "g.bin"
    x, w = torch.randn(4, 8), torch.randn(8)
    KeptGraph(scaled_sum, path)(x, w)
    whole = path.read_bytes()
    save, seen = AOTCompiledFunction.save_compiled_function, []

    def save_in_two_halves(self, target):
        if seen:  # the reader's own compile, had it needed one
            return save(self, target)
        save(self, target)
        data = Path(target).read_bytes()
        Path(target).write_bytes(data[:len(data) // 2])  # a writer halfway through
        seen.append(path.read_bytes())
        reader = KeptGraph(scaled_sum, path)  # another start, now
        torch.testing.assert_close(reader(x, w), scaled_sum(x, w))
        seen.append(reader.compiles)
        Path(target).write_bytes(data)

    monkeypatch.setattr(AOTCompiledFunction, "save_compiled_function", save_in_two_halves)
    x64, w64 = x.double(), w.double()  # a misfit: compiled again and kept in its place
    torch.testing.assert_close(KeptGraph(scaled_sum, path)(x64, w64), scaled_sum(x64, w64))
    assert seen == [whole, 0]
    monkeypatch.undo()
    again = KeptGraph(scaled_sum, path)  # the float64 graph, whole
    torch.testing.assert_close(again(x64, w64), scaled_sum(x64, w64))
    assert again.compiles == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["g.bin"]
