"""ckpt.save_file / ckpt.load_file and the reader as a read-only Mapping."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest
from conftest import assert_bit_exact, every_dtype_tensors, TESTS

import ckpt

FIXTURES = os.path.join(TESTS, "fixtures", "foreign")


@pytest.mark.parametrize("ext", [".h5", ".msgpack"])
def test_save_file_load_file_round_trip_every_dtype(tmp_path, ext):
    tensors = dict(every_dtype_tensors())
    path = ckpt.save_file(tensors, tmp_path / "new" / f"plain{ext}", metadata={"epoch": 3})
    assert path == str(tmp_path / "new" / f"plain{ext}")
    loaded = ckpt.load_file(path)
    assert list(loaded) == list(tensors) or sorted(loaded) == sorted(tensors)
    for key, value in tensors.items():
        assert_bit_exact(value, loaded[key])
    with ckpt.load_checkpoint(path) as reader:
        assert reader.metadata == {"epoch": 3} and reader.verify() == []  # checksummed like any save
    assert not os.path.exists(os.path.join(tmp_path, "new", "checkpoint"))  # no state file


def test_save_file_safetensors_and_python_values(tmp_path):
    path = ckpt.save_file({"a/b": [1.5, 2.5], "n": 3, "big": np.arange(6, dtype=np.int64).reshape(2, 3)},
                          str(tmp_path / "m.safetensors"))
    loaded = ckpt.load_file(path)
    assert loaded["a/b"].dtype == np.float64 and loaded["n"].dtype == np.int64  # numpy's types, as safetensors
    np.testing.assert_array_equal(loaded["big"], np.arange(6).reshape(2, 3))


def test_save_file_keeps_python_floats_exact(tmp_path):
    # float32 would store 0.1 inexactly and 1e300 as inf (with numpy's overflow warning, an error here)
    path = ckpt.save_file({"lr": 0.1, "big": 1e300, "steps": 2**40, "flag": True}, str(tmp_path / "m.msgpack"))
    loaded = ckpt.load_file(path)
    assert loaded["lr"] == 0.1 and loaded["big"] == 1e300 and loaded["steps"] == 2**40
    assert [loaded[k].dtype for k in ("lr", "big", "steps", "flag")] == [np.float64, np.float64, np.int64, np.bool_]
    with pytest.raises(TypeError, match=r"m.h5: tensor 'n': integer value .* does not fit in 64 bits"):
        ckpt.save_file({"n": 2**70}, str(tmp_path / "m.h5"))


def test_load_file_reads_foreign_files_and_directories(tmp_path):
    for name in ("st.safetensors", "torch_state.pt", "flax_state.msgpack", "keras3.weights.h5",
                 "keras3_model.keras", "keras_legacy_model.h5", "tf1_saver", "tf2_object"):
        path = os.path.join(FIXTURES, name)
        with ckpt.load_checkpoint(path) as reader:
            expected = {key: reader.get_tensor(key) for key in reader}
        loaded = ckpt.load_file(path)
        assert list(loaded) == list(expected)
        for key in expected:
            assert_bit_exact(expected[key], loaded[key])
    saved = ckpt.Saver({"w": ckpt.Variable([1, 2])}).save(str(tmp_path / "run" / "m.h5"), global_step=1)
    assert list(ckpt.load_file(tmp_path / "run")) == ["w"]  # a directory: its latest checkpoint
    assert saved.endswith("m-1.h5")


def test_save_file_is_atomic_and_refuses_bad_input(tmp_path):
    path = str(tmp_path / "m.msgpack")
    ckpt.save_file({"w": np.ones(2)}, path)
    before = pathlib.Path(path).read_bytes()
    with pytest.raises(ValueError, match="invalid key"):
        ckpt.save_file({"a//b": np.ones(1)}, path)
    with pytest.raises(TypeError, match="tensor 'when'"):
        ckpt.save_file({"when": np.array(["2020-01-01"], dtype="datetime64[D]")}, path)
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="ckpt writes no '.npz' files; use .*\\.msgpack"):
        ckpt.save_file({"w": np.ones(2)}, str(tmp_path / "m.npz"))
    with pytest.raises(ValueError, match="metadata"):
        ckpt.save_file({"w": np.ones(2)}, path, metadata={"f": object()})
    assert pathlib.Path(path).read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["m.msgpack"]  # no temporary file left behind


def test_load_file_verifies_checksums(tmp_path):
    path = ckpt.save_file({"w": np.arange(64, dtype=np.float32)}, str(tmp_path / "m.h5"))
    raw = bytearray(pathlib.Path(path).read_bytes())
    offset = raw.rindex(np.arange(64, dtype=np.float32).tobytes())
    raw[offset + 10] ^= 0x40
    pathlib.Path(path).write_bytes(raw)
    with pytest.raises(ckpt.CorruptCheckpointError, match="'w'.*checksum"):
        ckpt.load_file(path)


def test_reader_is_a_read_only_mapping(tmp_path, monkeypatch):
    from collections.abc import Mapping

    path = ckpt.save_file({"enc/w": np.ones((2, 2)), "enc/b": np.zeros(2)}, str(tmp_path / "m.msgpack"))
    with ckpt.load_checkpoint(path) as reader:
        assert isinstance(reader, Mapping)
        reads = []
        real = reader._reader.read
        monkeypatch.setattr(reader._reader, "read", lambda key: (reads.append(key), real(key))[1])
        assert len(reader) == 2 and list(reader) == ["enc/w", "enc/b"] and list(reader.keys()) == list(reader)
        assert "enc/w" in reader and "enc" not in reader and 5 not in reader
        assert reads == []  # the index answers these; no tensor was read
        np.testing.assert_array_equal(reader["enc/w"], np.ones((2, 2)))
        assert reads == ["enc/w"]
        with pytest.raises(KeyError, match="enc/b"):  # a KeyNotFoundError naming the closest key
            reader["enc/bb"]
        assert reader.get("nope") is None
        with pytest.raises(TypeError):
            reader["x"] = np.ones(1)
        with ckpt.load_checkpoint(path) as other:
            assert reader == reader and reader != other
        assert {k: v.shape for k, v in reader.items()} == {"enc/w": (2, 2), "enc/b": (2,)}
