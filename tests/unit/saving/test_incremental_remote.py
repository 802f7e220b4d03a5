"""Incremental checkpoints in object stores (memory://): chunks read through the checkpoint's own
store, saves that write only missing chunks, and collection that never deletes a chunk a kept or
in-flight checkpoint references."""

from __future__ import annotations

import json
import os
import time

import fsspec
import numpy as np
import pytest

import ckpt
from ckpt.errors import CorruptCheckpointError
from ckpt.formats.base import open_reader

CHUNK = 4096
CHUNKS = ".ckpt-chunks"


def _root() -> str:
    return f"memory://inc-{time.time_ns()}"


def _vars(rng: np.random.Generator) -> dict[str, ckpt.Variable]:
    return {"big": ckpt.Variable(rng.standard_normal((64, 100)).astype(np.float32), name="big"),
            "frozen": ckpt.Variable(rng.standard_normal(5000).astype(np.float64), name="frozen"),
            "text": ckpt.Variable(np.array([b"a", b"xyz"], dtype=ckpt.dtypes.string), name="text")}


def _upload_tree(local: str, url: str) -> None:
    """Copy a local checkpoint directory to ``url`` object by object (as `aws s3 sync` would)."""
    fs = fsspec.filesystem("memory")
    for folder, _, files in os.walk(local):
        for name in files:
            if name.startswith(".checkpoint.lock"):
                continue
            relative = os.path.relpath(os.path.join(folder, name), local)
            with open(os.path.join(folder, name), "rb") as f:
                fs.pipe_file(f"{url}/{relative}", f.read())


def test_an_incremental_checkpoint_copied_to_a_store_reads_its_chunks_from_there(tmp_path: object) -> None:
    v = _vars(np.random.default_rng(1))
    local = str(tmp_path)
    path = ckpt.Saver(v, incremental=True, chunk_bytes=CHUNK).save(os.path.join(local, "m.msgpack"), global_step=1)
    root = _root()
    _upload_tree(local, root)
    url = f"{root}/{os.path.basename(path)}"
    with ckpt.load_checkpoint(url) as reader:
        assert reader["big"].tobytes() == v["big"].numpy().tobytes()
        assert reader["frozen"].tobytes() == v["frozen"].numpy().tobytes()
        assert reader.verify() == []
    with open_reader(path) as local_reader:  # frozen's short last chunk: its bytes in the save's pack
        name = local_reader.chunks_of("frozen")[-1]  # type: ignore[attr-defined]
        pack, offset, length = local_reader.stored_at(name)  # type: ignore[attr-defined]
    assert length == 5000 * 8 % CHUNK
    remote_pack = f"{root}/{CHUNKS}/{os.path.basename(pack)}"
    fs = fsspec.filesystem("memory")
    damaged = bytearray(fs.cat_file(remote_pack))
    damaged[offset] ^= 0xFF
    fs.pipe_file(remote_pack, bytes(damaged))
    with ckpt.load_checkpoint(url) as reader:
        assert reader["big"].tobytes() == v["big"].numpy().tobytes()  # the other tensors are unaffected
        with pytest.raises(CorruptCheckpointError, match="tensor 'frozen'"):
            reader["frozen"]
        [problem] = reader.verify()
        assert f"tensor 'frozen': its chunk {name.hex()} (bytes {offset}-{offset + length} of the pack " \
               f"{remote_pack})" in problem and "damaged" in problem
    fs.pipe_file(remote_pack, bytes(damaged[:offset]))  # cut before the chunk: it is missing from the pack
    with ckpt.load_checkpoint(url) as reader:
        with pytest.raises(CorruptCheckpointError, match=f"tensor 'frozen': its chunk {name.hex()} .* is truncated"):
            reader["frozen"]


def _chunk_names(root: str) -> set[str]:
    fs = fsspec.filesystem("memory")
    return {p.rsplit("/", 1)[1] for p in fs.find(f"{root}/{CHUNKS}") if len(p.rsplit("/", 1)[1]) in (64, 128)}


def _references(url: str) -> set[str]:
    with open_reader(url) as reader:
        return {c.hex() for k in reader.tensors for c in reader.chunks_of(k)}  # type: ignore[attr-defined]


def test_saves_to_a_url_write_only_missing_chunks_and_collect_what_retention_frees() -> None:
    root = _root()
    v = _vars(np.random.default_rng(2))
    saver = ckpt.Saver(v, max_to_keep=2, incremental=True, chunk_bytes=CHUNK)
    steps = {}
    for step in range(4):
        if step:
            v["big"].assign(v["big"].numpy() + 1)  # "frozen" never changes: its chunks are reused
        steps[step] = v["big"].numpy().copy()
        saver.save(f"{root}/model.msgpack", global_step=step)
        stats = saver.last_incremental
        assert stats is not None
        if step:
            assert stats.chunks_written == 7 and stats.chunks_reused == 10  # big: 25600 B = 7 chunks
    assert [os.path.basename(p) for p in saver.last_checkpoints] == ["model-2.msgpack", "model-3.msgpack"]
    kept = _references(f"{root}/model-2.msgpack") | _references(f"{root}/model-3.msgpack")
    assert _chunk_names(root) == kept  # model-0's and model-1's own chunks were collected
    for step in (2, 3):
        with ckpt.load_checkpoint(f"{root}/model-{step}.msgpack") as reader:
            assert reader["big"].tobytes() == steps[step].tobytes()
    assert [r.ok for r in ckpt.verify_directory(root)] == [True, True]
    rows = {os.path.basename(r.path): r for r in ckpt.list_checkpoints(root)}
    assert rows["model-3.msgpack"].shared == 5000 * 8 and rows["model-2.msgpack"].shared == 5000 * 8
    restored = _vars(np.random.default_rng(9))
    ckpt.Saver(restored).restore(root)
    assert restored["big"].numpy().tobytes() == steps[3].tobytes()


def test_an_async_save_to_a_url_and_full_every() -> None:
    root = _root()
    v = _vars(np.random.default_rng(3))
    saver = ckpt.Saver(v, max_to_keep=1, incremental=True, chunk_bytes=CHUNK, full_every=2)
    for step in range(3):
        v["big"].assign(np.full((64, 100), step, np.float32))
        saver.save(f"{root}/model.msgpack", global_step=step, blocking=False).result()
    with open_reader(f"{root}/model-2.msgpack") as reader:  # full_every: a self-contained one
        assert reader.format_name == "msgpack" and reader.read("big")[0, 0] == 2
    assert _chunk_names(root) == set()  # nothing kept references a chunk any more


def test_no_collection_while_another_save_holds_the_chunk_store() -> None:
    """Saver A has listed the chunks it will reuse (it holds the store); saver B's retention drops
    the only checkpoint referencing them: B's collection must leave them, A's commit keeps them."""
    from ckpt.saving.incremental_remote import collect_remote
    from ckpt.saving.stores import open_store
    from ckpt.storage.leases import ChunkLeases

    root = _root()
    v = _vars(np.random.default_rng(4))
    ckpt.Saver(v, incremental=True, chunk_bytes=CHUNK).save(f"{root}/a.msgpack", global_step=0)
    listed_by_a = _references(f"{root}/a-0.msgpack")
    store = open_store(root)
    leases = ChunkLeases(store.store, f"{root}/{CHUNKS}")  # type: ignore[attr-defined]
    assert leases.hold("saver-a")  # A is between its listing and its commit
    b = ckpt.Saver(v, max_to_keep=1, incremental=True, chunk_bytes=CHUNK)
    v["big"].assign(v["big"].numpy() * 2)
    b.save(f"{root}/b.msgpack", global_step=1)
    b.save(f"{root}/b.msgpack", global_step=2)  # retention drops a-0, then b-1
    assert b.last_incremental is not None and b.last_incremental.chunks_collected == 0
    assert [os.path.basename(p) for p in b.last_checkpoints] == ["b-2.msgpack"]
    assert listed_by_a <= _chunk_names(root)  # A may still reuse every chunk it listed
    assert not leases.release("saver-a", collect=False)
    assert collect_remote(store) > 0  # with A's hold gone, what only a-0 and b-1 referenced goes
    assert _chunk_names(root) == _references(f"{root}/b-2.msgpack")


def test_a_save_whose_hold_expired_commits_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    root = _root()
    v = _vars(np.random.default_rng(5))
    saver = ckpt.Saver(v, incremental=True, chunk_bytes=CHUNK, storage_options={"ckpt_grace": 1000.0})
    saver.save(f"{root}/model.msgpack", global_step=0)
    clock = [time.time()]
    real = time.time

    def later() -> float:
        clock[0] += 400.0  # each look at the clock: the save "pauses" past half the grace
        return clock[0]

    monkeypatch.setattr(time, "time", later)
    with pytest.raises(ckpt.CheckpointWriteError, match="hold on the chunk store .* expired"):
        saver.save(f"{root}/model.msgpack", global_step=1)
    monkeypatch.setattr(time, "time", real)
    assert ckpt.latest_checkpoint(root) == f"{root}/model-0.msgpack"


def _sparse_step(v: dict[str, ckpt.Variable], rng: np.random.Generator) -> None:
    """Change a few elements of the numeric tensors (deltas pay)."""
    for key in ("big", "frozen"):
        value = v[key].numpy().copy()
        flat = value.reshape(-1)
        flat[rng.choice(flat.size, 8, replace=False)] += 1
        v[key].assign(value)


def test_a_url_gets_the_same_deltas_and_compression_as_a_local_directory(tmp_path: object) -> None:
    """The same saves to a local directory and to memory:// write the same chunks (deltas against
    the previous save, zstd), keep every file of every kept chain, and restore bit-exact."""
    root, local = _root(), str(tmp_path)
    v = {where: _vars(np.random.default_rng(6)) for where in ("local", "url")}
    savers = {where: ckpt.Saver(v[where], max_to_keep=2, incremental=True, chunk_bytes=CHUNK, compression="zstd")
              for where in v}
    rng = {where: np.random.default_rng(7) for where in v}
    for step in range(5):
        for where, saver in savers.items():
            if step:
                _sparse_step(v[where], rng[where])
            saver.save(f"{root}/m.msgpack" if where == "url" else os.path.join(local, "m.msgpack"), global_step=step)
        got = {where: saver.last_incremental for where, saver in savers.items()}
        assert got["url"] is not None and got["local"] is not None
        assert (got["url"].chunks_written, got["url"].bytes_written) == \
            (got["local"].chunks_written, got["local"].bytes_written)
    names = _chunk_names(root)
    # the same chunks: the URL's as objects of their own, the local directory's in its saves' packs
    assert names == _references(os.path.join(local, "m-3.msgpack")) | _references(os.path.join(local, "m-4.msgpack"))
    assert any(len(n) == 128 for n in names)  # deltas were written
    assert names == _references(f"{root}/m-3.msgpack") | _references(f"{root}/m-4.msgpack")
    with ckpt.load_checkpoint(f"{root}/m-4.msgpack") as reader:
        assert reader["big"].tobytes() == v["url"]["big"].numpy().tobytes()
        assert reader["frozen"].tobytes() == v["url"]["frozen"].numpy().tobytes()
        assert reader.verify() == []
    delta = next(n for n in sorted(_references(f"{root}/m-4.msgpack")) if len(n) == 128)
    fs = fsspec.filesystem("memory")
    data = bytearray(fs.cat_file(f"{root}/{CHUNKS}/{delta}"))
    data[-1] ^= 0xFF
    fs.pipe_file(f"{root}/{CHUNKS}/{delta}", bytes(data))
    with ckpt.load_checkpoint(f"{root}/m-4.msgpack") as reader:
        [problem] = reader.verify()
    assert f"{root}/{CHUNKS}/{delta}" in problem


def test_a_failed_request_ending_a_collection_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """A collect lease left behind would make every save wait, then save self-contained, for an hour."""
    from ckpt.errors import StorageError
    from ckpt.storage.leases import ChunkLeases

    root = _root()
    v = _vars(np.random.default_rng(8))
    saver = ckpt.Saver(v, incremental=True, chunk_bytes=CHUNK)
    real, failures = ChunkLeases.end_collection, []

    def flaky(self: ChunkLeases, token: str) -> None:
        if not failures:
            failures.append(token)
            raise StorageError("injected: the request failed")
        real(self, token)

    monkeypatch.setattr(ChunkLeases, "end_collection", flaky)
    saver.save(f"{root}/model.msgpack", global_step=0)
    assert failures
    with fsspec.open(f"{root}/{CHUNKS}/leases", "rb") as f:
        assert json.loads(f.read())["collect"] is None
