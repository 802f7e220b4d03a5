"""Pack files (index version 3): a local incremental save writes its chunks into one pack, the index
places them, readers read them as byte ranges, retention keeps a pack while any kept checkpoint
places a chunk in it, sparse packs are compacted, hostile pack tables are refused."""

from __future__ import annotations

import errno
import hashlib
import os
import zlib
from typing import Any

import fsspec
import numpy as np
import pytest

import ckpt
from ckpt.checksums import crc32c
from ckpt.errors import CheckpointWriteError, CorruptCheckpointError
from ckpt.formats import _codec, _io
from ckpt.formats.base import open_reader
from ckpt.formats.incremental import CHUNK_DIR, FORMAT_NAME, IncrementalReader
from ckpt.saving import packs
from ckpt.storage.localfile import LocalFolder
from ckpt.storage.objfolder import RemoteFolder
from ckpt.storage.objstore import MemoryStore

CHUNK = 64 << 10


def _saver(v: dict[str, ckpt.Variable], **kw: Any) -> ckpt.Saver:
    return ckpt.Saver(v, incremental=True, chunk_bytes=CHUNK, **kw)


def _reader(path: str) -> IncrementalReader:
    reader = open_reader(path)
    assert isinstance(reader, IncrementalReader)
    return reader


def _files(directory: str) -> set[str]:
    return set(os.listdir(os.path.join(directory, CHUNK_DIR)))


def _packs_of(path: str) -> set[str]:
    with _reader(path) as reader:
        return {f.hex() for key in reader.tensors for f in reader.files_of(key)}


def test_a_save_writes_its_chunks_into_one_pack_that_the_index_tiles(tmp_path: Any) -> None:
    rng = np.random.default_rng(0)
    v = {"big": ckpt.Variable(rng.standard_normal(3 << 20).astype(np.float32)),  # 12 MiB: the I/O threads
         "small": ckpt.Variable(rng.standard_normal(1000)),
         "text": ckpt.Variable(np.array([b"a", b"bc"], dtype=ckpt.dtypes.string))}
    d = str(tmp_path)
    path = _saver(v).save(os.path.join(d, "m.msgpack"), global_step=1)
    [pack] = _files(d)
    assert len(pack) == 32  # a 16-byte id, not a chunk's digest
    size = os.path.getsize(os.path.join(d, CHUNK_DIR, pack))
    with _reader(path) as reader:
        assert reader.version == 3
        spans = sorted((offset, length) for p, offset, length in reader.located.values())
        assert {p.hex() for p, _, _ in reader.located.values()} == {pack}
        names = {n for key in ("big", "small") for n in reader.chunks_of(key)}
        assert set(reader.located) == names  # every chunk placed, nothing else
        for key in ("big", "small"):
            for name in reader.chunks_of(key):
                where, offset, length = reader.stored_at(name)
                assert where == os.path.join(d, CHUNK_DIR, pack) and length is not None
                with open(where, "rb") as f:
                    f.seek(offset)
                    assert hashlib.sha256(f.read(length)).digest() == name
        assert reader.read("big").tobytes() == v["big"].numpy().tobytes()
        assert list(reader.read("text")) == [b"a", b"bc"]
    assert [o for o, _ in spans] == list(np.cumsum([0] + [n for _, n in spans])[:-1])  # back to back
    assert sum(n for _, n in spans) == size
    assert ckpt.verify(path).ok


def test_a_later_save_packs_only_the_chunks_that_changed(tmp_path: Any) -> None:
    rng = np.random.default_rng(1)
    v = {"frozen": ckpt.Variable(rng.standard_normal(40 * CHUNK // 8)),
         "head": ckpt.Variable(rng.standard_normal(3 * CHUNK // 4).astype(np.float32))}
    d = str(tmp_path)
    saver = _saver(v, max_chain=0)
    first = saver.save(os.path.join(d, "m.msgpack"), global_step=1)
    v["head"].assign(rng.standard_normal(v["head"].shape).astype(np.float32))
    second = saver.save(os.path.join(d, "m.msgpack"), global_step=2)
    stats = saver.last_incremental
    assert stats is not None and stats.chunks_written == 3 and stats.bytes_written == 3 * CHUNK
    [new_pack] = _files(d) - _packs_of(first)
    assert os.path.getsize(os.path.join(d, CHUNK_DIR, new_pack)) == 3 * CHUNK
    with _reader(first) as a, _reader(second) as b:
        assert {b.stored_at(n) for n in b.chunks_of("frozen")} == {a.stored_at(n) for n in a.chunks_of("frozen")}
        assert b.read("head").tobytes() == v["head"].numpy().tobytes()


def test_retention_keeps_a_pack_while_a_kept_checkpoint_places_a_chunk_in_it(tmp_path: Any) -> None:
    rng = np.random.default_rng(2)
    v = {"frozen": ckpt.Variable(rng.standard_normal(8 * CHUNK // 8)),
         "head": ckpt.Variable(rng.standard_normal(CHUNK // 8))}
    d = str(tmp_path)
    saver = _saver(v, max_to_keep=2, max_chain=0)
    paths, placed = [], []
    for step in range(5):
        v["head"].assign(rng.standard_normal(v["head"].shape))
        paths.append(saver.save(os.path.join(d, "m.msgpack"), global_step=step))
        placed.append(_packs_of(paths[-1]))
    assert len(placed[0]) == 1 and placed[0] <= placed[4]  # the frozen chunks, still placed in the first pack
    assert _files(d) == placed[3] | placed[4] == placed[0] | (placed[3] - placed[0]) | (placed[4] - placed[0])
    assert len(_files(d)) == 3  # the packs of saves 1 and 2 (their heads only) are gone
    for path in paths[3:]:
        assert ckpt.verify(path).ok


def test_a_pack_mostly_dropped_is_compacted_and_then_collected(tmp_path: Any) -> None:
    """The first pack holds one frozen chunk and nine head chunks; once the checkpoints holding the
    head's first version are dropped, under half of it is referenced: the next save writes the frozen
    chunk again into its own pack, and once no kept checkpoint places it in the first pack, that pack
    is deleted."""
    rng = np.random.default_rng(3)
    v = {"frozen": ckpt.Variable(rng.standard_normal(CHUNK // 8)),
         "head": ckpt.Variable(rng.standard_normal(9 * CHUNK // 8))}
    d = str(tmp_path)
    saver = _saver(v, max_to_keep=1, max_chain=0)
    paths = [saver.save(os.path.join(d, "m.msgpack"), global_step=0)]
    [first] = _packs_of(paths[0])
    written = []
    for step in range(1, 4):
        v["head"].assign(rng.standard_normal(v["head"].shape))
        paths.append(saver.save(os.path.join(d, "m.msgpack"), global_step=step))
        stats = saver.last_incremental
        assert stats is not None
        written.append(stats.chunks_written)
    # save 1: the head (9 chunks), frozen still in the first pack (all of it referenced before the save);
    # save 2: the first pack is 1/10 referenced: the frozen chunk is written again (10 chunks)
    assert written == [9, 10, 9]
    assert first not in _files(d)
    assert _files(d) == _packs_of(paths[-1])
    with ckpt.load_checkpoint(paths[-1]) as reader:
        assert reader["frozen"].tobytes() == v["frozen"].numpy().tobytes()
        assert reader["head"].tobytes() == v["head"].numpy().tobytes()


def test_a_save_that_cannot_write_its_pack_leaves_nothing_and_the_previous_checkpoint(tmp_path: Any,
                                                                                      monkeypatch: Any) -> None:
    rng = np.random.default_rng(4)
    v = {"w": ckpt.Variable(rng.standard_normal(6 * CHUNK // 8))}
    d = str(tmp_path)
    saver = _saver(v)
    first = saver.save(os.path.join(d, "m.msgpack"), global_step=1)
    before = _files(d)
    v["w"].assign(rng.standard_normal(v["w"].shape))

    def full_disk(*args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(packs, "pwrite_all", full_disk)
    with pytest.raises(CheckpointWriteError, match="No space left on device") as info:
        saver.save(os.path.join(d, "m.msgpack"), global_step=2)
    assert info.value.path == os.path.join(d, "m-2.msgpack")
    assert _files(d) == before  # no pack, no temporary
    assert ckpt.latest_checkpoint(d) == first and ckpt.verify(first).ok


def test_a_damaged_or_truncated_pack_fails_the_tensors_that_read_it_naming_pack_and_bytes(tmp_path: Any) -> None:
    rng = np.random.default_rng(5)
    v = {"b": ckpt.Variable(rng.standard_normal(10)), "a": ckpt.Variable(rng.standard_normal(2 * CHUNK // 8))}
    d = str(tmp_path)
    path = _saver(v).save(os.path.join(d, "m.msgpack"), global_step=1)
    with _reader(path) as reader:
        name = reader.chunks_of("a")[1]
        pack, offset, length = reader.stored_at(name)
        b_end = max(o + n for o, n in (reader.stored_at(c)[1:] for c in reader.chunks_of("b")))
    assert length == CHUNK
    with open(pack, "r+b") as f:
        f.seek(offset + 5)
        byte = f.read(1)
        f.seek(offset + 5)
        f.write(bytes([byte[0] ^ 1]))
    with ckpt.load_checkpoint(path) as reader:
        with pytest.raises(CorruptCheckpointError, match="'a'") as info:
            reader["a"]
        assert info.value.key == "a"
        [problem] = reader.verify()
        assert f"its chunk {name.hex()} (bytes {offset}-{offset + length} of the pack {pack}) does not match" in problem
        assert reader["b"].tobytes() == v["b"].numpy().tobytes()
    assert offset > b_end  # b is saved first: cut the pack inside a's second chunk, b still reads
    os.truncate(pack, offset + 10)
    with ckpt.load_checkpoint(path) as reader:
        with pytest.raises(CorruptCheckpointError, match=f"its chunk {name.hex()} .* is truncated: the file ends "
                                                         f"at byte {offset + 10}"):
            reader["a"]
        assert reader["b"].tobytes() == v["b"].numpy().tobytes()
    os.remove(pack)
    with ckpt.load_checkpoint(path) as reader:
        for key in ("a", "b"):
            with pytest.raises(CorruptCheckpointError, match=f"'{key}': its chunk .* is missing"):
                reader[key]


def _index_with_packs(d: str, table: Any, chunk_bytes: int = CHUNK) -> str:
    value = np.arange(10, dtype=np.float32)
    name = hashlib.sha256(value.tobytes()).digest()
    index = _codec.packb({"format": FORMAT_NAME, "version": 3, "metadata": {}, "chunk_dir": CHUNK_DIR,
                          "chunk_bytes": chunk_bytes, "hash": "sha256", "packs": table,
                          "tensors": {"w": ["float32", [10], _io.crc32c(value.tobytes()), [name]]}})
    path = os.path.join(d, "hostile.msgpack")
    with open(path, "wb") as f:
        f.write(_codec.packb([{"format": FORMAT_NAME, "version": 3}, index, _io.crc32c(index)]))
    return path


_NAME, _PACK = b"n" * 32, b"p" * 16


@pytest.mark.parametrize("table,problem", [
    ({}, "a dict, not a list"),
    ([[b"short", []]], "not \\[16-byte id, members\\]"),
    ([[_PACK]], "not \\[16-byte id, members\\]"),
    ([[_PACK, [[_NAME, 0]]]], "is not \\[chunk name, offset, length\\]"),
    ([[_PACK, [[b"x" * 31, 0, 4]]]], "is not \\[chunk name, offset, length\\]"),
    ([[_PACK, [[_NAME, -1, 4]]]], "at offset -1"),
    ([[_PACK, [[_NAME, 0, 0]]]], "0 bytes long"),
    ([[_PACK, [[_NAME, 0, CHUNK + 1]]]], f"{CHUNK + 1} bytes long"),
    ([[_PACK, [[_NAME, 0, 4], [_NAME, 8, 4]]]], "is placed twice"),
    ([[_PACK, [[_NAME, 1.5, 4]]]], "is not \\[chunk name, offset, length\\]"),
])
def test_a_malformed_pack_table_is_refused_naming_the_file(tmp_path: Any, table: Any, problem: str) -> None:
    path = _index_with_packs(str(tmp_path), table)
    with pytest.raises(CorruptCheckpointError, match=f"pack table is malformed: .*{problem}") as info:
        ckpt.load_checkpoint(path)
    assert info.value.path == path and path in str(info.value)


def test_a_pack_table_placing_a_chunk_past_the_pack_end_is_damage_not_a_crash(tmp_path: Any) -> None:
    d = str(tmp_path)
    value = np.arange(10, dtype=np.float32)
    name = hashlib.sha256(value.tobytes()).digest()
    os.makedirs(os.path.join(d, CHUNK_DIR))
    with open(os.path.join(d, CHUNK_DIR, _PACK.hex()), "wb") as f:
        f.write(value.tobytes())
    path = _index_with_packs(d, [[_PACK, [[name, 1 << 40, 40]]]])
    with ckpt.load_checkpoint(path) as reader:
        with pytest.raises(CorruptCheckpointError, match="'w': its chunk .* is truncated"):
            reader["w"]
    good = _index_with_packs(d, [[_PACK, [[name, 0, 40]]]])
    with ckpt.load_checkpoint(good) as reader:
        assert reader["w"].tobytes() == value.tobytes()


def test_a_directory_of_version_2_chunk_files_is_reused_by_a_new_save(tmp_path: Any) -> None:
    """Chunk files of their own (what versions 1 and 2 wrote) count as present: a new save of the
    same values writes no pack and references them as files."""
    d = str(tmp_path)
    value = np.arange(3 * CHUNK // 4, dtype=np.float32)
    raw = memoryview(value.tobytes())
    names = [hashlib.sha256(raw[i:i + CHUNK]).digest() for i in range(0, len(raw), CHUNK)]
    os.makedirs(os.path.join(d, CHUNK_DIR))
    for i, name in enumerate(names):
        with open(os.path.join(d, CHUNK_DIR, name.hex()), "wb") as f:
            f.write(raw[i * CHUNK:(i + 1) * CHUNK])
    saver = _saver({"w": ckpt.Variable(value.copy())})
    path = saver.save(os.path.join(d, "m.msgpack"), global_step=1)
    assert saver.last_incremental is not None and saver.last_incremental.chunks_written == 0
    assert _files(d) == {n.hex() for n in names}
    with _reader(path) as reader:
        assert reader.located == {} and reader.read("w").tobytes() == value.tobytes()
        assert reader.stored_at(names[0]) == (os.path.join(d, CHUNK_DIR, names[0].hex()), 0, None)


def _ranges_case(rng: np.random.Generator, size: int) -> list[tuple[str, int, int]]:
    """Ranges of files 'x' and 'y': runs of neighbours, gaps, out of order."""
    asked = []
    for name in ("x", "y"):
        offset = 0
        while offset < size:
            length = int(rng.integers(1, 300_000))
            if rng.random() < 0.8:
                asked.append((name, offset, min(length, size - offset)))
            offset += length + (int(rng.integers(1, 5000)) if rng.random() < 0.3 else 0)
    order = rng.permutation(len(asked))
    return [asked[i] for i in order]


@pytest.mark.parametrize("seed", range(3))
def test_local_range_reads_fill_every_view_and_checksum_it(tmp_path: Any, seed: int) -> None:
    rng = np.random.default_rng(seed)
    size = 6 << 20  # the batch is past BIG: pieces on the workers
    data = {name: rng.integers(0, 256, size, dtype=np.uint8).tobytes() for name in ("x", "y")}
    for name, blob in data.items():
        with open(os.path.join(str(tmp_path), name), "wb") as f:
            f.write(blob)
    asked = _ranges_case(rng, size)
    views = [memoryview(bytearray(n)) for _, _, n in asked]
    folder = LocalFolder(str(tmp_path))
    answers = folder.read_ranges([(name, offset, view) for (name, offset, _), view in zip(asked, views)])
    folder.close()
    for (name, offset, n), view, (problem, crc) in zip(asked, views, answers):
        assert problem is None and bytes(view) == data[name][offset:offset + n] and crc == crc32c(view)


def test_local_range_reads_name_a_missing_file_and_a_short_one(tmp_path: Any) -> None:
    with open(os.path.join(str(tmp_path), "x"), "wb") as f:
        f.write(b"0123456789")
    folder = LocalFolder(str(tmp_path))
    a, b, c = (memoryview(bytearray(n)) for n in (4, 4, 3))
    answers = folder.read_ranges([("x", 2, a), ("x", 8, b), ("gone", 0, c)])
    assert answers[0] == (None, crc32c(b"2345")) and bytes(a) == b"2345"
    assert answers[1] == ("is truncated: the file ends at byte 10, before byte 12", None)
    assert answers[2] == ("is missing", None)
    folder.close()


def test_remote_range_reads_are_ranged_gets(tmp_path: Any) -> None:
    root = f"memory://packs-{zlib.crc32(str(tmp_path).encode())}"
    store = MemoryStore(root)
    store.put(f"{root}/c/x", b"0123456789", create_only=True)
    folder = RemoteFolder(store, f"{root}/c")
    a, b, c = (memoryview(bytearray(n)) for n in (4, 4, 3))
    answers = folder.read_ranges([("x", 2, a), ("x", 8, b), ("gone", 0, c)])
    assert answers[0] == (None, None) and bytes(a) == b"2345"
    assert answers[1] == ("is truncated: the object ends at byte 10, before byte 12", None)
    assert answers[2] == ("is missing", None)
    fsspec.filesystem("memory").rm(root, recursive=True)


def test_a_pack_is_synced_while_it_is_written_not_only_at_the_end(tmp_path: Any, monkeypatch: Any) -> None:
    """Every SYNC_BYTES appended, the writer that crosses the mark syncs the pack (fdatasync) while
    the others go on, so the disk writes beside the hashing; the final fsync is still made."""
    synced: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(packs, "SYNC_BYTES", 4 * CHUNK)

    def recording(fd: int) -> None:
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", recording)
    rng = np.random.default_rng(6)
    v = {"w": ckpt.Variable(rng.standard_normal(64 * CHUNK // 8))}  # 4 MiB: the I/O threads
    path = _saver(v).save(os.path.join(str(tmp_path), "m.msgpack"), global_step=1)
    # one pack, synced along the way (at least at the first mark: a writer crossing one while a sync runs
    # leaves it to the next)
    assert 1 <= len(synced) <= 16 and len(set(synced)) == 1
    with ckpt.load_checkpoint(path) as reader:
        assert reader["w"].tobytes() == v["w"].numpy().tobytes()
    monkeypatch.setattr(packs, "SYNC_BYTES", None)
    synced.clear()
    v["w"].assign(rng.standard_normal(v["w"].shape))
    _saver(v).save(os.path.join(str(tmp_path), "m.msgpack"), global_step=2)
    assert synced == []


def test_a_chunk_compacted_into_a_new_pack_is_not_written_again_while_the_old_pack_lives(tmp_path: Any) -> None:
    """After a compaction two kept indexes place the frozen chunk in two packs, the old one sparse:
    the next save finds it in the new one (whichever index it reads last: step 9 sorts after 10)."""
    rng = np.random.default_rng(7)
    v = {"frozen": ckpt.Variable(rng.standard_normal(CHUNK // 8)),
         "head": ckpt.Variable(rng.standard_normal(9 * CHUNK // 8))}
    d = str(tmp_path)
    saver = _saver(v, max_to_keep=2, max_chain=0)
    written = []
    for step in range(7, 13):
        v["head"].assign(rng.standard_normal(v["head"].shape))
        saver.save(os.path.join(d, "m.msgpack"), global_step=step)
        stats = saver.last_incremental
        assert stats is not None
        written.append(stats.chunks_written)
    # 7: everything; 8, 9: the head; 10: the first pack is 1/10 referenced: frozen written again; then the head
    assert written == [10, 9, 9, 10, 9, 9]
    for step in (11, 12):
        assert ckpt.verify(os.path.join(d, f"m-{step}.msgpack")).ok
