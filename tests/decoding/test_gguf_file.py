"""Our GGUF header reader (``decoding.loader.gguf_file``) reads what gguf-py reads, without its cost.

It is what every GGUF load starts with: the metadata as plain values (the vocabulary-sized
arrays skipped, as ``GGUFSource.field`` documents), the tensors as views of one memory map,
typed and shaped exactly as gguf-py's ``ReaderTensor.data``. A file it cannot read is a
``ModelLoadError``, never a crash or an allocation the size of a corrupt length.
"""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from decoding.errors import ModelLoadError
from decoding.loader.gguf_file import KEEP_ARRAYS_UP_TO, SKIPPED, GGUFFile
from decoding.loader.gguf_source import GGUFSource

T = gguf.GGUFValueType
VOCABULARY_ARRAYS = {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"}

SCALARS = [  # (key, value, type): every scalar type GGUF has
    ("test.u8", 250, T.UINT8), ("test.i8", -7, T.INT8), ("test.u16", 65000, T.UINT16),
    ("test.i16", -30000, T.INT16), ("test.u32", 4_000_000_000, T.UINT32), ("test.i32", -2_000_000_000, T.INT32),
    ("test.u64", 2**63 + 5, T.UINT64), ("test.i64", -(2**62), T.INT64), ("test.f32", 0.5, T.FLOAT32),
    ("test.f64", 1e-300, T.FLOAT64), ("test.true", True, T.BOOL), ("test.false", False, T.BOOL),
    ("test.text", "Grüße, <|im_end|>", T.STRING),
]
ARRAYS = [  # (key, value, item type)
    ("test.words", ["a", "", "ünï", "<|eot_id|>"], T.STRING),
    ("test.floats", [0.25, -1.5, 3.0], T.FLOAT32),
    ("test.ids", [1, 2, 3, 2**40], T.UINT64),
    ("test.flags", [True, False, True], T.BOOL),
    ("test.nested", [[1, 2], [3], [4, 5, 6]], T.ARRAY),
    ("test.long_words", [f"w{i}" for i in range(50)], T.STRING),  # longer than the tests' keep limit
    ("test.long_ints", list(range(60)), T.INT32),
]
ALIGNMENT = 128  # not the default 32: tensors start where this file says, not where 32 would put them


def write_synthetic(path, endianess=gguf.GGUFEndian.LITTLE, alignment=ALIGNMENT):
    """A small GGUF holding every value type, arrays of all kinds, and float, integer and Q8_0 tensors."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    w.add_custom_alignment(alignment)
    for key, value, vtype in SCALARS:
        w.add_key_value(key, value, vtype)
    for key, value, itype in ARRAYS:
        w.add_key_value(key, value, T.ARRAY, sub_type=None if itype == T.ARRAY else itype)
    w.add_string("test.after_the_arrays", "still read")
    tensors = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f16": rng.standard_normal((7,)).astype(np.float16),
        "i32": np.arange(24, dtype=np.int32).reshape(2, 3, 4),
        "q8": gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0),
    }
    for name, data in tensors.items():
        raw = gguf.GGMLQuantizationType.Q8_0 if name == "q8" else None
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, tensors


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("gguf") / "synthetic.gguf")


@pytest.fixture(scope="module")
def embedded(real_source):
    """The embedded model read by both readers (gguf-py's takes tens of seconds: once per module)."""
    return GGUFFile(real_source.path), gguf.GGUFReader(str(real_source.path), "r")


def check_same_tensors(ours, theirs):
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type, a.name
        assert list(a.shape) == b.shape.tolist(), a.name
        assert (a.n_elements, a.n_bytes, a.data_offset) == (b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert isinstance(a.data, np.memmap) and not a.data.flags.writeable, a.name
        assert a.data.tobytes() == b.data.tobytes(), a.name


# ------------------------------------------------------------------ the embedded model, against gguf-py

@pytest.mark.slow
def test_every_kept_field_of_the_embedded_model_is_what_gguf_py_reads(embedded):
    ours, theirs = embedded
    assert list(ours.fields) == list(theirs.fields)  # the same keys, in file order (GGUF.* included)
    for key, f in theirs.fields.items():
        if len(f.data) <= KEEP_ARRAYS_UP_TO:
            assert ours.field(key) == f.contents(), key
            assert type(ours.field(key)) is type(f.contents()), key
    assert ours.data_offset == theirs.data_offset and ours.alignment == theirs.alignment


@pytest.mark.slow
def test_every_tensor_of_the_embedded_model_has_gguf_py_s_name_type_shape_and_bytes(embedded):
    ours, theirs = embedded
    check_same_tensors(ours, theirs)
    assert len({id(t.data.base) for t in ours.tensors}) == 1  # views of one map, not a map per tensor


@pytest.mark.slow
def test_the_vocabulary_arrays_are_skipped_and_read_as_the_default(embedded, real_source):
    ours, theirs = embedded
    assert ours.skipped == VOCABULARY_ARRAYS
    assert all(len(theirs.fields[k].data) > KEEP_ARRAYS_UP_TO for k in ours.skipped)
    for key in VOCABULARY_ARRAYS:
        assert ours.fields[key] is SKIPPED
        assert ours.field(key) is None and ours.field(key, "default") == "default"
        assert real_source.field(key, "default") == "default"  # as GGUFSource.field documents
    assert ours.field("no.such.key", 7) == 7


# ------------------------------------------------------------------ a synthetic file, every kind of value

def test_every_scalar_type_reads_back_as_written(synthetic):
    path, _ = synthetic
    f = GGUFFile(path)
    for key, value, vtype in SCALARS:
        got = f.field(key)
        assert type(got) is type(value), key
        assert got == (float(np.float32(value)) if vtype == T.FLOAT32 else value), key
    assert f.field("general.architecture") == "llama" and f.version == 3


def test_arrays_read_back_as_written_and_nested_arrays_stay_nested(synthetic):
    path, _ = synthetic
    f = GGUFFile(path)
    for key, value, _ in ARRAYS:
        assert f.field(key) == value, key
    assert f.field("test.after_the_arrays") == "still read"


def test_arrays_longer_than_the_limit_are_skipped_and_what_follows_is_still_read(synthetic):
    path, _ = synthetic
    f = GGUFFile(path, keep_arrays_up_to=10)
    assert f.skipped == {"test.long_words", "test.long_ints"}
    assert f.field("test.long_words") is None and f.field("test.long_ints", ()) == ()
    assert f.field("test.words") == ["a", "", "ünï", "<|eot_id|>"]
    assert f.field("test.nested") == [[1, 2], [3], [4, 5, 6]]
    assert f.field("test.after_the_arrays") == "still read"
    assert GGUFFile(path, keep_arrays_up_to=5).skipped == {"test.long_words", "test.long_ints", "test.nested"}


def test_tensors_are_where_the_files_own_alignment_puts_them(synthetic):
    path, tensors = synthetic
    f = GGUFFile(path)
    assert f.alignment == ALIGNMENT and f.field("general.alignment") == ALIGNMENT
    assert all(t.data_offset % ALIGNMENT == 0 for t in f.tensors) and f.data_offset % ALIGNMENT == 0
    for name, data in tensors.items():
        t = f.tensor(name)
        assert t.data.dtype == data.dtype and np.array_equal(t.data, data), name
    assert f.tensor("q8").tensor_type == gguf.GGMLQuantizationType.Q8_0 and f.tensor("q8").shape == (64, 4)
    assert f.tensor("i32").shape == (4, 3, 2) and f.tensor("missing") is None
    check_same_tensors(f, gguf.GGUFReader(str(path), "r"))


# ------------------------------------------------------------------ files it cannot read

@pytest.mark.parametrize("where", ["empty", "in the magic", "in the version", "in the metadata",
                                   "in the tensor infos", "in the last tensor"])
def test_a_truncated_file_is_a_model_load_error(synthetic, tmp_path, where):
    path, _ = synthetic
    data, whole = path.read_bytes(), GGUFFile(path)
    last = whole.tensors[-1]
    last_info = data.rfind(last.name.encode(), 0, whole.data_offset)  # its name, in the tensor infos
    cut = {"empty": 0, "in the magic": 3, "in the version": 6, "in the metadata": 200,
           "in the tensor infos": last_info + 1, "in the last tensor": last.data_offset + last.n_bytes - 1}[where]
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        GGUFFile(bad)


def test_a_bad_magic_is_a_model_load_error(synthetic, tmp_path):
    path, _ = synthetic
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + path.read_bytes()[4:])
    with pytest.raises(ModelLoadError, match="magic"):
        GGUFFile(bad)


def test_an_unknown_version_is_a_model_load_error(synthetic, tmp_path):
    path, _ = synthetic
    bad = tmp_path / "v9.gguf"
    bad.write_bytes(b"GGUF" + struct.pack("<I", 9) + path.read_bytes()[8:])
    with pytest.raises(ModelLoadError, match="version 9"):
        GGUFFile(bad)


def test_a_big_endian_file_is_refused_by_name(tmp_path):
    path, _ = write_synthetic(tmp_path / "be.gguf", endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(ModelLoadError, match="big-endian"):
        GGUFFile(path)


def test_a_corrupt_length_is_an_error_not_an_allocation(synthetic, tmp_path):
    path, _ = synthetic
    data = bytearray(path.read_bytes())
    data[24:32] = struct.pack("<Q", 2**62)  # the first metadata key's length
    bad = tmp_path / "long.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="truncated"):
        GGUFFile(bad)


def test_an_alignment_that_is_not_a_power_of_two_is_refused(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "llama")
    w.add_uint32("general.alignment", 48)
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="power of two"):
        GGUFFile(tmp_path / "a.gguf")


def test_gguf_source_reports_an_unreadable_file_as_a_model_load_error(synthetic, tmp_path):
    path, _ = synthetic
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        GGUFSource(bad)
