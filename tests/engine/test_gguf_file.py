"""engine/model/gguf_file.py reads what the `gguf` package's reader reads: every metadata
value and every tensor's bytes, shape and type, on the embedded model and on a file written
with every value type; a damaged file is refused naming what is wrong."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from pdserve.engine.errors import ModelLoadError
from pdserve.engine.model.gguf_file import GGUFFile, GGUFFormatError
from pdserve.engine.model.weights import open_gguf
from tests.models import smollm2_gguf_path


def _assert_same_as_gguf_reader(path: str) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    fields = {name: f for name, f in theirs.fields.items() if not name.startswith("GGUF.")}
    assert set(ours.metadata) == set(fields)
    for name, field in fields.items():
        assert ours.metadata[name] == field.contents(), name
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(b.shape.tolist()), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
    return ours


def test_the_embedded_model_reads_as_the_gguf_package_reads_it():
    ours = _assert_same_as_gguf_reader(smollm2_gguf_path())
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    assert {t.tensor_type.name for t in ours.tensors} >= {"Q4_1", "Q8_0", "F32"}


def _write_every_type(path: str, alignment: int = 64) -> None:
    w = gguf.GGUFWriter(path, "llama")
    w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1.5)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", -2.25)
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, -1.0])
    w.add_array("t.strs", ["a", "", "ü"])
    w.add_array("t.bools", [True, False])
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("plain32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("plain16", rng.standard_normal((2, 7)).astype(np.float16))
    w.add_tensor("ints", np.arange(6, dtype=np.int32).reshape(2, 3))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("quant", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_file_with_every_value_type_reads_as_the_gguf_package_reads_it(tmp_path):
    path = str(tmp_path / "every.gguf")
    _write_every_type(path)
    ours = _assert_same_as_gguf_reader(path)
    assert ours.metadata["t.str"] == "héllo ✓" and ours.metadata["t.strs"] == ["a", "", "ü"]
    assert ours.metadata["t.u64"] == 2**63 + 5 and ours.metadata["general.alignment"] == 64
    quant = next(t for t in ours.tensors if t.name == "quant")
    assert gguf.quants.dequantize(quant.data, quant.tensor_type).shape == (4, 64)


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:len(b) // 3], "truncated"),
    (lambda b: b"GGUX" + b[4:], "bad magic"),
    (lambda b: b[:4] + (7).to_bytes(4, "little") + b[8:], "version 7"),
])
def test_a_damaged_file_is_refused_naming_what_is_wrong(tmp_path, damage, message):
    good = tmp_path / "good.gguf"
    _write_every_type(str(good))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage(good.read_bytes()))
    with pytest.raises(GGUFFormatError, match=message):
        GGUFFile(str(bad))
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        open_gguf(str(bad))


def test_a_tensor_that_runs_past_the_end_is_refused(tmp_path):
    path = tmp_path / "short.gguf"
    _write_every_type(str(path))
    quant = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "quant")
    path.write_bytes(path.read_bytes()[:quant.data_offset + quant.n_bytes - 1])  # its last byte gone
    with pytest.raises(GGUFFormatError, match="quant.*past the file's end"):
        GGUFFile(str(path))
