"""safetensors: the real file safetensors wrote, ckpt's own files, and files that break the rules."""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import struct

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_bit_exact, TESTS

import ckpt
from ckpt.formats import base

FIXTURES = os.path.join(TESTS, "fixtures", "foreign")
FIXTURE = os.path.join(FIXTURES, "st.safetensors")


def build(path, tensors, metadata=None, header=None, tail=b""):
    """A safetensors file by the spec: tensors is [(key, code, shape, raw bytes)] laid out in order."""
    spec, data = {}, b""
    if metadata is not None:
        spec["__metadata__"] = metadata
    for key, code, shape, raw in tensors:
        spec[key] = {"dtype": code, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = (header if header is not None else json.dumps(spec)).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data + tail)
    return str(path)


def test_the_file_safetensors_wrote():
    with ckpt.load_checkpoint(FIXTURE) as reader:
        assert reader.format == "safetensors"
        assert reader.metadata == {"format": "np"}
        assert not reader._reader.checksummed
        assert reader.get_variable_to_shape_map() == {"a/b": [2, 3], "h": [4], "i8": [5]}
        assert reader.get_variable_to_dtype_map() == {"a/b": np.float32, "h": np.float16, "i8": np.int8}
        raw = pathlib.Path(FIXTURE).read_bytes()
        start = 8 + struct.unpack("<Q", raw[:8])[0]  # an independent decode of the spec's layout
        assert_bit_exact(np.frombuffer(raw[start:start + 24], "<f4").reshape(2, 3), reader.get_tensor("a/b"))
        assert_bit_exact(np.frombuffer(raw[start + 24:start + 32], "<f2"), reader.get_tensor("h"))
        assert_bit_exact(np.arange(5, dtype=np.int8), reader.get_tensor("i8"))
        assert reader.verify() == []


def test_round_trip_every_dtype_with_checksums(tmp_path, tensors):
    numeric = [(k, v) for k, v in tensors if v.dtype.kind != "O" and v.dtype != np.complex128]
    path = tmp_path / "all.safetensors"
    path.touch()
    fmt = base.get_format("safetensors")
    fmt.write(str(path), numeric, {"step": 7, "nested": {"a": [1, 2.5]}})
    with base.open_reader(str(path)) as reader:
        assert reader.format_name == "safetensors" and reader.checksummed
        assert reader.metadata == {"step": 7, "nested": {"a": [1, 2.5]}}
        for key, value in numeric:
            assert_bit_exact(value, reader.read(key))
        assert reader.verify() == []
    # plain json + numpy: the header follows the spec (8-byte aligned data, contiguous offsets)
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    assert (8 + n) % 8 == 0 and header["__metadata__"]["format"] == "np"
    spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and spans[-1][1] == len(raw) - 8 - n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    f32 = header["dtypes/float32"]
    begin, end = f32["data_offsets"]
    assert f32["dtype"] == "F32" and f32["shape"] == [2, 3]
    assert raw[8 + n + begin:8 + n + end] == dict(numeric)["dtypes/float32"].tobytes()


def test_saver_saves_and_restores_safetensors(tmp_path):
    w = ckpt.Variable(np.arange(6, dtype=np.float32).reshape(2, 3), name="w")
    saver = ckpt.Saver({"fc1.weight": w})
    path = saver.save(str(tmp_path / "model.safetensors"), global_step=3)
    assert path.endswith("model-3.safetensors")
    w.assign(np.zeros((2, 3)))
    assert saver.restore(str(tmp_path)).restored == ["fc1.weight"]
    np.testing.assert_array_equal(w.numpy(), np.arange(6).reshape(2, 3))


def test_a_real_safetensors_reader_agrees(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "x.safetensors"
    path.touch()
    values = {"a": np.arange(4, dtype=np.float32), "b/c": np.ones((2, 2), np.int64)}
    base.get_format("safetensors").write(str(path), list(values.items()), {})
    loaded = safetensors_numpy.load_file(str(path))
    for key, value in values.items():
        assert_bit_exact(value, loaded[key])


def test_strings_and_complex128_are_refused_at_save(tmp_path):
    path = tmp_path / "s.safetensors"
    path.touch()
    for value in (np.array([b"x"], dtype=object), np.array([1j], dtype=np.complex128)):
        with pytest.raises(ckpt.UnsupportedCheckpointError, match="'t'.*safetensors cannot store"):
            base.get_format("safetensors").write(str(path), [("t", value)], {})


def test_bfloat16_and_float8(tmp_path):
    bf = np.array([1.5, -2.0, np.inf], dtype=ml_dtypes.bfloat16)
    f8 = np.array([0.5, -448.0], dtype=ml_dtypes.float8_e4m3fn)
    e5 = np.array([1.0, 57344.0], dtype=ml_dtypes.float8_e5m2)
    path = build(tmp_path / "f.safetensors", [("bf", "BF16", [3], bf.tobytes()), ("f8", "F8_E4M3", [2], f8.tobytes()),
                                              ("e5", "F8_E5M2", [2], e5.tobytes())])
    with ckpt.load_checkpoint(path) as reader:
        for key, value in (("bf", bf), ("f8", f8), ("e5", e5)):
            assert_bit_exact(value, reader.get_tensor(key))


def test_empty_and_scalar_tensors(tmp_path):
    path = build(tmp_path / "e.safetensors", [("s", "I32", [], struct.pack("<i", -5)), ("e", "F32", [0, 3], b"")])
    with ckpt.load_checkpoint(path) as reader:
        assert reader.get_tensor("s") == -5 and reader.get_tensor("s").shape == ()
        assert reader.get_tensor("e").shape == (0, 3)


F32x2 = ("w", "F32", [2], b"\x00" * 8)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"tensors": [F32x2], "header": '{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
      '"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'}, ckpt.CorruptCheckpointError, "duplicate key 'w'"),
    ({"tensors": [("w", "F32", [3], b"\x00" * 8)]}, ckpt.CorruptCheckpointError, r"'w': F32 \[3\] needs 12 bytes"),
    ({"tensors": [F32x2, ("v", "F32", [2], b"\x00" * 8)],
      "header": '{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
      '"v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}'}, ckpt.CorruptCheckpointError, "'v' overlaps 'w'"),
    ({"tensors": [F32x2], "header": '{"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}', "tail": b"\x00" * 4},
     ckpt.CorruptCheckpointError, "starts at 4, not at 0"),
    ({"tensors": [F32x2], "header": '{"w": {"dtype": "F32", "shape": [2], "data_offsets": [1000, 1008]}}'},
     ckpt.CorruptCheckpointError, "starts at 1000"),
    ({"tensors": [F32x2, ("v", "F32", [2], b"\x00" * 8)],
      "header": '{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
      '"v": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}}', "tail": b"\x00" * 4},
     ckpt.CorruptCheckpointError, "hole of 4 bytes after 'w'"),
    ({"tensors": [F32x2], "tail": b"junk"}, ckpt.CorruptCheckpointError, "followed by unindexed bytes"),
    ({"tensors": [F32x2], "header": '{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}   ',
      "tail": b""}, None, None),  # trailing spaces are allowed padding
    ({"tensors": [("w", "X9", [2], b"\x00" * 8)]}, ckpt.CorruptCheckpointError, "unknown dtype 'X9'"),
    ({"tensors": [("w", "F4", [2], b"\x00")]}, ckpt.UnsupportedCheckpointError, "narrower than a byte"),
    ({"tensors": [("w", "F32", [-1], b"")]}, ckpt.CorruptCheckpointError, "invalid shape"),
    ({"tensors": [("a//b", "F32", [2], b"\x00" * 8)]}, ckpt.UnsupportedCheckpointError, "'a//b' cannot be a ckpt key"),
    ({"tensors": [("../w", "F32", [2], b"\x00" * 8)]}, ckpt.UnsupportedCheckpointError, "cannot be a ckpt key"),
    ({"tensors": [F32x2], "metadata": {"step": 3}}, ckpt.CorruptCheckpointError, "strings to strings"),
    ({"tensors": [F32x2], "header": '{"w": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 8]}}'},
     ckpt.CorruptCheckpointError, "NaN is not JSON"),
])
def test_rule_breaking_files_are_refused(tmp_path, kwargs, error, message):
    path = build(tmp_path / "bad.safetensors", **kwargs)
    if error is None:
        with ckpt.load_checkpoint(path) as reader:
            assert reader.get_tensor("w").shape == (2,)
        return
    with pytest.raises(error, match=message) as info:
        ckpt.load_checkpoint(path)
    assert "bad.safetensors" in str(info.value)


def test_giant_truncated_or_odd_headers(tmp_path):
    path = tmp_path / "giant.safetensors"
    path.write_bytes(struct.pack("<Q", 10 ** 9) + b"{}")
    with pytest.raises(ckpt.CorruptCheckpointError, match="at most 100000000"):
        ckpt.load_checkpoint(str(path))
    path.write_bytes(struct.pack("<Q", 5000) + b'{"w": 1}')
    with pytest.raises(ckpt.CorruptCheckpointError, match="truncated"):
        ckpt.load_checkpoint(str(path))
    # sniffing wants "{" right after the length; the reader itself checks it too
    path.write_bytes(struct.pack("<Q", 3) + b" {}")
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="not a checkpoint in any supported format"):
        ckpt.load_checkpoint(str(path))
    with pytest.raises(ckpt.CorruptCheckpointError, match="does not start with"):
        base.get_format("safetensors").open(str(path))


def test_a_damaged_tensor_fails_ckpts_checksum(tmp_path):
    path = tmp_path / "c.safetensors"
    path.touch()
    base.get_format("safetensors").write(str(path), [("w", np.arange(4, dtype=np.float32))], {})
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x40
    path.write_bytes(bytes(raw))
    with ckpt.load_checkpoint(str(path)) as reader:
        with pytest.raises(ckpt.CorruptCheckpointError, match="'w' fails its checksum"):
            reader.get_tensor("w")
        assert len(reader.verify()) == 1
