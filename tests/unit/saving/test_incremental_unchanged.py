"""Incremental saves reuse, without hashing, the entries of Variables not written since the Saver's
previous save (ckpt/saving/unchanged.py): every writer bumps the write count, a crc32c guard catches a
write the count missed, a reused entry's chunks must still be in the store."""

from __future__ import annotations

import os
import pathlib
import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import ckpt
import ckpt.cli
import ckpt.formats
from ckpt import distributed
from ckpt.formats import _chunkcodec as inc_format  # where chunks are hashed
from incremental_support import chunks_in, cut, remove, stored_at

CHUNK = 4096
CHUNKS = ".ckpt-chunks"


def _model(seed: int = 0) -> dict[str, ckpt.Variable]:
    rng = np.random.default_rng(seed)
    return {
        "backbone/a": ckpt.Variable(rng.standard_normal((64, 100)).astype(np.float32), name="a"),  # 7 chunks
        "backbone/b": ckpt.Variable(rng.integers(0, 9, 3000, dtype=np.int64), name="b"),  # 6 chunks
        "head": ckpt.Variable(rng.standard_normal(1500).astype(np.float32), name="head"),  # 2 chunks
        "scalar": ckpt.Variable(np.float64(2.5), name="scalar"),
    }


def _saver(v: dict[str, ckpt.Variable], **kw: Any) -> ckpt.Saver:
    return ckpt.Saver(v, format="msgpack", incremental=True, chunk_bytes=CHUNK, **kw)


def _stats(saver: ckpt.Saver) -> Any:
    assert saver.last_incremental is not None
    return saver.last_incremental


def _assert_holds(path: str, v: dict[str, ckpt.Variable]) -> None:
    with ckpt.load_checkpoint(path) as got:
        for key, var in v.items():
            assert got[key].tobytes() == var.numpy().tobytes(), key
    assert ckpt.verify(path).ok


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The byte counts of every chunk SHA-256 hashed by incremental saves."""
    seen: list[int] = []
    real = inc_format.digest

    def counting(data: Any) -> bytes:
        seen.append(len(data))
        return real(data)

    monkeypatch.setattr(inc_format, "digest", counting)
    return seen


def _restore_from_other(var: ckpt.Variable, tmp: str) -> None:
    other = ckpt.Variable(np.full(var.shape, 7, var.dtype), name="other")
    path = ckpt.Saver({"x": other}).save(os.path.join(tmp, "other.h5"))
    ckpt.Saver({"x": var}).restore(path)


def _restore_cast(var: ckpt.Variable, tmp: str) -> None:
    other = ckpt.Variable(np.full(var.shape, 3, np.float64 if var.dtype.kind == "f" else np.int32), name="o")
    path = ckpt.Saver({"x": other}).save(os.path.join(tmp, "other.h5"))
    ckpt.Saver({"x": var}).restore(path, allow_cast=True)


def _restore_sharded(var: ckpt.Variable, tmp: str) -> None:
    other = ckpt.Variable(np.full(var.shape, 5, var.dtype), name="other")
    comm = distributed.local()
    path = ckpt.Saver({"x": other}, comm=comm).save(os.path.join(tmp, "sharded.msgpack"))
    ckpt.Saver({"x": var}, comm=comm).restore(path)


def _ema(var: ckpt.Variable, tmp: str) -> None:
    ema = ckpt.ExponentialMovingAverage(0.5)
    ema.apply([var])
    var.assign(var.numpy() + 1)
    shadow = ema.average(var)
    assert shadow is not None
    before = shadow._writes
    ema.apply([var])
    assert shadow._writes > before
    var.assign(shadow.numpy())


#: every public way to change a Variable's bytes
WRITERS: dict[str, Callable[[ckpt.Variable, str], None]] = {
    "assign": lambda v, tmp: v.assign(v.numpy() + 1),
    "assign_add": lambda v, tmp: v.assign_add(1),
    "assign_sub": lambda v, tmp: v.assign_sub(1),
    "initialize": lambda v, tmp: (v.assign(v.numpy() + 1), v.initialize()),  # back to the initial value
    "initialize_variables": lambda v, tmp: (v.assign(v.numpy() + 1), ckpt.initialize_variables([v])),
    "restore": _restore_from_other,
    "restore allow_cast": _restore_cast,
    "restore comm=": _restore_sharded,
    "moving average": _ema,
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_every_writer_bumps_the_write_count(writer: str, tmp_path: pathlib.Path) -> None:
    var = ckpt.Variable(np.arange(6, dtype=np.float32), name="w")
    before = var._writes
    WRITERS[writer](var, str(tmp_path))
    assert var._writes > before


def test_a_failed_restore_and_a_deferred_restore_bump_the_count(tmp_path: pathlib.Path) -> None:
    src = ckpt.Variable(np.arange(6, dtype=np.float32), name="w")
    path = ckpt.Saver({"w": src}, format="msgpack").save(os.path.join(str(tmp_path), "m.msgpack"))
    with ckpt.deferred_init():
        later = ckpt.Variable(ckpt.initializers.Zeros(), shape=(6,), name="w")
    before = later._writes
    ckpt.Saver({"w": later}).restore(path)
    assert later._writes > before and later.numpy().tolist() == list(range(6))
    data = pathlib.Path(path).read_bytes()  # damage the tensor: the restore fails after reading it in
    at = data.index(np.arange(6, dtype=np.float32).tobytes())
    pathlib.Path(path).write_bytes(data[:at] + b"\xff" + data[at + 1:])
    target = ckpt.Variable(np.zeros(6, np.float32), name="w")
    before = target._writes
    with pytest.raises(ckpt.CheckpointError):
        ckpt.Saver({"w": target}).restore(path)
    assert target._writes > before


def test_only_the_package_writes_variables_through_known_paths() -> None:
    """The writers of a Variable's buffer outside variables.py are the restore's (which bumps the
    count by _mark_restored/_mark_uninitialized): a new one must bump it too, then join this list."""
    found = set()
    for package in (ckpt, ckpt.formats, ckpt.cli):  # formats/ and cli/ are installed inside ckpt
        root = pathlib.Path(package.__file__ or "").parent
        for path in root.rglob("*.py"):
            if path.name != "variables.py" and re.search(r"\._value\b|_writable_buffer\(", path.read_text("utf-8")):
                found.add(f"{package.__name__}/{path.relative_to(root).as_posix()}")
    assert found == {"ckpt/saving/restore.py"}


def test_unchanged_variables_are_reused_without_hashing(tmp_path: pathlib.Path, hashed: list[int]) -> None:
    v = _model()
    saver = _saver(v, max_chain=0)  # deltas hash their base again: whole chunks here
    first = saver.save(os.path.join(str(tmp_path), "m.msgpack"), global_step=0)
    assert _stats(saver).tensors_reused == 0
    hashed.clear()
    v["head"].assign(v["head"].numpy() * 2)
    second = saver.save(os.path.join(str(tmp_path), "m.msgpack"), global_step=1)
    stats = _stats(saver)
    assert stats.tensors_reused == 3 and sum(hashed) == v["head"].numpy().nbytes  # only the head was hashed
    assert stats.chunks_reused == 7 + 6 + 1 and stats.chunks_written == 2
    _assert_holds(second, v)
    assert ckpt.load_variable(first, "head").tobytes() != v["head"].numpy().tobytes()
    third = saver.save(os.path.join(str(tmp_path), "m.msgpack"), global_step=2)
    assert _stats(saver).tensors_reused == 4 and _stats(saver).chunks_written == 0
    _assert_holds(third, v)


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_variable_changed_through_each_writer_is_encoded_again(writer: str, tmp_path: pathlib.Path) -> None:
    v = _model()
    saver = _saver(v)
    saver.save(os.path.join(str(tmp_path), "run", "m.msgpack"), global_step=0)
    WRITERS[writer](v["backbone/a"], str(tmp_path))
    path = saver.save(os.path.join(str(tmp_path), "run", "m.msgpack"), global_step=1)
    assert _stats(saver).tensors_reused == 3  # the other three
    _assert_holds(path, v)


def test_the_crc_guard_catches_a_write_the_count_missed(tmp_path: pathlib.Path, hashed: list[int]) -> None:
    v = _model()
    saver = _saver(v, max_chain=0)
    saver.save(os.path.join(str(tmp_path), "m.msgpack"), global_step=0)
    assert v["backbone/b"]._value is not None
    v["backbone/b"]._value[100] += 1  # a write past every counted path
    hashed.clear()
    path = saver.save(os.path.join(str(tmp_path), "m.msgpack"), global_step=1)
    assert _stats(saver).tensors_reused == 3 and sum(hashed) == v["backbone/b"].numpy().nbytes
    _assert_holds(path, v)


def test_a_reused_entry_whose_chunk_was_deleted_is_encoded_again(tmp_path: pathlib.Path) -> None:
    v = _model()
    saver = _saver(v, max_chain=0, max_to_keep=None)
    saver.save(os.path.join(str(tmp_path), "m.msgpack"), global_step=0)
    a = v["backbone/a"].numpy().copy()
    a.reshape(-1)[CHUNK // 4] += 1  # a's second chunk changes: save 1 writes it alone into its pack
    v["backbone/a"].assign(a)
    first = saver.save(os.path.join(str(tmp_path), "m.msgpack"), global_step=1)
    lost = inc_format.digest(a.reshape(-1).view(np.uint8)[CHUNK:2 * CHUNK])
    assert chunks_in(first, remove(first, lost)) == {lost}  # its pack held only that chunk
    assert not ckpt.verify(first).ok
    path = saver.save(os.path.join(str(tmp_path), "m.msgpack"), global_step=2)
    assert _stats(saver).tensors_reused == 3 and _stats(saver).chunks_written == 1
    assert os.path.exists(stored_at(path, lost)[0])  # written again, into save 2's pack
    _assert_holds(path, v)


def test_a_chunk_a_cut_pack_lost_is_written_again(tmp_path: pathlib.Path) -> None:
    """A pack cut short loses the chunks past its end, as a deleted chunk file did: the next save
    writes them again instead of committing a checkpoint that references them."""
    v = _model()
    saver = _saver(v, max_chain=0, max_to_keep=None)
    first = saver.save(os.path.join(str(tmp_path), "m.msgpack"), global_step=0)
    lost = inc_format.digest(v["backbone/a"].numpy().reshape(-1).view(np.uint8)[CHUNK:2 * CHUNK])
    cut(first, lost)
    assert not ckpt.verify(first).ok
    path = saver.save(os.path.join(str(tmp_path), "m.msgpack"), global_step=1)
    assert _stats(saver).chunks_written >= 1
    _assert_holds(path, v)


def test_a_restore_a_full_save_and_another_directory_are_not_trusted(tmp_path: pathlib.Path) -> None:
    v = _model()
    saver = _saver(v, full_every=3, max_to_keep=None)
    where = os.path.join(str(tmp_path), "run", "m.msgpack")
    first = saver.save(where, global_step=0)  # full
    saver.save(where, global_step=1)
    assert _stats(saver).tensors_reused == 0  # after a self-contained save nothing is remembered
    v["head"].assign_add(1)
    saver.save(where, global_step=2)
    assert _stats(saver).tensors_reused == 3
    saver.save(where, global_step=3)  # full
    saver.save(where, global_step=4)
    assert _stats(saver).tensors_reused == 0
    saver.save(where, global_step=5)
    assert _stats(saver).tensors_reused == 4
    saver.restore(first)  # every variable written: none is reused, the checkpoint has step 0's values
    path = saver.save(where, global_step=6)
    assert _stats(saver).tensors_reused == 0
    _assert_holds(path, v)
    elsewhere = saver.save(os.path.join(str(tmp_path), "other", "m.msgpack"), global_step=7)
    assert _stats(saver).tensors_reused == 0 and _stats(saver).chunks_written == 7 + 6 + 2 + 1
    _assert_holds(elsewhere, v)


@pytest.mark.parametrize("staging_bytes", [None, 0])
def test_async_saves_reuse_what_was_unchanged_at_their_snapshot(tmp_path: pathlib.Path,
                                                                staging_bytes: int | None) -> None:
    v = _model()
    saver = _saver(v, staging_bytes=staging_bytes)
    where = os.path.join(str(tmp_path), "m.msgpack")
    saver.save(where, global_step=0, blocking=False).result()
    snapshot = {k: x.numpy().copy() for k, x in v.items()}
    future = saver.save(where, global_step=1, blocking=False)
    v["backbone/a"].assign_add(1)  # training goes on while the save runs
    path = future.result()
    assert _stats(saver).tensors_reused == 4
    with ckpt.load_checkpoint(path) as got:
        for key, value in snapshot.items():
            assert got[key].tobytes() == value.tobytes(), key
    later = saver.save(where, global_step=2, blocking=False).result()  # the change after the snapshot counts
    assert _stats(saver).tensors_reused == 3
    _assert_holds(later, v)


def test_object_store_saves_reuse_unchanged_variables() -> None:
    v = _model()
    saver = _saver(v)
    where = f"memory://unchanged-{time.time_ns()}/m.msgpack"
    saver.save(where, global_step=0)
    v["head"].assign_sub(1)
    path = saver.save(where, global_step=1)
    assert _stats(saver).tensors_reused == 3 and _stats(saver).chunks_written == 2
    _assert_holds(path, v)
