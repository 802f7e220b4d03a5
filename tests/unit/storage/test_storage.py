"""ckpt.storage: the Store protocol behaves the same on a local directory and in an object store."""

from __future__ import annotations

import json
import os
import uuid

import numpy as np
import pytest

import ckpt
from ckpt.storage import remote as _remote
from ckpt.saving.stores import open_store
from ckpt.storage.local import LocalStore
from ckpt.storage.state import CheckpointEntry, CheckpointState
from ckpt.formats.base import FileReader, TensorInfo, materialize
from ckpt.storage import ReadableBlob, Store, WritableBlob


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path):
    if request.param == "local":
        return open_store(str(tmp_path / "run"))
    return open_store(f"memory://ckpt-test-storage-{uuid.uuid4().hex}/run")


def write_bytes(data: bytes):
    def write(blob: WritableBlob) -> None:
        assert isinstance(blob, WritableBlob) and blob.size == 0
        blob.write_at(data, 0)
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
    def fail(blob: WritableBlob) -> None:
        write_bytes(b"half")(blob)
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


# -- the format contract: a plugin format defined only here, written the documented way ----------

class _Toy(ckpt.WritableFormat):
    """A third-party format as docs/storage.md describes one: b"TOY1", a JSON index of 4 KiB at
    most, then each tensor's bytes; one class, registered with ckpt.register_format."""

    name, extensions = "toy", (".toy",)

    def sniff(self, head: bytes) -> bool:
        return head.startswith(b"TOY1")

    def open(self, path: str, blob: ReadableBlob | None = None, declined=None) -> _ToyReader:
        return _ToyReader(path, blob)

    def write_blob(self, blob: WritableBlob, tensors, metadata) -> None:
        index, offset, arrays = {}, 4096, []
        for key, source in tensors:
            array = np.ascontiguousarray(materialize(source))
            index[key] = [array.dtype.str, list(array.shape), offset]
            arrays.append((offset, array))
            offset += array.nbytes
        head = b"TOY1" + json.dumps({"tensors": index, "metadata": dict(metadata)}).encode()
        blob.write_at(head.ljust(4096, b" "), 0)
        for at, array in arrays:
            blob.write_at(memoryview(array).cast("B"), at)


class _ToyReader(FileReader):
    format_name, checksummed = "toy", False

    def _open(self) -> None:
        raw = bytearray(4092)
        self._source.read_into(memoryview(raw), 4, "the index")
        parsed = json.loads(bytes(raw))
        self._metadata = parsed["metadata"]
        self._tensors = {key: TensorInfo(key, np.dtype(dt), tuple(shape), np.dtype(dt).itemsize *
                                              int(np.prod(shape)), at) for key, (dt, shape, at) in parsed["tensors"].items()}

    def _read_into(self, info, out) -> None:
        self._source.read_into(memoryview(out).cast("B"), info.extra, f"tensor {info.key!r}")


@pytest.fixture
def toy():
    fmt = _Toy()
    ckpt.register_format(fmt)
    yield fmt
    ckpt.unregister_format(fmt.name)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_plugin_format_saves_restores_and_inspects_on_every_store(toy, tmp_path, where):
    from click.testing import CliRunner

    from ckpt.cli.main import main

    location = str(tmp_path) if where == "local" else f"memory://ckpt-test-toy-{uuid.uuid4().hex}"
    w = ckpt.Variable(np.arange(6.0, dtype=np.float32).reshape(2, 3), name="w")
    path = ckpt.Saver([w], format="toy").save(f"{location}/m.toy", metadata={"note": "toy"})
    with ckpt.load_checkpoint(path) as reader:  # recognised by its sniff, read through the blob it was handed
        assert reader.format == "toy" and reader.metadata == {"note": "toy"}
        assert np.array_equal(reader.get_tensor("w"), w.numpy())
    w.assign(np.zeros((2, 3), np.float32))
    ckpt.Saver([w]).restore(path)
    assert w.numpy().tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    if where == "local":
        result = CliRunner().invoke(main, ["inspect", path])
        assert result.exit_code == 0, result.output
        assert result.output == "tensor: w (float32) [2, 3]\n# Total number of params: 6\n"


def test_register_format_refuses_what_is_not_one_format_class():
    """One way to be a format: a Format subclass; a writer overrides write_blob, never write(path)."""

    class Structural:  # duck-typed: not a subclass
        name, extensions, can_write = "structural", (".structural",), False

        def claims(self, path):
            return False

        def sniff(self, head):
            return False

        def open(self, path, blob=None, declined=None):
            raise NotImplementedError

    with pytest.raises(TypeError, match="is not a Format: subclass ckpt.Format"):
        ckpt.register_format(Structural())

    class PathOnly(_Toy):  # written against the old path-taking contract
        name, extensions = "pathonly", (".pathonly",)

        def write(self, path, tensors, metadata):
            raise AssertionError("never called")

    with pytest.raises(TypeError, match="overrides write\\(path, ...\\).*override write_blob"):
        ckpt.register_format(PathOnly())

    class Neither(ckpt.WritableFormat):
        name, extensions = "neither", (".neither",)

        def sniff(self, head):
            return False

        def open(self, path, blob=None, declined=None):
            raise NotImplementedError

    with pytest.raises(TypeError, match="abstract method.*write_blob"):
        Neither()
    assert not {"structural", "pathonly"} & {f.name for f in ckpt.formats.base.formats()}


def test_convert_reads_the_written_bytes_back_before_they_become_visible(tmp_path):
    source = str(tmp_path / "s.h5")
    ckpt.save_file({"w": np.arange(5.0)}, source)
    dst = f"memory://ckpt-test-convert-{uuid.uuid4().hex}/c.msgpack"
    checked = []
    directory = open_store(dst.rpartition("/")[0])
    real = type(directory).write_checkpoint

    def spy(self, name, write, check=None):
        def checking(written):
            checked.append((written.name, self.exists(name)))
            check(written)
        return real(self, name, write, checking)

    import unittest.mock

    with unittest.mock.patch.object(type(directory), "write_checkpoint", spy):
        ckpt.convert(source, dst)
    assert len(checked) == 1 and "/.ckpt-data/" in checked[0][0] and checked[0][1] is False  # not yet visible
    assert np.array_equal(ckpt.load_file(dst)["w"], np.arange(5.0))


def test_a_pending_entry_counts_only_where_its_commit_happened(tmp_path):
    """The state file names a save's checkpoint pending before the rename: a reader counts it once
    the file is in place, and where the save replaces a file, only once it is *this* save's file."""
    from ckpt.storage.state import read_state

    store = open_store(str(tmp_path))
    saver = ckpt.Saver({"w": ckpt.Variable(1.0)}, max_to_keep=None)
    a = saver.save(str(tmp_path / "a.h5"))
    b = saver.save(str(tmp_path / "b.h5"))
    new = tmp_path / ".new"  # a re-save of a.h5, killed before its rename: a.h5 is still the old file
    new.write_bytes((tmp_path / "a.h5").read_bytes())
    store.intend("a.h5", 7, str(new))
    assert [e.path for e in read_state(str(tmp_path)).pending] == ["a.h5"]
    assert store.latest() == ckpt.latest_checkpoint(tmp_path) == b
    assert [r.path for r in ckpt.list_checkpoints(tmp_path)] == ["a.h5", "b.h5"]
    os.replace(new, tmp_path / "a.h5")  # ... killed after it: the new a.h5 is the latest
    assert store.latest() == a and [(r.path, r.step, r.note) for r in ckpt.list_checkpoints(tmp_path)] == [
        ("b.h5", None, ""), ("a.h5", 7, "latest")]
    store.intend("c.h5", 8, str(tmp_path / "a.h5"))  # a new name never renamed into place: dropped
    assert store.latest() == a
    saver.save(str(tmp_path / "d.h5"))  # the next save settles both
    state = read_state(str(tmp_path))
    assert state.pending == [] and [e.path for e in state.checkpoints] == ["b.h5", "a.h5", "d.h5"]
