"""The incremental save's hot path: large tensors' chunks hashed, encoded, written and read side by
side; deltas against the bytes the Saver kept from its previous save (no read-back); chunks
rewritten wholesale skip the delta attempt for a few saves; damage is still named."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

import ckpt
from ckpt.errors import CorruptCheckpointError
from ckpt.formats import _codec, _io
from ckpt.formats._chunkcodec import (PARALLEL_BYTES, RETRY_AFTER, ChunkEncoding, _private, assemble, chain_of,
                                      digest, links)
from ckpt.formats.incremental import CHUNK_DIR, tensor_entry
from incremental_support import flip, store_files, stored_at

CHUNK = 64 << 10


def _model(rng: np.random.Generator) -> dict[str, ckpt.Variable]:
    big = PARALLEL_BYTES // 4 + 12345  # float32: over the parallel threshold, a short last chunk
    return {
        "big": ckpt.Variable(rng.standard_normal(big).astype(np.float32), name="big"),
        "zeros": ckpt.Variable(np.zeros(PARALLEL_BYTES // 8 + CHUNK // 8, np.float64), name="zeros"),  # one chunk, repeated
        "small": ckpt.Variable(rng.standard_normal(3000).astype(np.float32), name="small"),
    }


def _touch(v: dict[str, ckpt.Variable], rng: np.random.Generator) -> None:
    """A sparse update of "big" and "small" (deltas pay); "zeros" stays."""
    for key in ("big", "small"):
        value = v[key].numpy().copy()
        at = rng.choice(value.size, max(1, value.size // 500), replace=False)
        value[at] += 1.0
        v[key].assign(value)


def _save_steps(d: str, steps: int, seed: int, **kw: Any) -> tuple[ckpt.Saver, dict[str, dict[str, bytes]]]:
    rng = np.random.default_rng(seed)
    v = _model(rng)
    saver = ckpt.Saver(v, format="msgpack", incremental=True, chunk_bytes=CHUNK, **kw)
    saved = {}
    for step in range(steps):
        if step:
            _touch(v, rng)
        path = saver.save(os.path.join(d, "m.msgpack"), global_step=step)
        saved[path] = {k: var.numpy().tobytes() for k, var in v.items()}
    return saver, saved


def _refs(path: str, key: str) -> list[Any]:
    """The chunk references of ``key`` in the index file ``path``."""
    with open(path, "rb") as f:
        _, packed, _ = _codec.unpack(f.read(), path, "the file")
    return list(_codec.unpack(packed, path, "the index")["tensors"][key][3])


def test_large_tensors_round_trip_bit_exact_through_chains_built_side_by_side(tmp_path: Any) -> None:
    saver, saved = _save_steps(str(tmp_path), 7, seed=0, max_to_keep=None, max_chain=4)
    for path, want in saved.items():
        with ckpt.load_checkpoint(path) as reader:
            for key, value in want.items():
                assert reader[key].tobytes() == value
        assert ckpt.verify(path).ok
    last = list(saved)[-1]
    assert max(len(chain_of(r)) - 1 for p in saved for r in _refs(p, "big")) == 4  # chains grew to max_chain
    assert len(set(_refs(last, "zeros"))) == 1  # one chunk, referenced by every position
    stats = saver.last_incremental
    # every save, a quarter of the chains (max_chain=4) restart whole in turn, the rest are deltas
    assert stats is not None and 0 < stats.bytes_written < (1 / 4 + 0.1) * len(saved[last]["big"])


def test_repeated_chunks_of_one_save_are_written_once(tmp_path: Any) -> None:
    v = {"zeros": ckpt.Variable(np.zeros(PARALLEL_BYTES // 4 * 2, np.float32), name="zeros")}
    saver = ckpt.Saver(v, format="msgpack", incremental=True, chunk_bytes=CHUNK)
    path = saver.save(os.path.join(str(tmp_path), "m.msgpack"))
    stats = saver.last_incremental
    assert stats is not None and (stats.chunks_written, stats.bytes_written) == (1, CHUNK)
    [pack] = store_files(str(tmp_path))  # one pack holding the one chunk once
    assert stored_at(path, _refs(path, "zeros")[0]) == (os.path.join(str(tmp_path), CHUNK_DIR, pack), 0, CHUNK)
    assert os.path.getsize(os.path.join(str(tmp_path), CHUNK_DIR, pack)) == CHUNK


class _Store:
    """A chunk store in memory that counts read-backs."""

    def __init__(self) -> None:
        self.files: dict[bytes, bytes] = {}
        self.gets = 0

    def put(self, name: bytes, data: bytes | memoryview) -> None:
        self.files.setdefault(name, bytes(data))

    def get(self, name: bytes, limit: int) -> bytes:
        self.gets += 1
        return self.files[name][:limit + 1]

    def entry(self, value: np.ndarray, previous: list[Any] | None, recall: dict[bytes, Any],
              note: dict[bytes, Any]) -> list[Any]:
        encoding = ChunkEncoding(lambda name: name in self.files, self.get, None, 8, recall)
        return tensor_entry(value, CHUNK, self.put, encoding, previous, note)

    def read(self, entry: list[Any], like: np.ndarray) -> np.ndarray:
        out = np.empty_like(like)
        view = _io.byte_view(out)
        for i, ref in enumerate(entry[3]):
            assemble(lambda name: memoryview(self.files[name]), ref, view[i * CHUNK:(i + 1) * CHUNK], "test")
        return out


@pytest.mark.parametrize("size", [CHUNK // 4 * 3, PARALLEL_BYTES // 4 + 100])  # one by one; side by side
def test_deltas_rest_on_the_kept_bytes_without_reading_back(size: int) -> None:
    rng = np.random.default_rng(1)
    store, value = _Store(), rng.standard_normal(size).astype(np.float32)
    entry, notes = store.entry(value, None, {}, {}), {}  # the first save: nothing to note
    gets = []
    for _ in range(4):
        value[rng.choice(size, size // 300, replace=False)] += 1.0
        before, fresh, last = store.gets, {}, entry
        entry = store.entry(value, entry, notes, fresh)
        notes = fresh
        gets.append(store.gets - before)
        assert store.read(entry, value).tobytes() == value.tobytes()
        assert entry[2] == _io.crc32c(value.tobytes())
        assert all(isinstance(ref, list) for ref in entry[3])  # every chunk changed (or not): all deltas
        changed = {chain_of(ref)[0] for ref, was in zip(entry[3], last[3]) if ref != was}
        assert len(changed) >= len(entry[3]) - 1 and set(notes) == changed  # the short last one may not
        assert all(digest(kept) == name for name, kept in notes.items())
    assert gets[0] > 0 and gets[1:] == [0, 0, 0]  # read back once (nothing noted yet), then never


def test_chunks_rewritten_wholesale_skip_the_delta_attempt_then_retry() -> None:
    rng = np.random.default_rng(2)
    store, value = _Store(), rng.standard_normal(CHUNK // 4 * 2).astype(np.float32)
    entry, notes = store.entry(value, None, {}, {}), {}
    gets = []
    for _ in range(RETRY_AFTER + 2):
        value[:] = rng.standard_normal(value.size)  # every byte new: a delta never pays
        before, fresh = store.gets, {}
        entry = store.entry(value, entry, notes, fresh)
        notes = fresh
        gets.append(store.gets - before)
        assert all(isinstance(ref, bytes) for ref in entry[3])  # written whole
        assert store.read(entry, value).tobytes() == value.tobytes()
    assert gets[0] == 2 and gets[1:-1] == [0] * RETRY_AFTER and gets[-1] == 2


def test_unchanged_tensors_keep_their_checksum_and_chain() -> None:
    store, value = _Store(), np.arange(CHUNK // 2, dtype=np.float32)
    first = store.entry(value, None, {}, {})
    value[0] = -1.0
    second = store.entry(value, first, {}, {})
    third = store.entry(value, second, {}, {})
    assert third == second and third[2] == _io.crc32c(value.tobytes())


def test_a_note_never_holds_bytes_its_digest_does_not_name() -> None:
    assert _private(memoryview(b"abc"), digest(b"abc")) == b"abc"
    assert _private(memoryview(b"abc"), digest(b"abd")) is None


def test_a_base_damaged_after_it_was_noted_is_named_by_restore_and_verify(tmp_path: Any) -> None:
    """The save encodes against the bytes it kept (right by construction) and references the base
    file by name, as it references unchanged chunks: damage to it fails that tensor's restore,
    naming the file, and never yields wrong values."""
    d = str(tmp_path)
    rng = np.random.default_rng(3)
    v = _model(rng)
    saver = ckpt.Saver(v, format="msgpack", incremental=True, chunk_bytes=CHUNK, max_to_keep=None)
    for step in range(2):
        _touch(v, rng)
        saver.save(os.path.join(d, "m.msgpack"), global_step=step)
    ref = _refs(os.path.join(d, "m-1.msgpack"), "big")[40]
    assert isinstance(ref, list)
    delta = links(ref)[0]  # the delta save 1 wrote for chunk 40
    pack = flip(os.path.join(d, "m-1.msgpack"), delta, at=5, mask=0x10)
    _touch(v, rng)
    path = saver.save(os.path.join(d, "m.msgpack"), global_step=2)
    assert links(ref)[0] in links(_refs(path, "big")[40])  # chunk 40's new delta rests on it
    with ckpt.load_checkpoint(path) as reader:
        with pytest.raises(CorruptCheckpointError, match="'big'") as info:
            reader["big"]
        assert info.value.key == "big" and info.value.path == path
        assert reader["small"].tobytes() == v["small"].numpy().tobytes()
    problems = ckpt.verify(path).problems
    assert len(problems) == 1 and "'big'" in problems[0] and f"{delta.hex()} (bytes " in problems[0]
    assert f"of the pack {pack})" in problems[0]


def test_a_restore_reads_a_batch_of_tensors_side_by_side_and_names_the_first_damaged(tmp_path: Any) -> None:
    d = str(tmp_path)
    rng = np.random.default_rng(4)
    n = PARALLEL_BYTES // 4 // 3  # each below the parallel threshold, together above it
    v = {f"t{i}": ckpt.Variable(rng.standard_normal(n).astype(np.float32), name=f"t{i}") for i in range(4)}
    want = {k: var.numpy().copy() for k, var in v.items()}
    saver = ckpt.Saver(v, format="msgpack", incremental=True, chunk_bytes=CHUNK)
    path = saver.save(os.path.join(d, "m.msgpack"))
    for var in v.values():
        var.assign(np.zeros(n, np.float32))
    saver.restore(path)
    assert all(v[k].numpy().tobytes() == want[k].tobytes() for k in v)
    for key in ("t2", "t3"):  # damage a chunk of each of the last two tensors
        flip(path, _refs(path, key)[3], count=2)
    with pytest.raises(CorruptCheckpointError) as info:
        saver.restore(path)
    assert str(info.value).startswith(f"{path}: tensor 't2'")  # the first in order, though t3's read too


def test_an_object_store_save_builds_chains_side_by_side_on_the_kept_bytes(monkeypatch: Any) -> None:
    from ckpt.storage.objfolder import RemoteFolder

    root = f"memory://hotpath-{os.getpid()}-{np.random.default_rng().integers(1 << 30)}"
    rng = np.random.default_rng(5)
    v = _model(rng)
    saver = ckpt.Saver(v, format="msgpack", incremental=True, chunk_bytes=CHUNK, max_to_keep=None, max_chain=4)
    reads = []
    whole = RemoteFolder.read_whole
    monkeypatch.setattr(RemoteFolder, "read_whole", lambda self, names, limit: reads.append(len(names)) or whole(self, names, limit))
    saved, read_back = {}, []
    for step in range(4):
        if step:
            _touch(v, rng)
        before = len(reads)
        path = saver.save(f"{root}/m.msgpack", global_step=step)
        read_back.append(len(reads) - before)
        saved[path] = {k: var.numpy().tobytes() for k, var in v.items()}
    assert read_back[2:] == [0, 0]  # from the second delta on, every base is a kept copy
    for path, want in saved.items():
        with ckpt.load_checkpoint(path) as reader:
            assert all(reader[key].tobytes() == value for key, value in want.items())
    with ckpt.load_checkpoint(path) as reader:
        chains = [len(chain_of(ref)) for ref in reader.tensors["big"].extra.chunks]
    assert max(chains) == 4  # deltas on deltas (the first save's chunks are the bases' bases)
