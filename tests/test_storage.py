"""ckpt.storage: the Store protocol behaves the same on a local directory and in an object store."""

from __future__ import annotations

import os
import uuid

import pytest

import ckpt
from ckpt import _remote
from ckpt._localstore import LocalStore, open_store
from ckpt.state import CheckpointEntry, CheckpointState
from ckpt.storage import ReadableBlob, Store


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path):
    if request.param == "local":
        return open_store(str(tmp_path / "run"))
    return open_store(f"memory://ckpt-test-storage-{uuid.uuid4().hex}/run")


def write_bytes(data: bytes):
    def write(path: str) -> None:
        with open(path, "wb") as f:
            f.write(data)
    return write


def test_open_store_picks_the_implementation_by_location(tmp_path):
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    assert isinstance(open_store("memory://bucket/run"), _remote.RemoteDirectory)
    assert isinstance(open_store(str(tmp_path)), Store) and isinstance(open_store("memory://b/r"), Store)


def test_a_written_checkpoint_exists_lists_reads_and_deletes(store):
    assert store.list_names() == [] and not store.exists("m.bin") and store.read_state() is None
    store.write_checkpoint("m.bin", write_bytes(b"0123456789"))
    assert store.exists("m.bin") and store.list_names() == ["m.bin"]
    assert store.join("m.bin").startswith(store.location) and store.join("m.bin").endswith("/m.bin")
    blob = store.open("m.bin")
    try:
        assert isinstance(blob, ReadableBlob) and blob.size == 10 and blob.name == store.join("m.bin")
        buf = bytearray(4)
        blob.read_into(memoryview(buf), 3, "four bytes")
        assert bytes(buf) == b"3456"
        with pytest.raises(ckpt.CorruptCheckpointError, match="the tail"):
            blob.read_into(memoryview(bytearray(4)), 8, "the tail")
    finally:
        blob.close()
    store.delete_checkpoints(["m.bin", "never-written.bin"])
    assert not store.exists("m.bin") and store.list_names() == []


def test_a_failed_write_leaves_nothing(store):
    def fail(path: str) -> None:
        write_bytes(b"half")(path)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        store.write_checkpoint("m.bin", fail)
    assert not store.exists("m.bin") and store.list_names() == []


def test_commit_records_in_the_state_file_and_deletes_what_the_change_drops(store):
    def keep_last(name):
        def change(state):
            state = state or CheckpointState()
            doomed = [e.path for e in state.checkpoints]
            state.checkpoints = [CheckpointEntry(name, 1.0, None)]
            return state, doomed
        return change

    state = store.commit("a.bin", write_bytes(b"a"), keep_last("a.bin"))
    assert [e.path for e in state.checkpoints] == ["a.bin"] and store.latest() == store.join("a.bin")
    store.commit("b.bin", write_bytes(b"b"), keep_last("b.bin"))
    assert store.latest() == store.join("b.bin") and not store.exists("a.bin")
    assert [e.path for e in store.read_state().checkpoints] == ["b.bin"]
    assert store.update_state(lambda state: (state, len(state.checkpoints))) == 1


def test_a_commit_that_cannot_be_recorded_removes_the_new_checkpoint(store):
    def broken(state):
        raise ckpt.CheckpointWriteError("the state file is unwritable")

    with pytest.raises(ckpt.CheckpointWriteError, match="could not be recorded.*previous checkpoint is still"):
        store.commit("m.bin", write_bytes(b"m"), broken)
    assert not store.exists("m.bin") and store.latest() is None


def test_the_saver_and_latest_checkpoint_go_through_the_store(tmp_path):
    store = open_store(str(tmp_path))
    saver = ckpt.Saver({"w": ckpt.Variable(1.0)}, max_to_keep=1)
    first = saver.save(os.path.join(str(tmp_path), "m.h5"), global_step=1)
    second = saver.save(os.path.join(str(tmp_path), "m.h5"), global_step=2)
    assert store.latest() == ckpt.latest_checkpoint(str(tmp_path)) == second
    assert not store.exists(os.path.basename(first)) and store.list_names() == ["checkpoint", "m-2.h5"]
