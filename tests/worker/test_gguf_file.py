"""GGUFFile against gguf-py's GGUFReader: the same metadata, tensor table and tensor bytes."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest

from core_engine.common.gguf_file import GGUFFile
from core_engine.common.model_files import default_model_path
from core_engine.worker.model_executor.gguf_loader import tensor_data


def reader_fields(reader: gguf.GGUFReader) -> dict:
    """GGUFReader's metadata without its pseudo-fields for the header (GGUF.version, ...)."""
    return {
        key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")
    }


def assert_same_as_gguf_reader(path) -> None:
    ours, reader = GGUFFile(path), gguf.GGUFReader(path)
    assert ours.fields == reader_fields(reader)
    assert [(t.name, t.dims, t.type_id, t.data_offset) for t in ours.tensors] == [
        (t.name, tuple(int(n) for n in t.shape), int(t.tensor_type), t.data_offset)
        for t in reader.tensors
    ]
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    for info, tensor in zip(ours.tensors, reader.tensors, strict=True):
        data = tensor_data(mapped, info)
        assert data.dtype == tensor.data.dtype and data.shape == tensor.data.shape
        assert np.array_equal(data, tensor.data, equal_nan=True)


@pytest.fixture
def every_kind_of_gguf(tmp_path):
    """A GGUF with every scalar value type, string and array fields, a non-default alignment,
    and float, integer and quantized tensors."""
    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.25)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.5])
    writer.add_array("t.strings", ["a", "", "Ġthe", "日本"])
    writer.add_array("t.bools", [True, False])
    writer.add_array("t.empty", [])
    writer.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    q8 = gguf.quants.quantize(
        rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0
    )
    writer.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_value_type_and_tensor_kind_reads_as_gguf_reader_reads_it(every_kind_of_gguf):
    assert_same_as_gguf_reader(every_kind_of_gguf)
    ours = GGUFFile(every_kind_of_gguf)
    assert ours.field("t.str") == "héllo ✓" and ours.field("t.bool") is True
    assert ours.field("t.u64") == 2**63 + 5 and ours.field("t.missing", 7) == 7
    assert all(info.data_offset % 64 == 0 for info in ours.tensors)


def test_the_default_model_reads_as_gguf_reader_reads_it():
    assert_same_as_gguf_reader(default_model_path())


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.gguf"):
        GGUFFile(tmp_path / "nothing.gguf")


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"", "cannot mmap an empty file"),
        (b"GGML" + bytes(20), "it starts with b'GGML', not b'GGUF'"),
        (b"GGUF" + (7).to_bytes(4, "little") + bytes(16), "version 7 is not supported"),
    ],
)
def test_files_that_are_not_gguf_are_named_with_the_problem(tmp_path, content, problem):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(
        ValueError, match=rf"bad.gguf.*not a readable GGUF file: {re.escape(problem)}"
    ):
        GGUFFile(path)


def test_a_file_cut_anywhere_in_its_header_is_refused(every_kind_of_gguf, tmp_path):
    whole = every_kind_of_gguf.read_bytes()
    header_bytes = GGUFFile(every_kind_of_gguf).tensors[0].data_offset
    cut = tmp_path / "cut.gguf"
    for length in range(8, header_bytes - 64, 7):  # the tensor table ends before the padding
        cut.write_bytes(whole[:length])
        with pytest.raises(ValueError, match="not a readable GGUF file"):
            GGUFFile(cut)


def test_tensor_bytes_past_the_end_of_the_file_are_named(every_kind_of_gguf):
    ours = GGUFFile(every_kind_of_gguf)
    mapped = np.memmap(every_kind_of_gguf, dtype=np.uint8, mode="r")
    last = ours.tensors[-1]
    with pytest.raises(ValueError, match=f"tensor '{last.name}' needs bytes up to"):
        tensor_data(mapped[: last.data_offset + 10], last)
