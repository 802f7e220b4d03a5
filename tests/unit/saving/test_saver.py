"""ckpt.Saver: the TF1 guide's save/restore examples, var_lists, paths, retention, restore rules."""

from __future__ import annotations

import gc
import json
import os
import pathlib
import time

import numpy as np
import pytest
from conftest import assert_bit_exact, data_offset, every_dtype_tensors

import ckpt
from ckpt.saving import retention as retention_module
from ckpt.storage.state import read_state

FORMATS = ["h5", "msgpack"]


@pytest.fixture(params=FORMATS)
def ext(request):
    return request.param


# --- the TF1 guide -------------------------------------------------------------------------
def test_guide_save_and_restore_all_variables(tmp_path, ext):
    gc.collect()
    v1 = ckpt.Variable(ckpt.initializers.Zeros(), shape=(3,), name="guide_v1")
    v2 = ckpt.Variable(ckpt.initializers.Zeros(), shape=(5,), name="guide_v2")
    v1.assign(v1 + 1)
    v2.assign(v2 - 1)
    saver = ckpt.Saver([v1, v2])
    save_path = saver.save(str(tmp_path / f"model.{ext}"))
    assert save_path == str(tmp_path / f"model.{ext}")

    with ckpt.deferred_init():
        r1 = ckpt.Variable(ckpt.initializers.Zeros(), shape=(3,), name="guide_v1")
        r2 = ckpt.Variable(ckpt.initializers.Zeros(), shape=(5,), name="guide_v2")
    ckpt.Saver([r1, r2]).restore(save_path)
    np.testing.assert_array_equal(r1.numpy(), [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(r2.numpy(), [-1.0] * 5)


def test_guide_choose_variables_to_save_and_restore(tmp_path, ext):
    v1 = ckpt.Variable(np.zeros(3, np.float32), name="v1")
    v2 = ckpt.Variable(np.full(5, -1.0, np.float32), name="v2")
    path = ckpt.Saver({"my_v2": v2, "v1": v1}).save(str(tmp_path / f"model.{ext}"))

    with ckpt.deferred_init():
        n1 = ckpt.Variable(ckpt.initializers.Zeros(), shape=(3,), name="v1")
        n2 = ckpt.Variable(ckpt.initializers.Zeros(), shape=(5,), name="v2")
    result = ckpt.Saver({"my_v2": n2}).restore(path)
    assert result.restored == ["my_v2"] and result.unexpected == ["v1"]
    assert ckpt.report_uninitialized_variables([n1, n2]) == ["v1"]
    ckpt.initialize_variables([n1])
    assert ckpt.report_uninitialized_variables([n1, n2]) == []
    np.testing.assert_array_equal(n1.numpy(), [0.0, 0.0, 0.0])
    np.testing.assert_array_equal(n2.numpy(), [-1.0] * 5)


def test_saver_none_saves_every_live_variable(tmp_path):
    gc.collect()
    a = ckpt.Variable(1.0, name="none_case/a")
    b = ckpt.Variable([2, 3], name="none_case/b", trainable=False)
    saver = ckpt.Saver()
    assert saver.var_list["none_case/a"] is a and saver.var_list["none_case/b"] is b
    path = saver.save(str(tmp_path / "all.h5"))
    assert ("none_case/b", [2]) in ckpt.list_variables(path)


def test_every_dtype_through_the_saver(tmp_path, ext):
    variables = {key: ckpt.Variable(value) for key, value in every_dtype_tensors()}
    path = ckpt.Saver(variables).save(str(tmp_path / f"all.{ext}"))
    fresh = {key: ckpt.Variable(np.zeros_like(v.numpy()) if v.dtype.kind != "O" else
                                np.full(v.shape, b"", dtype=object)) for key, v in variables.items()}
    ckpt.Saver(fresh).restore(path)
    for key, var in variables.items():
        assert_bit_exact(var.numpy() if var.ndim else np.asarray(var.value()), np.asarray(fresh[key].value()))


# --- var_list forms and errors ----------------------------------------------------------------
def test_module_var_list_uses_attribute_paths(tmp_path):
    class Net(ckpt.Module):
        def __init__(self):
            super().__init__()
            with self.name_scope:
                self.layers = [ckpt.Variable(np.ones(2), name="w0"), ckpt.Variable(np.ones(3), name="w1")]
                self.head = {"bias": ckpt.Variable(0.5, name="b")}

    net = Net()
    saver = ckpt.Saver(net)
    assert list(saver.var_list) == ["head/bias", "layers/0", "layers/1"]
    path = saver.save(str(tmp_path / "net.h5"))
    assert [k for k, _ in ckpt.list_variables(path)] == ["head/bias", "layers/0", "layers/1"]


def test_a_dict_of_modules_and_dicts_is_keyed_by_entry_then_attribute_path(tmp_path):
    """TF2's Checkpoint(model=..., optimizer=...) and torch's {"model": ..., "opt": ...}: a dict's Modules
    and nested dicts put their variables below the entry's key; a restore brings every one back."""
    class Net(ckpt.Module):
        def __init__(self):
            super().__init__()
            with self.name_scope:
                self.layers = [ckpt.Variable(np.arange(2.0), name="w0"), ckpt.Variable(np.arange(3.0), name="w1")]

    net = Net()
    momentum = {"layers/0": ckpt.Variable(np.full(2, 0.5)), "layers/1": ckpt.Variable(np.full(3, 0.25))}
    step = ckpt.Variable(7, dtype="int64")
    tree = {"model": net, "optimizer": {"momentum": momentum, "iterations": step}}
    saver = ckpt.Saver(tree)
    assert list(saver.var_list) == ["model/layers/0", "model/layers/1", "optimizer/momentum/layers/0",
                                    "optimizer/momentum/layers/1", "optimizer/iterations"]
    path = saver.save(str(tmp_path / "train.h5"))
    for v in (*net.variables, *momentum.values(), step):
        v.assign(np.zeros(v.shape, v.dtype))
    assert ckpt.Saver(tree).restore(path).restored == list(saver.var_list)
    assert net.layers[1].numpy().tolist() == [0.0, 1.0, 2.0] and momentum["layers/0"].numpy().tolist() == [0.5, 0.5]
    assert int(step) == 7


def test_var_list_errors():
    a = ckpt.Variable(1.0, name="same")
    b = ckpt.Variable(2.0, name="same")
    with pytest.raises(ValueError, match="two variables.*'same'.*same:0 and same:0"):
        ckpt.Saver([a, b])
    with pytest.raises(ValueError, match="under two keys: 'x' and 'y'"):
        ckpt.Saver({"x": a, "y": a})
    with pytest.raises(ValueError, match="no variables"):
        ckpt.Saver([])
    with pytest.raises(ValueError, match="invalid key"):
        ckpt.Saver({"a//b": a})
    with pytest.raises(TypeError, match="'a' is a ndarray: a dict's values are ckpt.Variables, Modules or dicts"):
        ckpt.Saver({"a": np.zeros(2)})
    with pytest.raises(TypeError, match="'opt/slots' is a list: a dict's values are ckpt.Variables, Modules"):
        ckpt.Saver({"opt": {"slots": [a]}})
    assert list(ckpt.Saver([a, a]).var_list) == ["same"]  # listed twice, saved once
    with pytest.raises(ValueError):
        ckpt.Saver([a], max_to_keep=-1)
    with pytest.raises(ValueError, match="unknown checkpoint format"):
        ckpt.Saver([a], format="zip")


# --- paths --------------------------------------------------------------------------------
@pytest.mark.parametrize("given, fmt, step, expected, kind", [
    ("model.h5", "hdf5", None, "model.h5", "hdf5"),
    ("model.h5", "msgpack", 1000, "model-1000.h5", "hdf5"),
    ("model.hdf5", "hdf5", 3, "model-3.hdf5", "hdf5"),
    ("model.msgpack", "hdf5", 5, "model-5.msgpack", "msgpack"),
    ("model", "msgpack", 7, "model-7.msgpack", "msgpack"),
    ("model", "hdf5", None, "model.h5", "hdf5"),
    ("model-0.5", "hdf5", 2, "model-0.5-2.h5", "hdf5"),  # a number after a dot is no extension
])
def test_save_path_rules(tmp_path, given, fmt, step, expected, kind):
    v = ckpt.Variable(1.0)
    path = ckpt.Saver([v], format=fmt).save(str(tmp_path / given), global_step=step)
    assert path == str(tmp_path / expected)
    with ckpt.load_checkpoint(path) as reader:
        assert reader.format == kind


@pytest.mark.parametrize("given, problem", [
    ("x/model.pt", r"x/model\.pt: ckpt writes no '\.pt' files \(pytorch is read only\); use \.h5, \.hdf5, "
                   r"\.msgpack, \.safetensors, or no extension for the Saver's format"),
    ("model.ckpt", r"model\.ckpt: ckpt writes no '\.ckpt' files; use \.h5"),
    ("run/", r"run/: a directory; a save names a file in it, e.g\. run/model\.h5 \(restores and "
             r"latest_checkpoint take the directory\)"),
    ("existing", r"existing: a directory; a save names a file in it, e\.g\. .*existing/model\.h5"),
])
def test_save_targets_saver_and_save_file_refuse_alike(tmp_path, monkeypatch, given, problem):
    """One rule for Saver.save and save_file: a directory, or an extension no format writes, is refused
    (before, saver.save("x/model.pt") wrote x/model.pt-7.h5 and save("run/") wrote run/-7.h5)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "existing").mkdir()
    with pytest.raises(ckpt.UnsupportedCheckpointError, match=problem) as info:
        ckpt.Saver([ckpt.Variable(1.0)]).save(given, global_step=7)
    assert info.value.path == given and isinstance(info.value, ValueError)
    with pytest.raises(ckpt.UnsupportedCheckpointError, match=problem.split(", or no extension")[0]):
        ckpt.save_file({"w": np.zeros(2)}, given)
    assert sorted(os.listdir(tmp_path)) == ["existing"] and not os.listdir(tmp_path / "existing")


def test_global_step_may_be_a_variable(tmp_path):
    step = ckpt.Variable(42, trainable=False)
    path = ckpt.Saver([ckpt.Variable(1.0)]).save(str(tmp_path / "m.h5"), global_step=step)
    assert path.endswith("m-42.h5")
    with pytest.raises(TypeError):
        ckpt.Saver([ckpt.Variable(1.0)]).save(str(tmp_path / "m.h5"), global_step=1.5)


@pytest.mark.parametrize("blocking", [True, False])
def test_missing_parent_directories_are_created_durably(tmp_path, monkeypatch, blocking):
    from ckpt.storage import atomic

    synced = []
    real = atomic.fsync_directory
    monkeypatch.setattr(atomic, "fsync_directory", lambda d: (synced.append(d), real(d)))
    v = ckpt.Variable([1.0, 2.0])
    saved = ckpt.Saver([v]).save(str(tmp_path / "run" / "a" / "model.h5"), global_step=3, blocking=blocking)
    path = saved if blocking else saved.result()
    assert path == str(tmp_path / "run" / "a" / "model-3.h5")
    assert ckpt.latest_checkpoint(tmp_path / "run" / "a") == path
    # each new directory's entry was flushed in its parent before the file's own rename
    assert synced[:2] == [str(tmp_path), str(tmp_path / "run")]
    np.testing.assert_array_equal(ckpt.load_variable(path, v.key), [1.0, 2.0])


def test_a_file_in_the_way_of_a_directory_is_a_write_error(tmp_path):
    (tmp_path / "run").write_text("not a directory")
    with pytest.raises(ckpt.CheckpointWriteError, match=r"cannot create the directory .*run"):
        ckpt.Saver([ckpt.Variable(1.0)]).save(str(tmp_path / "run" / "model.h5"))
    assert (tmp_path / "run").read_text() == "not a directory"


def test_saving_uninitialized_variables_is_refused(tmp_path):
    with ckpt.deferred_init():
        v = ckpt.Variable(ckpt.initializers.Zeros(), shape=(2,), name="pending")
    with pytest.raises(ckpt.UninitializedVariableError, match="pending:0"):
        ckpt.Saver([v]).save(str(tmp_path / "m.h5"))
    assert os.listdir(tmp_path) == []


def test_metadata_round_trips(tmp_path, ext):
    path = ckpt.Saver([ckpt.Variable(1.0)]).save(str(tmp_path / f"m.{ext}"),
                                                 metadata={"step": 3, "loss": np.float32(0.25)})
    with ckpt.load_checkpoint(path) as reader:
        assert reader.metadata == {"step": 3, "loss": 0.25}
    with pytest.raises(ValueError, match="metadata"):
        ckpt.Saver([ckpt.Variable(1.0)]).save(str(tmp_path / f"n.{ext}"), metadata={"x": {1, 2}})
    assert not os.path.exists(tmp_path / f"n.{ext}")


# --- state file and retention --------------------------------------------------------------
def _state(directory):
    return json.loads((directory / "checkpoint").read_text())


def test_max_to_keep_and_state_file(tmp_path, ext):
    v = ckpt.Variable(0.0)
    saver = ckpt.Saver([v], max_to_keep=2)
    paths = [saver.save(str(tmp_path / f"model.{ext}"), global_step=s) for s in range(4)]
    assert saver.last_checkpoints == paths[2:]
    assert sorted(os.listdir(tmp_path)) == sorted([".checkpoint.lock", "checkpoint",
                                                   f"model-2.{ext}", f"model-3.{ext}"])
    state = _state(tmp_path)
    assert state["latest"] == f"model-3.{ext}"
    assert [e["path"] for e in state["checkpoints"]] == [f"model-2.{ext}", f"model-3.{ext}"]
    assert [e["step"] for e in state["checkpoints"]] == [2, 3]
    assert all(isinstance(e["time"], float) for e in state["checkpoints"])
    assert ckpt.latest_checkpoint(tmp_path) == paths[3]


def test_max_to_keep_none_keeps_all_and_resave_moves_to_end(tmp_path):
    saver = ckpt.Saver([ckpt.Variable(0.0)], max_to_keep=None)
    for s in range(3):
        saver.save(str(tmp_path / "m.h5"), global_step=s)
    saver.save(str(tmp_path / "m.h5"), global_step=0)
    assert [os.path.basename(p) for p in saver.last_checkpoints] == ["m-1.h5", "m-2.h5", "m-0.h5"]
    assert ckpt.latest_checkpoint(tmp_path).endswith("m-0.h5")


def test_a_later_saver_continues_the_directory_list(tmp_path):
    first = ckpt.Saver([ckpt.Variable(0.0)], max_to_keep=3)
    for s in range(3):
        first.save(str(tmp_path / "m.h5"), global_step=s)
    second = ckpt.Saver([ckpt.Variable(1.0)], max_to_keep=3)
    second.save(str(tmp_path / "m.h5"), global_step=3)
    assert [os.path.basename(p) for p in second.last_checkpoints] == ["m-1.h5", "m-2.h5", "m-3.h5"]
    assert not (tmp_path / "m-0.h5").exists()


def test_keep_checkpoint_every_n_hours(tmp_path, monkeypatch):
    clock = [1_000_000.0]
    monkeypatch.setattr(retention_module.time, "time", lambda: clock[0])
    saver = ckpt.Saver([ckpt.Variable(0.0)], max_to_keep=2, keep_checkpoint_every_n_hours=1)
    for step in range(8):  # one save every 20 minutes
        saver.save(str(tmp_path / "m.h5"), global_step=step)
        clock[0] += 1200
    state = _state(tmp_path)
    assert [e["path"] for e in state["checkpoints"]] == ["m-6.h5", "m-7.h5"]
    # saved at 0, 20, 40, 60, ... minutes: the first one an hour after the start is kept, then hourly
    assert [e["path"] for e in state["preserved"]] == ["m-3.h5"]
    assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".h5")) == ["m-3.h5", "m-6.h5", "m-7.h5"]
    clock[0] += 3600 * 2
    saver.save(str(tmp_path / "m.h5"), global_step=8)
    saver.save(str(tmp_path / "m.h5"), global_step=9)
    # m-6 was saved exactly an hour after m-3, so it is preserved when it falls off the list
    assert [e["path"] for e in _state(tmp_path)["preserved"]] == ["m-3.h5", "m-6.h5"]


def test_state_file_uses_relative_paths_so_directories_move(tmp_path):
    src = tmp_path / "run1"
    src.mkdir()
    v = ckpt.Variable([1.0, 2.0])
    ckpt.Saver([v]).save(str(src / "m.h5"), global_step=1)
    moved = tmp_path / "moved"
    os.rename(src, moved)
    assert ckpt.latest_checkpoint(moved) == str(moved / "m-1.h5")
    v.assign([0, 0])
    ckpt.Saver([v]).restore(moved)
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])


def test_latest_checkpoint_skips_deleted_files_and_handles_empty_dirs(tmp_path):
    assert ckpt.latest_checkpoint(tmp_path) is None
    assert ckpt.latest_checkpoint(tmp_path / "missing") is None
    saver = ckpt.Saver([ckpt.Variable(0.0)])
    a = saver.save(str(tmp_path / "m.h5"), global_step=1)
    b = saver.save(str(tmp_path / "m.h5"), global_step=2)
    os.unlink(b)
    assert ckpt.latest_checkpoint(tmp_path) == a
    with pytest.raises(ckpt.CheckpointNotFoundError, match="no such checkpoint file"):
        ckpt.Saver([ckpt.Variable(0.0)]).restore(str(tmp_path / "does_not_exist"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ckpt.CheckpointNotFoundError, match="no checkpoint in this directory"):
        ckpt.Saver([ckpt.Variable(0.0)]).restore(empty)


def test_a_newer_state_file_is_a_clear_error(tmp_path):
    (tmp_path / "checkpoint").write_bytes(b'{"format": "ckpt-state", "version": 99, "checkpoints": []}')
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="checkpoint"):
        ckpt.latest_checkpoint(tmp_path)
    with pytest.raises(ckpt.UnsupportedCheckpointError):
        ckpt.Saver([ckpt.Variable(0.0)]).save(str(tmp_path / "m.h5"))


@pytest.mark.parametrize("content, problem", [
    (b"", "not valid JSON"), (b"not json", "not valid JSON"), (b'{"format": "ckpt-st', "not valid JSON"),
    (b'{"format": "ckpt-state", "version": 1, "checkpoints": [{"path": "../../etc/x", "time": 1}]}',
     "not a file name in this directory"),
    (b'{"format": "ckpt-state", "version": 1, "checkpoints": {}}', "malformed state file"),
    (b'{"format": "ckpt-state", "version": 1, "checkpoints": [], "pending": [{"path": 3}]}', "malformed"),
    (b"[]", "not a ckpt state file"),
])
def test_a_damaged_state_file_falls_back_to_the_verified_checkpoints(tmp_path, content, problem):
    """Empty, non-JSON or malformed: readers go by the checkpoints of the directory (newest step
    first, each verified) with a warning; the next save rewrites the state file and keeps them."""
    var = ckpt.Variable(0.0)
    saver = ckpt.Saver({"w": var}, max_to_keep=3)
    for step in (1, 2, 10):
        var.assign(float(step))
        saver.save(str(tmp_path / "model.h5"), global_step=step)
    damaged = tmp_path / "model-11.h5"  # newest by name, but it does not verify: never picked
    data = (tmp_path / "model-10.h5").read_bytes()
    damaged.write_bytes(data[:len(data) // 2])  # cut short, as a lost write leaves it
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "checkpoint").write_bytes(content)

    with pytest.warns(ckpt.StateFileWarning, match=f"{problem}.*found 3 checkpoint.*'model-10.h5'.*model-11.h5"):
        assert ckpt.latest_checkpoint(tmp_path) == str(tmp_path / "model-10.h5")
    var.assign(0.0)
    with pytest.warns(ckpt.StateFileWarning):
        assert ckpt.Saver({"w": var}).restore(str(tmp_path)).path == str(tmp_path / "model-10.h5")
    assert float(var.numpy()) == 10.0
    with pytest.warns(ckpt.StateFileWarning):
        rows = ckpt.list_checkpoints(tmp_path)
    assert [(r.path, r.step, r.note) for r in rows if "state file" not in r.note] == [
        ("model-1.h5", 1, ""), ("model-2.h5", 2, ""), ("model-10.h5", 10, "latest")]

    # the next save rewrites a valid state file; the earlier checkpoints are entries retention counts
    with pytest.warns(ckpt.StateFileWarning):
        saver.save(str(tmp_path / "model.h5"), global_step=12)
    state = read_state(str(tmp_path))
    assert [e.path for e in state.checkpoints] == ["model-2.h5", "model-10.h5", "model-12.h5"]
    assert not (tmp_path / "model-1.h5").exists() and damaged.exists()  # the damaged file is left alone
    assert ckpt.latest_checkpoint(tmp_path) == str(tmp_path / "model-12.h5")  # no warning any more


def test_tensorflow_state_files_are_read_but_never_rewritten(tmp_path):
    (tmp_path / "checkpoint").write_text('model_checkpoint_path: "model.h5"\n'
                                         'all_model_checkpoint_paths: "model.h5"\n')
    assert ckpt.latest_checkpoint(tmp_path) is None  # names a file that does not exist
    with pytest.raises(ckpt.CheckpointWriteError, match="tensorflow 'checkpoint' state file"):
        ckpt.Saver([ckpt.Variable(0.0)]).save(str(tmp_path / "model.h5"))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint"]  # refused before writing anything
    (tmp_path / "model.h5").write_bytes(b"")
    assert ckpt.latest_checkpoint(tmp_path) == str(tmp_path / "model.h5")


def test_leftover_temporary_files_are_ignored_and_cleaned(tmp_path):
    saver = ckpt.Saver([ckpt.Variable(0.0)])
    good = saver.save(str(tmp_path / "m.h5"), global_step=1)
    leftover = tmp_path / ".m-2.h5.ckpt-tmp-0123456789ab"
    leftover.write_bytes(b"half a checkpoint")
    assert ckpt.latest_checkpoint(tmp_path) == good
    saver.save(str(tmp_path / "m.h5"), global_step=3)
    assert not leftover.exists()


def test_a_temporary_file_being_written_is_not_cleaned(tmp_path):
    import fcntl

    busy = tmp_path / ".m-9.h5.ckpt-tmp-aaaaaaaaaaaa"
    fd = os.open(busy, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a live save in another process holds it
    try:
        ckpt.Saver([ckpt.Variable(0.0)]).save(str(tmp_path / "m.h5"), global_step=1)
        assert busy.exists()
    finally:
        os.close(fd)


def test_failed_write_leaves_previous_checkpoint_and_no_temp(tmp_path, monkeypatch):
    v = ckpt.Variable([1.0, 2.0])
    saver = ckpt.Saver([v])
    first = saver.save(str(tmp_path / "m.h5"))
    before = pathlib.Path(first).read_bytes()
    from ckpt.storage import localfile

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(localfile, "pwrite_all", full_disk)
    v.assign([3.0, 4.0])
    with pytest.raises(ckpt.CheckpointWriteError, match=r"m\.h5.*No space left"):
        saver.save(str(tmp_path / "m.h5"))
    assert pathlib.Path(first).read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == [".checkpoint.lock", "checkpoint", "m.h5"]


# --- restore rules --------------------------------------------------------------------------
def test_restore_reads_into_the_existing_buffer(tmp_path, ext):
    v = ckpt.Variable(np.arange(6, dtype=np.float32).reshape(2, 3))
    path = ckpt.Saver({"v": v}).save(str(tmp_path / f"m.{ext}"))
    buffer = v._value
    v.assign(np.zeros((2, 3)))
    ckpt.Saver({"v": v}).restore(path)
    assert v._value is buffer
    np.testing.assert_array_equal(v.numpy(), np.arange(6).reshape(2, 3))


def test_restore_reports_every_problem_at_once_and_changes_nothing(tmp_path, ext):
    a = ckpt.Variable(np.ones((784, 100), np.float32))
    b = ckpt.Variable(np.ones(3, np.float32))
    c = ckpt.Variable(np.ones(2, np.int32))
    path = ckpt.Saver({"layer1/kernel": a, "layer1/bias": b, "layer2/b": c}).save(str(tmp_path / f"model-1000.{ext}"))
    x = ckpt.Variable(np.zeros((784, 200), np.float32))
    y = ckpt.Variable(np.zeros(3, np.float32))
    z = ckpt.Variable(np.zeros(2, np.float32))
    w = ckpt.Variable(np.zeros(2, np.float32))
    saver = ckpt.Saver({"layer1/kernel": x, "layer1/bias": y, "layer2/b": z, "layer2/bias": w})
    with pytest.raises(ckpt.CheckpointError) as info:
        saver.restore(path)
    message = str(info.value)
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    assert f"layer1/kernel: shape (784, 200) in the model, (784, 100) in model-1000.{ext}" in message
    assert "layer2/b: dtype float32 in the model, int32 in" in message
    assert "layer2/bias: not found in" in message and "closest keys: layer1/bias, layer2/b" in message
    assert "\n  layer1/bias:" not in message  # the one that matched is not a problem
    for var in (x, y, z, w):
        assert not var.numpy().any()  # nothing changed, not even the variable that matched


def test_shape_mismatch_alone_is_a_value_error_not_a_key_error(tmp_path):
    path = ckpt.Saver({"w": ckpt.Variable(np.ones(3))}).save(str(tmp_path / "m.h5"))
    with pytest.raises(ckpt.MismatchError) as info:
        ckpt.Saver({"w": ckpt.Variable(np.ones(4))}).restore(path)
    assert not isinstance(info.value, KeyError)


def test_strict_false_restores_what_matches(tmp_path, ext):
    path = ckpt.Saver({"a": ckpt.Variable(1.0), "extra": ckpt.Variable(2.0)}).save(str(tmp_path / f"m.{ext}"))
    a, b = ckpt.Variable(0.0), ckpt.Variable(0.0)
    result = ckpt.Saver({"a": a, "b": b}).restore(path, strict=False)
    assert (result.restored, result.missing, result.unexpected) == (["a"], ["b"], ["extra"])
    assert float(a) == 1.0 and float(b) == 0.0
    with pytest.raises(ckpt.MismatchError):
        ckpt.Saver({"a": ckpt.Variable([0.0, 0.0])}).restore(path, strict=False)


class _Dense(ckpt.Module):
    def __init__(self, n_in, n_out, name=None):
        super().__init__(name=name)
        with self.name_scope:
            self.kernel = ckpt.Variable(np.arange(n_in * n_out, dtype=np.float32).reshape(n_in, n_out), name="kernel")
            self.b = ckpt.Variable(np.ones(n_out, np.float32), name="b")


class _Net(ckpt.Module):
    def __init__(self, name="net"):
        super().__init__(name=name)
        with self.name_scope:
            self.layers = [_Dense(2, 3, name="d0"), _Dense(3, 1, name="d1")]


def test_a_file_keyed_by_variable_names_restored_by_attribute_paths_says_which_saver(tmp_path):
    net = _Net()
    path = ckpt.Saver(net.variables).save(str(tmp_path / "names.h5"))  # keys "net/d0/kernel", ...
    with pytest.raises(ckpt.KeyNotFoundError) as info:
        ckpt.Saver(net).restore(path)
    message = str(info.value)
    assert "layers/0/b: not found in names.h5" in message and info.value.path == path
    assert ("hint: names.h5 is keyed by variable names ('net/d0/b' holds layers/0/b), as Saver(module.variables) "
            "writes them; this Saver uses attribute paths: restore with Saver(module.variables)") in message
    assert "strict=False" not in message  # it would restore nothing
    assert ckpt.Saver(net.variables).restore(path).restored  # the Saver the hint names


def test_a_file_keyed_by_attribute_paths_restored_by_variable_names_says_which_saver(tmp_path):
    net = _Net()
    path = ckpt.Saver(net).save(str(tmp_path / "paths.h5"))  # keys "layers/0/kernel", ...
    with pytest.raises(ckpt.KeyNotFoundError) as info:
        ckpt.Saver(net.variables).restore(path)
    assert ("hint: paths.h5 looks keyed by attribute paths ('layers/0/b' for variable net/d0/b), as "
            "Saver(module) writes them; this Saver uses variable names: restore with Saver(module)") in str(info.value)


def test_only_model_side_keys_missing_suggests_strict_false(tmp_path):
    net = _Net()
    path = ckpt.Saver({"layers/0/kernel": net.layers[0].kernel, "layers/0/b": net.layers[0].b}).save(
        str(tmp_path / "part.h5"))
    with pytest.raises(ckpt.KeyNotFoundError) as info:
        ckpt.Saver(net).restore(path)
    assert ("hint: restore(..., strict=False) restores the other 2 and reports these in its result's .missing"
            in str(info.value))
    other = ckpt.Saver({"layers/0/b": ckpt.Variable(np.zeros(5, np.float32)), "head/w": ckpt.Variable(1.0)})
    with pytest.raises(ckpt.KeyNotFoundError) as info:  # a shape mismatch too: strict=False would not do
        other.restore(path)
    assert "hint:" not in str(info.value)
    with pytest.raises(ckpt.KeyNotFoundError) as info:  # init_from_checkpoint maps keys itself: no Saver hints
        ckpt.init_from_checkpoint(path, {"layers/9/": net.layers[1]})
    assert "hint:" not in str(info.value)


def test_checksum_failure_midway_uninitializes_touched_variables(tmp_path, ext):
    first, second, third = (ckpt.Variable(np.full(4, i, np.float32)) for i in (1, 2, 3))
    path = ckpt.Saver({"a": first, "b": second, "c": third}).save(str(tmp_path / f"m.{ext}"))
    offset = data_offset(path, np.full(4, 2, np.float32))
    raw = bytearray(pathlib.Path(path).read_bytes())
    raw[offset] ^= 0xFF
    pathlib.Path(path).write_bytes(raw)
    x, y, z = (ckpt.Variable(np.full(4, 9, np.float32), name=n) for n in ("x", "y", "z"))
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"(?s)'b'.*checksum.*uninitialized.*x:0, y:0") as info:
        ckpt.Saver({"a": x, "b": y, "c": z}).restore(path)
    assert not x.is_initialized() and not y.is_initialized()
    with pytest.raises(ckpt.UninitializedVariableError):
        y.numpy()
    # z is either listed as overwritten (and uninitialized) or untouched with its old value
    assert ("z:0" in str(info.value)) != z.is_initialized()
    if z.is_initialized():
        np.testing.assert_array_equal(z.numpy(), np.full(4, 9))


def test_restore_initializes_deferred_variables(tmp_path):
    path = ckpt.Saver({"w": ckpt.Variable(np.arange(4.0))}).save(str(tmp_path / "m.h5"))
    with ckpt.deferred_init():
        w = ckpt.Variable(ckpt.initializers.GlorotUniform(), shape=(4,), dtype=np.float64)
    assert w._value is None
    ckpt.Saver({"w": w}).restore(path)
    assert w.is_initialized()
    np.testing.assert_array_equal(w.numpy(), np.arange(4.0))


# --- reading without a model ------------------------------------------------------------------
def test_load_checkpoint_api(tmp_path, ext):
    with ckpt.name_scope("enc"):
        k = ckpt.Variable(np.ones((2, 3), np.float32), name="kernel")
        b = ckpt.Variable(np.zeros(3, np.float64), name="bias")
    path = ckpt.Saver([k, b]).save(str(tmp_path / f"m.{ext}"))
    with ckpt.load_checkpoint(tmp_path) as reader:
        assert reader.path == path
        assert reader.get_variable_to_shape_map() == {"enc/kernel": [2, 3], "enc/bias": [3]}
        assert reader.get_variable_to_dtype_map() == {"enc/kernel": np.float32, "enc/bias": np.float64}
        assert reader.has_tensor("enc/bias") and not reader.has_tensor("enc/nope")
        np.testing.assert_array_equal(reader.get_tensor("enc/kernel"), np.ones((2, 3)))
        with pytest.raises(ckpt.KeyNotFoundError, match="'enc/kernle'.*closest keys: enc/kernel"):
            reader.get_tensor("enc/kernle")
    assert ckpt.list_variables(path) == [("enc/bias", [3]), ("enc/kernel", [2, 3])]
    np.testing.assert_array_equal(ckpt.load_variable(path, "enc/bias:0"), np.zeros(3))
    with pytest.raises(KeyError):
        ckpt.load_variable(path, "nope")


def test_restore_time_is_recorded_in_state(tmp_path):
    t0 = time.time()
    ckpt.Saver([ckpt.Variable(0.0)]).save(str(tmp_path / "m.h5"))
    assert _state(tmp_path)["checkpoints"][0]["time"] >= t0 - 1


def test_write_errors_name_the_checkpoint_not_the_temporary_file(tmp_path):
    z = ckpt.Variable(np.zeros(2, np.complex128))
    target = str(tmp_path / "m.safetensors")
    with pytest.raises(ckpt.UnsupportedCheckpointError) as info:
        ckpt.Saver({"z": z}).save(target)
    assert target in str(info.value) and "ckpt-tmp" not in str(info.value)
    assert os.listdir(tmp_path) == []


# --- TF1 habits -------------------------------------------------------------------------------
def test_max_to_keep_zero_keeps_every_checkpoint_as_in_tf1(tmp_path):
    saver = ckpt.Saver([ckpt.Variable(1.0)], max_to_keep=0)
    paths = [saver.save(str(tmp_path / "m.h5"), global_step=s) for s in range(7)]
    assert saver.last_checkpoints == paths
    assert all(os.path.exists(p) for p in paths)
    with pytest.raises(ValueError, match="max_to_keep"):
        ckpt.Saver([ckpt.Variable(1.0)], max_to_keep=-1)


def test_a_new_saver_restoring_a_directory_lists_its_checkpoints(tmp_path):
    v = ckpt.Variable([1.0, 2.0])
    paths = [ckpt.Saver({"v": v}, max_to_keep=3).save(str(tmp_path / "m.h5"), global_step=s) for s in range(4)]
    resumed = ckpt.Saver({"v": v}, max_to_keep=3)
    assert resumed.last_checkpoints == []  # bound to no directory yet
    resumed.restore(str(tmp_path))
    assert resumed.last_checkpoints == paths[1:]
    by_file = ckpt.Saver({"v": v})
    by_file.restore(paths[2])
    assert by_file.last_checkpoints == paths[1:]
    newest = resumed.save(str(tmp_path / "m.h5"), global_step=9)
    assert resumed.last_checkpoints == paths[2:] + [newest]
    resumed.restore(ckpt.Saver({"v": v}).save(str(tmp_path / "other" / "x.h5")))  # after a save: its own list
    assert resumed.last_checkpoints == paths[2:] + [newest]


def test_restore_allow_cast_converts_same_kind_dtypes_only(tmp_path):
    path = ckpt.save_file({"w": np.array([1.5, -2.25], np.float32), "i": np.array([1, 2], np.int64),
                           "big": np.array([2 ** 40], np.int64)}, str(tmp_path / "f32.h5"))
    w64 = ckpt.Variable(np.zeros(2, np.float64))
    with pytest.raises(ckpt.MismatchError, match=r"w: dtype float64 in the model, float32 .*allow_cast=True"):
        ckpt.Saver({"w": w64}).restore(path)
    assert ckpt.Saver({"w": w64, "i": (f := ckpt.Variable(np.zeros(2, np.float32)))}).restore(
        path, allow_cast=True).restored == ["w", "i"]
    assert w64.dtype == np.float64 and w64.numpy().tolist() == [1.5, -2.25]
    assert f.numpy().tolist() == [1.0, 2.0]  # int -> float
    to_int = ckpt.Variable(np.zeros(2, np.int32))
    with pytest.raises(ckpt.MismatchError, match=r"w: dtype int32 in the model, float32") as info:
        ckpt.Saver({"w": to_int}).restore(path, allow_cast=True)  # float -> int is not same_kind
    assert "allow_cast=True" not in str(info.value)
    small = ckpt.Variable(np.zeros(1, np.int32))
    untouched = ckpt.Variable(np.zeros(2, np.float64))
    with pytest.raises(ckpt.MismatchError, match=r"big: value 1099511627776 does not fit in int32"):
        ckpt.Saver({"w": untouched, "big": small}).restore(path, allow_cast=True)
    assert untouched.numpy().tolist() == [0.0, 0.0] and small.numpy().tolist() == [0]  # nothing changed


def test_a_checkpoint_named_without_its_extension_is_found_when_it_is_the_only_one(tmp_path):
    """TensorFlow's habit: restore("run/model-1") for run/model-1.h5."""
    v = ckpt.Variable([1.0, 2.0])
    saver = ckpt.Saver({"v": v})
    for step in (1, 2):
        saver.save(str(tmp_path / "run" / "model.h5"), global_step=step)
    v.assign([0.0, 0.0])
    assert saver.restore(str(tmp_path / "run" / "model-1")).path == str(tmp_path / "run" / "model-1.h5")
    assert v.numpy().tolist() == [1.0, 2.0]
    with ckpt.load_checkpoint(str(tmp_path / "run" / "model-2")) as reader:
        assert reader.path == str(tmp_path / "run" / "model-2.h5")
    with pytest.raises(ckpt.CheckpointNotFoundError, match=r"run/model: no such checkpoint file; .*run holds "
                       r"model-1\.h5, model-2\.h5 \(restore the directory for its latest\)"):
        saver.restore(str(tmp_path / "run" / "model"))
    ckpt.Saver({"v": v}, format="msgpack").save(str(tmp_path / "run" / "model"), global_step=1)
    with pytest.raises(ckpt.CheckpointNotFoundError, match=r"model-1: no such checkpoint file; it is the prefix of "
                       r"model-1\.h5, model-1\.msgpack: name one") as info:
        saver.restore(str(tmp_path / "run" / "model-1"))
    assert info.value.path == str(tmp_path / "run" / "model-1")
    with pytest.raises(ckpt.CheckpointNotFoundError, match="model-9: no such checkpoint file$"):
        saver.restore(str(tmp_path / "run" / "model-9"))
