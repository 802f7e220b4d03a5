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
from ckpt.formats.incremental import IncrementalReader
from incremental_support import cut, flip, keys_reading, remove, stored_at

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


def _chunk(data: bytes, index: int) -> bytes:
    """The name of chunk ``index`` of a tensor's bytes ``data``."""
    return hashlib.sha256(data[index * CHUNK:(index + 1) * CHUNK]).digest()


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


@pytest.mark.parametrize("damage", ["flip", "cut_before", "cut_inside", "pack_missing"])
def test_a_damaged_chunk_in_the_middle_of_a_big_group_names_its_tensor_and_file(tmp_path: object,
                                                                                 damage: str) -> None:
    """A byte flipped in d's third chunk, its pack cut just before it or inside it, or its pack
    deleted: the read names d (the first tensor in order that lost bytes) and where the chunk was;
    every tensor that lost none still reads, every one that lost some fails naming itself."""
    path = _save(str(tmp_path))
    chunk = _chunk(_values()["d"].tobytes(), 2)  # d's third chunk: mid-group
    pack, offset, length = stored_at(path, chunk)
    if damage == "flip":
        flip(path, chunk, mask=1)
        lost = {"d"}
    elif damage == "pack_missing":
        remove(path, chunk)
        lost = keys_reading(path, pack)  # every numeric tensor: one save wrote one pack
        assert lost == {"a", "b", "c", "d", "g"}
    else:
        cut(path, chunk, keep=0 if damage == "cut_before" else length // 2)
        lost = keys_reading(path, pack, past=offset)  # d, and what the pack holds after its third chunk
        assert min(lost) == "d"
    with pytest.raises(CorruptCheckpointError, match=f"'{min(lost)}'") as info:
        _read_all(path, 1 << 20)  # every chunk in one group
    assert info.value.key == min(lost) and info.value.path == path
    if damage != "flip":  # a file of the right length with a wrong byte fails the tensor's crc32c
        assert f"of the pack {pack})" in str(info.value)
        assert chunk.hex() in str(info.value) or damage == "pack_missing"
        assert ("is missing" if damage == "pack_missing" else "is truncated: the file ends at byte") in str(info.value)
    with ckpt.load_checkpoint(path) as reader:  # the tensors around it still read
        for key, value in _values().items():
            if key in lost:
                with pytest.raises(CorruptCheckpointError, match=f"'{key}'"):
                    reader[key]
            elif not dtypes.is_string(np.asarray(value).dtype):
                assert reader[key].tobytes() == np.asarray(value).tobytes(), key


@pytest.mark.parametrize("group_chunks", [1, 4, 1000])
def test_the_first_damaged_tensor_in_order_is_the_one_raised(tmp_path: object, group_chunks: int) -> None:
    path = _save(str(tmp_path))
    values = _values()
    pack = cut(path, _chunk(values["d"].tobytes(), 4))  # d: its last chunk missing, later in the read
    assert "b" not in keys_reading(path, pack, past=os.path.getsize(pack))
    flip(path, _chunk(values["b"].tobytes(), 1), count=2)  # b: wrong bytes, earlier
    with pytest.raises(CorruptCheckpointError, match="'b'") as info:
        _read_all(path, group_chunks * CHUNK)
    assert info.value.key == "b"
