"""Incremental saves with blocking=False: chunks cut and hashed from the staged snapshot in the
background, committed like any asynchronous save (docs/incremental.md, docs/async.md)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import ckpt
from ckpt.errors import CheckpointWriteError
from ckpt.formats.base import open_reader
from incremental_support import referenced_files, store_files

CHUNK = 4096
CHUNKS = ".ckpt-chunks"


def _vars(seed: int) -> dict[str, ckpt.Variable]:
    rng = np.random.default_rng(seed)
    return {
        "big": ckpt.Variable(rng.standard_normal((64, 100)).astype(np.float32), name="big"),  # 6.25 chunks
        "frozen": ckpt.Variable(rng.integers(0, 9, 3 * CHUNK // 8, dtype=np.int64), name="frozen"),
        "bf": ckpt.Variable(rng.standard_normal(3000).astype(ckpt.dtypes.bfloat16), name="bf"),
        "text": ckpt.Variable(np.array([b"a", b"", b"xyz"], dtype=ckpt.dtypes.string), name="text"),
    }


def _saver(v: dict[str, ckpt.Variable], **kw: object) -> ckpt.Saver:
    return ckpt.Saver(v, incremental=True, chunk_bytes=CHUNK, **kw)  # type: ignore[arg-type]


def _snapshot(v: dict[str, ckpt.Variable]) -> dict[str, bytes]:
    return {k: x.numpy().tobytes() if k != "text" else b"|".join(x.numpy()) for k, x in v.items()}


def _stored(path: str) -> dict[str, bytes]:
    with ckpt.load_checkpoint(path) as reader:
        return {k: reader[k].tobytes() if k != "text" else b"|".join(reader[k]) for k in reader.tensors}


def _format(path: str) -> str:
    with open_reader(path) as reader:
        return reader.format_name


def _step(v: dict[str, ckpt.Variable], step: int) -> None:
    """Change big's first row only (so only its first chunk), as a training step would."""
    new = v["big"].numpy().copy()
    new[0] = step
    v["big"].assign(new)


@pytest.mark.parametrize("staging_bytes", [None, 0, 40_000])  # all staged, none staged, only a tail staged
def test_queued_async_saves_keep_the_values_of_their_call(tmp_path: object, staging_bytes: int | None) -> None:
    """Two asynchronous saves in a row while training changes every variable right after each
    returns: each checkpoint holds its call's values, the second reuses the first's chunks."""
    v = _vars(0)
    saver = _saver(v, max_to_keep=None, staging_bytes=staging_bytes)
    d = str(tmp_path)
    want, futures = {}, []
    for step in (1, 2):
        _step(v, step)
        want[step] = _snapshot(v)
        futures.append(saver.save(os.path.join(d, "m.msgpack"), global_step=step, blocking=False))
        for var in v.values():  # the training step after save() returned
            if var.dtype != ckpt.dtypes.string:
                var.assign(np.zeros(var.shape, var.dtype))
        v["frozen"].assign(np.frombuffer(want[step]["frozen"], np.int64))  # unchanged by training
    saver.wait()
    assert [f.result() for f in futures] == [os.path.join(d, f"m-{s}.msgpack") for s in (1, 2)]
    for step in (1, 2):
        path = os.path.join(d, f"m-{step}.msgpack")
        assert _format(path) == "ckpt-incremental" and ckpt.verify(path).ok
        assert _stored(path) == want[step]
    stats = saver.last_incremental
    assert stats is not None and stats.chunks_written >= 1 and stats.chunks_reused >= 3  # frozen's 3 chunks
    assert ckpt.latest_checkpoint(d) == os.path.join(d, "m-2.msgpack")


def test_last_incremental_describes_the_save_after_wait(tmp_path: object) -> None:
    v = _vars(1)
    saver = _saver(v, max_chain=0)  # changed chunks written whole: their size is known
    d = str(tmp_path)
    saver.save(os.path.join(d, "m.msgpack"), global_step=1, blocking=False)
    saver.wait()
    first = saver.last_incremental
    assert first is not None and first.chunks_reused == 0 and first.chunks_written > 0
    _step(v, 2)
    saver.save(os.path.join(d, "m.msgpack"), global_step=2, blocking=False).result()
    second = saver.last_incremental
    assert second is not None and second.chunks_written == 1 and 0 < second.bytes_written <= CHUNK  # maybe a delta
    assert second.chunks_reused == first.chunks_written - 1


def test_async_retention_and_full_every_collect_unreferenced_chunks(tmp_path: object) -> None:
    v = _vars(2)
    saver = _saver(v, max_to_keep=2, full_every=3)
    d = str(tmp_path)
    for step in range(5):
        _step(v, step)
        saver.save(os.path.join(d, "m.msgpack"), global_step=step, blocking=False)
    saver.wait()
    kept = sorted(n for n in os.listdir(d) if n.endswith(".msgpack"))
    assert kept == ["m-3.msgpack", "m-4.msgpack"]
    assert [_format(os.path.join(d, n)) for n in kept] == ["msgpack", "ckpt-incremental"]  # save 3 is full
    # the packs save 4 reads, and nothing else: save 0's (the chunks that did not change since) and
    # its own; the packs of saves 1 and 2 (big's first chunk, only dropped checkpoints read them) are gone
    assert store_files(d) == referenced_files(d, ["m-4.msgpack"]) == referenced_files(d, kept)
    assert len(store_files(d)) == 2
    assert [ckpt.verify(os.path.join(d, n)).ok for n in kept] == [True, True]


def test_a_failed_async_incremental_save_raises_once_and_keeps_the_latest(tmp_path: object) -> None:
    v = _vars(3)
    saver = _saver(v)
    d = str(tmp_path)
    first = saver.save(os.path.join(d, "m.msgpack"), global_step=1)
    os.rename(os.path.join(d, CHUNKS), os.path.join(d, "moved"))
    with open(os.path.join(d, CHUNKS), "wb"):  # a file where the chunk folder should be
        pass
    future = saver.save(os.path.join(d, "m.msgpack"), global_step=2, blocking=False)
    with pytest.raises(CheckpointWriteError, match="chunk store") as info:
        saver.wait()
    assert os.path.join(d, "m-2.msgpack") in str(info.value)
    assert isinstance(future.exception(), CheckpointWriteError)
    saver.wait()  # the error was seen: it is not raised again
    assert saver.last_incremental is None
    assert ckpt.latest_checkpoint(d) == first and not os.path.exists(os.path.join(d, "m-2.msgpack"))


def test_last_incremental_is_none_after_a_failed_blocking_save(tmp_path: object) -> None:
    """Not the stats of the save before, which a caller would take for this one's."""
    v = _vars(4)
    saver = _saver(v)
    d = str(tmp_path)
    saver.save(os.path.join(d, "m.msgpack"), global_step=1)
    assert saver.last_incremental is not None
    os.rename(os.path.join(d, CHUNKS), os.path.join(d, "moved"))
    with open(os.path.join(d, CHUNKS), "wb"):
        pass
    with pytest.raises(CheckpointWriteError, match="chunk store"):
        saver.save(os.path.join(d, "m.msgpack"), global_step=2)
    assert saver.last_incremental is None
