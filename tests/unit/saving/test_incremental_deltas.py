"""Delta chunks of incremental saves (issue 28): a changed chunk stored as its XOR with its previous
version, chains bounded by max_chain and cut by full_every, kept alive by retention, damage
named; compression of whole chunks; version 1 indexes still read."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
import pytest

import ckpt
from ckpt import dtypes
from ckpt.errors import CorruptCheckpointError
from ckpt.formats import _codec, _io
from ckpt.formats.base import open_reader
from ckpt.formats._chunkcodec import links
from ckpt.formats.incremental import CHUNK_DIR, FORMAT_NAME, IncrementalReader
from incremental_support import (as_version_2, cut, flip, keys_reading, problem_keys, referenced_files, store_files,
                                 stored_at)

CHUNK = 4096


def _vars(rng: np.random.Generator) -> dict[str, ckpt.Variable]:
    return {
        "f32": ckpt.Variable(rng.standard_normal((64, 100)).astype(np.float32), name="f32"),  # 6.25 chunks
        "f64": ckpt.Variable(rng.standard_normal(CHUNK // 8 * 2), name="f64"),  # exactly two chunks
        "bf": ckpt.Variable(rng.standard_normal(3001).astype(dtypes.bfloat16), name="bf"),
        "i16": ckpt.Variable(rng.integers(-500, 500, 5000, dtype=np.int16), name="i16"),
        "u8": ckpt.Variable(rng.integers(0, 255, 9000, dtype=np.uint8), name="u8"),
        "c64": ckpt.Variable((rng.standard_normal(700) + 1j).astype(np.complex64), name="c64"),
        "flags": ckpt.Variable(rng.random(5000) < 0.5, name="flags"),
        "small": ckpt.Variable(rng.standard_normal(10).astype(np.float32), name="small"),  # under a chunk
        "scalar": ckpt.Variable(np.float64(2.5), name="scalar"),
        "empty": ckpt.Variable(np.zeros((0, 3), np.int32), name="empty"),
        "text": ckpt.Variable(np.array([b"a", b"", b"xyz"], dtype=dtypes.string), name="text"),
    }


def _touch(v: dict[str, ckpt.Variable], rng: np.random.Generator) -> None:
    """Change a few elements of every numeric tensor (a sparse update: deltas pay)."""
    for var in v.values():
        value = var.numpy().copy()
        if value.dtype.kind in "OSU" or value.size == 0:
            continue
        flat = value.reshape(-1)
        at = rng.choice(flat.size, max(1, flat.size // 200), replace=False)
        flat[at] = flat[(at + 1) % flat.size] if value.dtype != bool else ~flat[at]
        var.assign(value)


def _entries(path: str) -> dict[str, list[Any]]:
    with open(path, "rb") as f:
        _, packed, _ = _codec.unpack(f.read(), path, "the file")
    return dict(_codec.unpack(packed, path, "the index")["tensors"])


def _chains(path: str) -> list[int]:
    """The delta count of every numeric chunk reference of the checkpoint ``path``."""
    return [len(ref) - 1 if isinstance(ref, list) else 0
            for name, _, _, refs in _entries(path).values() if name != "string" for ref in refs]


def _save_steps(d: str, steps: int, seed: int, **kw: Any) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    v = _vars(rng)
    saver = ckpt.Saver(v, format="msgpack", incremental=True, chunk_bytes=CHUNK, **kw)
    saved = {}
    for step in range(steps):
        if step:
            _touch(v, rng)
        path = saver.save(os.path.join(d, "m.msgpack"), global_step=step)
        saved[path] = {k: var.numpy().copy() for k, var in v.items()}
    return saved


def _assert_restores(path: str, want: dict[str, np.ndarray]) -> None:
    with ckpt.load_checkpoint(path) as got:
        for key, value in want.items():
            assert got[key].dtype == value.dtype and got[key].shape == value.shape
            assert got[key].tobytes() == value.tobytes() if value.dtype.kind != "O" else list(got[key]) == list(value)
        assert np.array_equal(got.get_slice("f32", np.s_[3:5, 10:20]), want["f32"][3:5, 10:20])
    assert ckpt.verify(path).ok


def test_every_dtype_round_trips_through_delta_chains(tmp_path: Any) -> None:
    saved = _save_steps(str(tmp_path), 6, seed=0, max_to_keep=None, max_chain=3)
    for path, want in saved.items():
        _assert_restores(path, want)
    paths = list(saved)
    assert min(_chains(paths[1])[:-2]) == 1, "the sparse changes were not stored as deltas"  # bar small, scalar
    assert max(_chains(paths[3])) == 3 and max(max(_chains(p)) for p in paths) == 3


def test_deltas_write_a_fraction_of_the_changed_chunks(tmp_path: Any) -> None:
    rng = np.random.default_rng(3)
    table = ckpt.Variable(rng.standard_normal((2048, 64)).astype(np.float32), name="table")  # 128 chunks
    saver = ckpt.Saver({"t": table}, format="msgpack", incremental=True, chunk_bytes=CHUNK)
    saver.save(os.path.join(str(tmp_path), "m.msgpack"), global_step=0)
    value = table.numpy().copy()
    value[rng.choice(2048, 20, replace=False)] += 0.01  # 1% of rows: most chunks change
    table.assign(value)
    saver.save(os.path.join(str(tmp_path), "m.msgpack"), global_step=1)
    stats = saver.last_incremental
    assert stats is not None and stats.chunks_written >= 15
    assert stats.bytes_written < 0.05 * value.nbytes


def test_chains_stop_at_max_chain_and_at_full_every(tmp_path: Any) -> None:
    bounded = _save_steps(str(tmp_path / "bound"), 8, seed=1, max_to_keep=None, max_chain=2)
    assert max(max(_chains(p)) for p in bounded) == 2
    for path, want in bounded.items():
        _assert_restores(path, want)
    never = _save_steps(str(tmp_path / "never"), 3, seed=1, max_to_keep=None, max_chain=0)
    assert all(max(_chains(p)) == 0 for p in never)
    cut = _save_steps(str(tmp_path / "cut"), 6, seed=1, max_to_keep=None, full_every=3)
    paths = list(cut)
    assert max(_chains(paths[2])) == 1  # save 1 wrote whole chunks, save 2 deltas on them
    assert max(_chains(paths[4])) == 0  # save 3 was self-contained: save 4 starts again
    for path, want in cut.items():
        _assert_restores(path, want)


def test_retention_keeps_every_base_a_kept_checkpoint_reaches(tmp_path: Any) -> None:
    d = str(tmp_path)
    saved = _save_steps(d, 6, seed=2, max_to_keep=1, max_chain=8)
    [(path, want)] = [(p, w) for p, w in saved.items() if os.path.exists(p)]
    assert max(_chains(path)) == 5  # its chains reach chunks written by checkpoints retention dropped
    _assert_restores(path, want)
    with open_reader(path) as reader:
        assert isinstance(reader, IncrementalReader)
        closure = {c for key in reader.tensors for c in reader.chunks_of(key)}
        files = {f.hex() for key in reader.tensors for f in reader.files_of(key)}
    # the store holds exactly the files the chains' chunks are in, packs written by dropped saves too
    assert {os.path.basename(stored_at(path, c)[0]) for c in closure} == files
    assert store_files(d) == files == referenced_files(d, [os.path.basename(path)]) and len(files) > 1


def _bf_base(path: str) -> bytes:
    """The whole chunk the first delta chain of tensor 'bf' in checkpoint ``path`` rests on."""
    bf_refs = _entries(path)["bf"][3]
    assert isinstance(bf_refs[0], list)
    return links(bf_refs[0])[-1]


def test_a_damaged_base_fails_every_tensor_that_reaches_it_and_nothing_else(tmp_path: Any) -> None:
    d = str(tmp_path)
    saved = _save_steps(d, 3, seed=4, max_to_keep=None, max_chain=4)
    first, _, last = list(saved)
    base = _bf_base(last)  # written by the first save
    flip(last, base, at=100)
    for path in (first, last):
        with ckpt.load_checkpoint(path) as reader:
            with pytest.raises(CorruptCheckpointError, match="'bf'") as info:
                reader["bf"]
            assert info.value.key == "bf" and info.value.path == path
            for key in saved[path]:
                if key != "bf":
                    assert reader[key].tobytes() == saved[path][key].tobytes() or key == "text"
        problems = ckpt.verify(path).problems
        assert len(problems) == 1 and "'bf'" in problems[0] and base.hex() in problems[0] and "damaged" in problems[0]


def test_a_damaged_previous_version_is_not_a_delta_base(tmp_path: Any) -> None:
    """A save never encodes against bytes that are not what the chain names: it writes whole."""
    d = str(tmp_path)
    rng = np.random.default_rng(5)
    v = _vars(rng)
    saver = ckpt.Saver(v, format="msgpack", incremental=True, chunk_bytes=CHUNK)
    saver.save(os.path.join(d, "m.msgpack"), global_step=0)
    [f64_first, _] = _entries(os.path.join(d, "m-0.msgpack"))["f64"][3]
    flip(os.path.join(d, "m-0.msgpack"), f64_first, at=0, mask=1)
    _touch(v, rng)
    path = saver.save(os.path.join(d, "m.msgpack"), global_step=1)
    assert isinstance(_entries(path)["f64"][3][0], bytes)  # written whole
    with ckpt.load_checkpoint(path) as reader:
        assert reader["f64"].tobytes() == v["f64"].numpy().tobytes()


def _a_save_after_damage_writes_whole(d: str, last: str, saved: dict[str, dict[str, np.ndarray]]) -> str:
    """A new Saver (no kept bases) reads previous versions back from the damaged store: it writes
    whole what it cannot read, and its checkpoint restores."""
    rng = np.random.default_rng(9)
    v = _vars(rng)
    v["bf"].assign(saved[last]["bf"])
    saver = ckpt.Saver(v, format="msgpack", incremental=True, chunk_bytes=CHUNK, max_to_keep=None, max_chain=4)
    _touch(v, rng)
    path = saver.save(os.path.join(d, "m.msgpack"), global_step=2)
    with ckpt.load_checkpoint(path) as reader:
        assert reader["bf"].tobytes() == v["bf"].numpy().tobytes()
    return path


def test_a_pack_cut_short_in_a_chunk_is_damage_named_by_restore_and_verify(tmp_path: Any) -> None:
    d = str(tmp_path)
    saved = _save_steps(d, 2, seed=4, max_to_keep=None, max_chain=4)
    last = list(saved)[-1]
    base = _bf_base(last)
    _, offset, _ = stored_at(last, base)
    pack = cut(last, base, keep=10)
    lost = keys_reading(last, pack, past=offset + 10)  # bf, and the tensors placed after it in the pack
    with ckpt.load_checkpoint(last) as reader:
        with pytest.raises(CorruptCheckpointError, match=f"'bf'.*{base.hex()}.*of the pack {pack}\\) is truncated"):
            reader["bf"]
        for key in set(saved[last]) - lost - {"text"}:
            assert reader[key].tobytes() == saved[last][key].tobytes()
    problems = ckpt.verify(last).problems
    assert "bf" in lost and problem_keys(problems) == lost and all("truncated" in p for p in problems)
    assert any("'bf'" in p and base.hex() in p for p in problems)
    after = _a_save_after_damage_writes_whole(d, last, saved)
    assert ckpt.verify(after).ok  # the chunks the cut lost were written again, not referenced


def test_an_oversized_chunk_file_is_damage_and_is_never_read_whole(tmp_path: Any) -> None:
    """A chunk stored as a file of its own (version 2, still read) longer than any chunk (damaged or
    hostile: here a sparse 64 GiB file) is not read into memory: restore and verify name the tensor
    and the file, and the next save writes whole."""
    d = str(tmp_path)
    saved = _save_steps(d, 2, seed=4, max_to_keep=None, max_chain=4)
    last = list(saved)[-1]
    as_version_2(last)
    base = _bf_base(last)
    assert stored_at(last, base)[0] == os.path.join(d, CHUNK_DIR, base.hex())  # a file of its own
    os.truncate(os.path.join(d, CHUNK_DIR, base.hex()), 1 << 36)
    with ckpt.load_checkpoint(last) as reader:
        with pytest.raises(CorruptCheckpointError, match=f"'bf'.*{base.hex()}.*holds more than {CHUNK} bytes"):
            reader["bf"]
        assert reader["f64"].tobytes() == saved[last]["f64"].tobytes()
    problems = ckpt.verify(last).problems
    assert len(problems) == 1 and "'bf'" in problems[0] and base.hex() in problems[0]
    _a_save_after_damage_writes_whole(d, last, saved)


def test_compression_combines_with_incremental_saves(tmp_path: Any) -> None:
    d = str(tmp_path)
    rng = np.random.default_rng(6)
    w = ckpt.Variable((rng.standard_normal(CHUNK * 3) * 0.02).astype(dtypes.bfloat16), name="w")
    path = ckpt.Saver({"w": w}, format="msgpack", incremental=True, chunk_bytes=CHUNK,
                      compression="zstd").save(os.path.join(d, "m.msgpack"))
    refs = _entries(path)["w"][3]
    raw = w.numpy().tobytes()
    for i, ref in enumerate(refs):
        assert ref == hashlib.sha256(raw[i * CHUNK:(i + 1) * CHUNK]).digest()  # named by the uncompressed bytes
        assert stored_at(path, ref)[2] < 0.9 * CHUNK  # its bytes in the pack
    with ckpt.load_checkpoint(path) as reader:
        assert reader["w"].tobytes() == w.numpy().tobytes()
    assert ckpt.verify(path).ok


def test_version_1_indexes_still_read(tmp_path: Any) -> None:
    d = str(tmp_path)
    value = np.arange(3000, dtype=np.float32)
    raw = memoryview(value).cast("B")
    chunks = [hashlib.sha256(raw[i:i + CHUNK]).digest() for i in range(0, len(raw), CHUNK)]
    os.makedirs(os.path.join(d, CHUNK_DIR))
    for i, c in enumerate(chunks):
        with open(os.path.join(d, CHUNK_DIR, c.hex()), "wb") as f:
            f.write(raw[i * CHUNK:(i + 1) * CHUNK])
    index = _codec.packb({"format": FORMAT_NAME, "version": 1, "metadata": {}, "chunk_dir": CHUNK_DIR,
                          "chunk_bytes": CHUNK, "hash": "sha256",
                          "tensors": {"w": ["float32", [3000], _io.crc32c(raw), chunks]}})
    path = os.path.join(d, "old.msgpack")
    with open(path, "wb") as f:
        f.write(_codec.packb([{"format": FORMAT_NAME, "version": 1}, index, _io.crc32c(index)]))
    with ckpt.load_checkpoint(path) as reader:
        assert reader["w"].tobytes() == value.tobytes()
    assert ckpt.verify(path).ok
