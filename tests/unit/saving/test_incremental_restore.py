"""Restores of incremental checkpoints read their chunks a group at a time, each group's crc32c
values computed while the next group is read: bit-exact across chunk and group boundaries, and
a damaged chunk anywhere in a group still names its tensor (and its file), the first in order."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

import ckpt
from ckpt import dtypes
from ckpt.errors import CorruptCheckpointError
from ckpt.formats.base import open_reader
from ckpt.formats.incremental import CHUNK_DIR, IncrementalReader

CHUNK = 4096


def _values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    return {  # in key order: what a read in order meets
        "a": rng.standard_normal(2500).astype(np.float32),  # 2.44 chunks
        "b": rng.integers(-9, 9, (3, CHUNK // 8), dtype=np.int64),  # exactly 3 chunks
        "c": rng.standard_normal(1000).astype(dtypes.bfloat16),  # under one chunk
        "d": rng.standard_normal((33, 77)).astype(np.float64),  # 4.96 chunks
        "e": np.zeros((0, 4), np.float32),
        "f": np.array([b"x", b"", b"yz"], dtype=dtypes.string),
        "g": np.float64(7.25),
    }


def _save(directory: str) -> str:
    variables = {k: ckpt.Variable(v, name=k) for k, v in _values().items()}
    saver = ckpt.Saver(variables, format="msgpack", incremental=True, chunk_bytes=CHUNK, max_chain=0)
    return saver.save(os.path.join(directory, "m.msgpack"))


def _read_all(path: str, group_bytes: int) -> dict[str, np.ndarray]:
    with open_reader(path) as reader:
        assert isinstance(reader, IncrementalReader)
        reader.group_bytes = group_bytes
        outs = {k: np.empty(reader.info(k).shape, reader.info(k).dtype) for k in sorted(reader.tensors)}
        reader.read_into_many(list(outs.items()))
        return outs


def _chunk_file(directory: str, data: bytes, index: int) -> str:
    piece = data[index * CHUNK:(index + 1) * CHUNK]
    return os.path.join(directory, CHUNK_DIR, hashlib.sha256(piece).hexdigest())


@pytest.mark.parametrize("group_chunks", [1, 2, 3, 5, 1000])
def test_a_batch_is_bit_exact_across_chunk_and_group_boundaries(tmp_path: object, group_chunks: int) -> None:
    path = _save(str(tmp_path))
    got = _read_all(path, group_chunks * CHUNK)
    for key, want in _values().items():
        want = np.asarray(want)
        assert got[key].dtype == want.dtype and got[key].shape == want.shape, key
        if dtypes.is_string(want.dtype):
            assert got[key].tolist() == want.tolist()
        else:
            assert got[key].tobytes() == want.tobytes(), key


@pytest.mark.parametrize("damage", ["flip", "missing", "longer"])
def test_a_damaged_chunk_in_the_middle_of_a_big_group_names_its_tensor_and_file(tmp_path: object,
                                                                                 damage: str) -> None:
    path = _save(str(tmp_path))
    chunk = _chunk_file(str(tmp_path), _values()["d"].tobytes(), 2)  # d's third chunk: mid-group
    if damage == "missing":
        os.remove(chunk)
    else:
        with open(chunk, "r+b") as f:
            f.seek(0, os.SEEK_END if damage == "longer" else os.SEEK_SET)
            f.write(b"\x00" if damage == "longer" else bytes([f.read(1)[0] ^ 1]))
    with pytest.raises(CorruptCheckpointError, match="'d'") as info:
        _read_all(path, 1 << 20)  # every chunk in one group
    assert info.value.key == "d" and info.value.path == path
    if damage != "flip":  # a file of the right length with a wrong byte fails the tensor's crc32c
        assert chunk in str(info.value)
    with ckpt.load_checkpoint(path) as reader:  # the tensors around it still read
        assert reader["b"].tobytes() == _values()["b"].tobytes()
        assert reader["g"] == 7.25


@pytest.mark.parametrize("group_chunks", [1, 4, 1000])
def test_the_first_damaged_tensor_in_order_is_the_one_raised(tmp_path: object, group_chunks: int) -> None:
    path = _save(str(tmp_path))
    values = _values()
    os.remove(_chunk_file(str(tmp_path), values["d"].tobytes(), 4))  # d: missing, later in the read
    with open(_chunk_file(str(tmp_path), values["b"].tobytes(), 1), "r+b") as f:  # b: wrong bytes, earlier
        f.write(b"\xff\xff")
    with pytest.raises(CorruptCheckpointError, match="'b'") as info:
        _read_all(path, group_chunks * CHUNK)
    assert info.value.key == "b"
