"""The engine's GGUF header reader (engine.loading.gguf_file) against the `gguf` package's own
GGUFReader: the same values and the same tensor bytes, and a clear error for a cut or foreign
file."""
import struct

import gguf
import numpy as np
import pytest

from engine.errors import ModelLoadError
from engine.loading.gguf_file import GGUFFile

Q = gguf.GGMLQuantizationType


def _same_as_gguf_reader(path, flattened: tuple[str, ...] = ()) -> GGUFFile:
    """`flattened`: keys of nested arrays, which GGUFReader's contents() gives flat."""
    mine, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(mine.metadata) == list(fields)
    for key in flattened:
        assert [v for item in mine.metadata[key] for v in item] == fields.pop(key)
    for key, value in fields.items():
        assert mine.metadata[key] == value and type(mine.metadata[key]) is type(value), key
    assert list(mine.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        got = mine.tensors[t.name]
        assert got.tensor_type == t.tensor_type and got.dims == tuple(t.shape.tolist()), t.name
        assert got.data.dtype == t.data.dtype and got.data.shape == t.data.shape, t.name
        assert np.array_equal(got.data, t.data), t.name
    return mine


def test_smollm2_reads_as_gguf_reads_it(smollm2_path):
    """49,152 tokens and 48,900 merges; F32 norms, Q4_1 and Q8_0 projections."""
    mine = _same_as_gguf_reader(smollm2_path)
    assert len(mine.metadata["tokenizer.ggml.merges"]) == 48900
    assert {t.tensor_type for t in mine.tensors.values()} == {Q.F32, Q.Q4_1, Q.Q8_0}


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    """Every metadata value type, nested and empty arrays, a non-default alignment, and plain,
    bf16 and block-quantized tensors of a few shapes."""
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo wörld ✓")
    w.add_array("t.strings", ["a b", "", "Ġthe", "✓✓"])
    w.add_array("t.ints", [3, 1, 4, 1, 5])
    w.add_array("t.floats", [0.5, -2.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 4, 6)).astype(np.float16))
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    for kind in (Q.BF16, Q.Q8_0, Q.Q4_1):
        values = rng.standard_normal((4, 64)).astype(np.float32)
        w.add_tensor(kind.name.lower(), gguf.quants.quantize(values, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_value_type_and_tensor_kind(small_gguf):
    mine = _same_as_gguf_reader(small_gguf, flattened=("t.nested",))
    assert mine.metadata["t.u64"] == 2**63 + 5 and mine.metadata["t.nested"] == [[1, 2], [3]]
    assert mine.metadata["general.alignment"] == 64
    q4 = mine.tensors["q4_1"]
    assert q4.dims == (64, 4) and q4.data.shape == (4, 2 * 20)  # 2 blocks of 32 a row, 20 bytes each


def test_cut_and_foreign_files_are_refused(small_gguf, tmp_path):
    """A download cut anywhere (header, tensor table, data) names the truncation; a file that is
    not GGUF, or a GGUF version this reader does not know, names what it found."""
    whole = small_gguf.read_bytes()
    tensors = gguf.GGUFReader(str(small_gguf)).tensors
    data_start = min(int(t.data_offset) for t in tensors)
    data_end = max(int(t.data_offset + t.n_bytes) for t in tensors)  # the file pads on after it
    cut = tmp_path / "cut.gguf"
    for length in [0, 3, 10, 30, 100, 200, 400, data_start - 1, data_start + 10, data_end - 1]:
        cut.write_bytes(whole[:length])
        match = "not a readable GGUF" if length < 4 else "truncated"
        with pytest.raises(ModelLoadError, match=match):
            GGUFFile(cut)
    cut.write_bytes(b"GGML" + whole[4:])
    with pytest.raises(ModelLoadError, match="starts with b'GGML'"):
        GGUFFile(cut)
    cut.write_bytes(whole[:4] + (1).to_bytes(4, "little") + whole[8:])
    with pytest.raises(ModelLoadError, match="GGUF version 1"):
        GGUFFile(cut)
    cut.write_bytes(whole[:4] + (3).to_bytes(4, "big") + whole[8:])  # a big-endian file
    with pytest.raises(ModelLoadError, match="big-endian"):
        GGUFFile(cut)


def test_absurd_counts_are_refused_not_trusted(tmp_path):
    """Counts and dims read from a corrupt header are checked against the file's length before
    anything is allocated: a tensor of 2**40 x 2**40 values (its byte count past 2**63), and
    2**62 tensors, keys or array items in a few dozen bytes."""
    def string(text):
        return struct.pack("<Q", len(text)) + text.encode()

    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 0)
    huge = (string("t") + struct.pack("<I", 2) + struct.pack("<QQ", 2**40, 2**40)
            + struct.pack("<IQ", int(Q.F32), 0))
    strings = string("k") + struct.pack("<IIQ", 9, 8, 2**62)  # an array of 2**62 strings
    cases = [(header + huge + bytes(64), "tensor 't' runs past its end"),
             (b"GGUF" + struct.pack("<IQQ", 3, 2**62, 2**62), "inside its header"),
             (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + strings, "inside its header")]
    path = tmp_path / "absurd.gguf"
    for blob, match in cases:
        path.write_bytes(blob)
        with pytest.raises(ModelLoadError, match=match):
            GGUFFile(path)
