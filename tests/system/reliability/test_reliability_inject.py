"""Injected failures: every step of a save (and of a restore) fails in turn, with ENOSPC and EIO.

A recorder first lists every system call a save makes (create, lock, write, fsync, rename,
directory fsync, state-file lock/read/write, deletions); then each call is made to fail once.
After every failure: the error is a CheckpointError naming the file and the cause; the
previous checkpoints and the state file are intact (or the new checkpoint is completely
recorded, when only a step after the state file's rename failed); no temporary file is left;
the next save works and cleans up. A child process also saves under RLIMIT_FSIZE limits, so
the kernel itself fails writes (EFBIG) at arbitrary byte offsets, inside libhdf5 too.
"""

from __future__ import annotations

import builtins
import collections
import errno
import fcntl
import json
import os
import random
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import pytest
from reliability_support import equal_tensors, restore_outcome, sentinel_like, small_tensors, step_of, step_tensors

import ckpt
from ckpt.storage.atomic import is_temporary
from ckpt.saving.stores import open_store
from ckpt.storage.state import LOCK_FILE, STATE_FILE, read_state
from conftest import TESTS

HERE = TESTS
ERRNOS = [errno.ENOSPC, errno.EIO]


class Injected(OSError):
    """The OSError the fault injector raises (a subclass, so tests can find it in a chain)."""


class FileProxy:
    """A file object whose write/flush/close go through the injector."""

    def __init__(self, faults: Faults, f: Any) -> None:
        self._faults, self._f = faults, f

    def write(self, data: Any) -> Any:
        self._faults.hit("file.write")
        return self._f.write(data)

    def flush(self) -> None:
        self._faults.hit("file.flush")
        self._f.flush()

    def close(self) -> None:
        self._faults.hit("file.close", before=self._f.close)  # like close(2): closed even when it fails

    def __enter__(self) -> FileProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


class Faults:
    """Wraps the functions a save or restore calls; records calls, fails the n-th one."""

    WRAPPED: ClassVar[list[tuple[object, str]]] = [(os, "open"), (os, "write"), (os, "pwrite"), (os, "pwritev"), (os, "preadv"), (os, "fsync"), (os, "replace"),
               (os, "close"), (os, "unlink"), (os, "listdir"), (fcntl, "flock")]

    def __init__(self, fail_at: int | None = None, code: int = errno.EIO) -> None:
        self.calls: list[str] = []
        self.fail_at, self.code = fail_at, code
        self.failed: str | None = None
        self._saved: list[tuple[Any, str, Any]] = []

    def hit(self, label: str, before: Callable[[], Any] | None = None) -> None:
        """Count a call; raise the injected error if it is the chosen one."""
        self.calls.append(label)
        if len(self.calls) - 1 == self.fail_at:
            self.failed = label
            if before is not None:
                before()
            raise Injected(self.code, f"{os.strerror(self.code)} (injected at {label})")
        if before is not None:
            before()

    def __enter__(self) -> Faults:
        import h5py

        for owner, name in self.WRAPPED:
            self._wrap(owner, name)
        real_open = builtins.open

        def fake_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            self.hit("open")
            f = real_open(file, mode, *args, **kwargs)
            return FileProxy(self, f) if any(c in mode for c in "wax+") else f

        self._saved.append((builtins, "open", real_open))
        builtins.open = fake_open
        real_file = h5py.File

        def fake_file(*args: Any, **kwargs: Any) -> Any:
            self.hit("h5py.File")
            return real_file(*args, **kwargs)

        self._saved.append((h5py, "File", real_file))
        h5py.File = fake_file
        return self

    def _wrap(self, owner: Any, name: str) -> None:
        real = getattr(owner, name)
        label = f"{owner.__name__}.{name}"

        def fake(*args: Any, **kwargs: Any) -> Any:
            if name == "close":  # close(2) releases the descriptor even when it reports an error
                self.hit(label, before=lambda: real(*args, **kwargs))
                return None
            self.hit(label)
            return real(*args, **kwargs)

        self._saved.append((owner, name, real))
        setattr(owner, name, fake)

    def __exit__(self, *exc: object) -> None:
        for owner, name, real in reversed(self._saved):
            setattr(owner, name, real)


def snapshot(directory: str) -> dict[str, bytes]:
    out = {}
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = f.read()
    return out


def make_run(directory: str, ext: str) -> tuple[ckpt.Saver, dict[str, ckpt.Variable]]:
    """A directory holding checkpoints of steps 1 and 2 (max_to_keep=2), and its Saver."""
    os.makedirs(directory)
    variables = {key: ckpt.Variable(value) for key, value in step_tensors(1).items()}
    saver = ckpt.Saver(variables, max_to_keep=2)
    for step in (1, 2):
        assign(variables, step)
        saver.save(os.path.join(directory, "model" + ext), global_step=step)
    return saver, variables


def assign(variables: dict[str, ckpt.Variable], step: int) -> None:
    for key, value in step_tensors(step).items():
        variables[key].assign(value)


def checkpoint_step(path: str) -> int:
    with ckpt.load_checkpoint(path) as reader:
        assert reader.verify() == [], path
        return step_of({key: reader.get_tensor(key) for key in reader.tensors})


def trace_save(directory: str, ext: str) -> list[str]:
    """The calls a normal save of step 3 makes (over a directory holding steps 1 and 2)."""
    saver, variables = make_run(directory, ext)
    assign(variables, 3)
    with Faults() as faults:
        saver.save(os.path.join(directory, "model" + ext), global_step=3)
    return faults.calls


@pytest.mark.parametrize("ext", [".h5", ".msgpack"])
def test_every_step_of_a_save_fails_cleanly(tmp_path, ext):
    calls = trace_save(str(tmp_path / "trace"), ext)
    # the steps the issue names are all in the trace (the format's data writes included)
    assert {"fcntl.flock", "os.fsync", "os.replace", "os.unlink"} <= set(calls)
    assert {"os.pwrite", "os.pwritev"} <= set(calls)  # the format's writes through its LocalSink
    outcomes: collections.Counter = collections.Counter()
    for index in representative(calls):
        label = calls[index]
        for code in ERRNOS:
            where = f"{ext}: {os.strerror(code)} at call {index} ({label})"
            outcome = run_one_failure(str(tmp_path / f"run-{index}-{code}"), ext, index, code, where)
            outcomes[outcome] += 1
    print(f"\n{ext}: {len(representative(calls))} of {len(calls)} calls x {len(ERRNOS)} errors: {dict(outcomes)}")
    assert outcomes["failed, nothing changed"] > 0 and outcomes["failed after recording"] >= 0


def representative(calls: list[str]) -> list[int]:
    """Indices of every call, except the middle of runs of one call (json.dump writes per token)."""
    keep = []
    for i, label in enumerate(calls):
        first = i == 0 or calls[i - 1] != label
        last = i == len(calls) - 1 or calls[i + 1] != label
        second = i >= 1 and calls[i - 1] == label and (i == 1 or calls[i - 2] != label)
        if first or last or second:
            keep.append(i)
    return keep


def run_one_failure(directory: str, ext: str, index: int, code: int, where: str) -> str:
    """Fail call ``index`` of a save with ``code``; check every guarantee; name the outcome."""
    saver, variables = make_run(directory, ext)
    before = snapshot(directory)
    assign(variables, 3)
    target = os.path.join(directory, f"model-3{ext}")
    error: BaseException | None = None
    with warnings.catch_warnings(record=True) as caught, Faults(index, code) as faults:
        warnings.simplefilter("always")
        try:
            saver.save(os.path.join(directory, "model" + ext), global_step=3)
        except BaseException as exc:  # anything but a CheckpointWriteError is checked below
            error = exc
    assert faults.failed is not None, where  # the same calls happened, the chosen one failed
    after = snapshot(directory)

    assert not [n for n in after if is_temporary(n)], f"{where}: temporary file left behind"
    # the variables a failed save read from are untouched
    assert step_of({k: np.asarray(v.value()) for k, v in variables.items()}) == 3
    state = open_store(directory).effective_state()  # what readers go by: pending entries settled
    listed = [e.path for e in state.checkpoints]
    if error is None:
        # a failure the save may ignore: listing or deleting leftovers, deleting an old checkpoint
        assert faults.failed in ("os.listdir", "os.unlink", "os.open", "fcntl.flock", "os.close"), where
        assert listed == [f"model-2{ext}", f"model-3{ext}"] and checkpoint_step(target) == 3, where
        if faults.failed == "os.unlink":
            assert any("could not delete old checkpoint" in str(w.message) for w in caught), where
        outcome = "succeeded despite the failure"
    else:
        assert isinstance(error, ckpt.CheckpointWriteError), f"{where}: {type(error).__name__}: {error}"
        message = str(error)
        assert os.strerror(code) in message, f"{where}: the cause is not in {message!r}"
        assert target in message or os.path.join(directory, STATE_FILE) in message, \
            f"{where}: the message {message!r} names neither the checkpoint nor the state file"
        assert _caused_by_injected(error), f"{where}: the injected OSError is not chained"
        if listed == [f"model-1{ext}", f"model-2{ext}"]:
            # the previous state (the state file, or it with the save's pending entry, which counts only
            # once its file is in place) and checkpoints are exactly as they were
            assert listed == [f"model-1{ext}", f"model-2{ext}"], where
            for name in listed:
                assert after[name] == before[name], f"{where}: {name} changed"
            assert ckpt.latest_checkpoint(directory) == os.path.join(directory, f"model-2{ext}")
            # a checkpoint that could not be recorded is removed again: no orphan on a full disk
            assert not os.path.exists(target), f"{where}: an unrecorded {target} was left behind"
            if "could not be recorded" in message:
                assert "it was removed" in message, where
                outcome = "failed recording, new file removed"
            else:
                outcome = "failed, nothing changed"
        else:
            # only a step after the state file's rename can fail here: the new checkpoint is recorded
            assert listed == [f"model-2{ext}", f"model-3{ext}"], where
            assert checkpoint_step(target) == 3 and after[f"model-2{ext}"] == before[f"model-2{ext}"]
            assert ckpt.latest_checkpoint(directory) == target
            assert "untouched" not in message, f"{where}: {message!r} claims nothing changed"
            outcome = "failed after recording"

    # the next save works and leaves exactly the kept checkpoints
    assign(variables, 4)
    path = saver.save(os.path.join(directory, "model" + ext), global_step=4)
    assert ckpt.latest_checkpoint(directory) == path and checkpoint_step(path) == 4
    listed = {e.path for e in read_state(directory).checkpoints}
    assert set(os.listdir(directory)) == listed | {STATE_FILE, LOCK_FILE}, where
    return outcome


def _caused_by_injected(error: BaseException) -> bool:
    seen = error
    while seen is not None:
        if isinstance(seen, Injected):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def test_a_save_killed_before_deleting_old_checkpoints_leaves_them_to_the_next_save(tmp_path):
    """max_to_keep holds across crashes: dropped checkpoints are recorded before deletion."""
    directory = str(tmp_path)
    saver, variables = make_run(os.path.join(directory, "run"), ".h5")
    directory = os.path.join(directory, "run")

    class Killed(BaseException):
        pass

    def killed(path: str) -> None:
        raise Killed(path)

    real_unlink = os.unlink
    os.unlink = killed  # the process "dies" right after writing the state file
    try:
        assign(variables, 3)
        with pytest.raises(Killed):
            saver.save(os.path.join(directory, "model.h5"), global_step=3)
    finally:
        os.unlink = real_unlink
    assert os.path.exists(os.path.join(directory, "model-1.h5"))  # dropped from the list, not deleted
    assert read_state(directory).deleting == ["model-1.h5"]

    fresh = ckpt.Saver({k: ckpt.Variable(v) for k, v in step_tensors(4).items()}, max_to_keep=2)
    fresh.save(os.path.join(directory, "model.h5"), global_step=4)
    assert sorted(os.listdir(directory)) == sorted([STATE_FILE, LOCK_FILE, "model-3.h5", "model-4.h5"])
    assert [e.path for e in read_state(directory).checkpoints] == ["model-3.h5", "model-4.h5"]


def test_a_resaved_name_is_never_deleted_as_a_leftover(tmp_path):
    directory = str(tmp_path)
    variables = {key: ckpt.Variable(value) for key, value in step_tensors(1).items()}
    saver = ckpt.Saver(variables, max_to_keep=1)
    for step in (1, 2, 1):  # step 1 is dropped (deleting), then saved again under the same name
        assign(variables, step)
        saver.save(os.path.join(directory, "model.msgpack"), global_step=step)
    assert checkpoint_step(os.path.join(directory, "model-1.msgpack")) == 1
    assert ckpt.latest_checkpoint(directory) == os.path.join(directory, "model-1.msgpack")
    assert read_state(directory).deleting == ["model-2.msgpack"]
    assert not os.path.exists(os.path.join(directory, "model-2.msgpack"))


def test_hostile_deleting_list_cannot_leave_the_directory(tmp_path):
    (tmp_path / STATE_FILE).write_text(json.dumps({
        "format": "ckpt-state", "version": 1, "checkpoints": [], "deleting": ["../outside"]}))
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"'\.\./outside' is not a file name"):
        read_state(str(tmp_path))


# --- the kernel fails the writes: RLIMIT_FSIZE ----------------------------------------------------
@pytest.mark.parametrize("ext", [".h5", ".msgpack"])
def test_file_size_limit_fails_writes_anywhere_including_libhdf5(tmp_path, ext, reliability_scale):
    """EFBIG at seeded byte offsets of the checkpoint, raised by the kernel inside any writer."""
    probe = tmp_path / "probe"
    probe.mkdir()
    variables = {key: ckpt.Variable(value) for key, value in small_tensors()}
    size = os.path.getsize(ckpt.Saver(variables).save(str(probe / ("model" + ext))))
    rng = random.Random(f"fsize{ext}")
    limits = sorted({n for n in (0, 1, 511, 512, 513) if n < size} | {size - 1} |
                    {rng.randrange(size) for _ in range(60 * reliability_scale)})
    directory = tmp_path / "run"
    directory.mkdir()
    proc = subprocess.run([sys.executable, os.path.join(HERE, "reliability_child.py"), "fsize", str(directory),
                           ext, json.dumps([None] + limits)], capture_output=True, text=True, timeout=300,
                          cwd=HERE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    first, rest = results[0], results[1:]
    assert first["error"] is None and first["latest"] == f"model-1{ext}"
    assert len(rest) == len(limits)
    for result in rest:
        where = f"{ext}, writes limited to {result['limit']} bytes"
        error = result["error"]
        assert error is not None, f"{where}: a {size}-byte checkpoint was saved"
        assert error["type"] == "CheckpointWriteError", f"{where}: {error}"
        assert f"model-{result['step']}{ext}" in error["message"] and "File too large" in error["message"], where
        assert result["temporaries"] == [], f"{where}: temporary file left behind"
        assert result["latest"] == f"model-1{ext}" and result["listed"] == [f"model-1{ext}"], where
    assert checkpoint_step_small(str(directory / f"model-1{ext}"))
    print(f"\n{ext}: {len(limits)} file-size limits in [0, {size}) bytes, each a clean CheckpointWriteError")


def checkpoint_step_small(path: str) -> bool:
    with ckpt.load_checkpoint(path) as reader:
        assert reader.verify() == []
        return all(equal_tensors(value, reader.get_tensor(key)) for key, value in small_tensors())


# --- restores: every read fails in turn -------------------------------------------------------------
@pytest.mark.parametrize("ext", [".h5", ".msgpack"])
def test_every_read_of_a_restore_fails_all_or_nothing(tmp_path, ext):
    tensors = small_tensors()
    path = str(tmp_path / ("model" + ext))
    ckpt.Saver({key: ckpt.Variable(value) for key, value in tensors}).save(path)
    with Faults() as faults:
        assert restore_outcome(path, tensors) == ("restored", "")
    calls = faults.calls
    assert "os.preadv" in calls
    seen = collections.Counter()
    for index, label in enumerate(calls):
        with Faults(index, errno.EIO):
            kind, detail = restore_outcome(path, tensors)
        where = f"{ext}: EIO at call {index} ({label})"
        assert kind in ("unchanged", "partial"), f"{where}: {kind} {detail}"
        assert path in detail and "Input/output error" in detail, f"{where}: {detail}"
        seen[kind] += 1
    assert seen["partial"] > 0  # some reads failed mid-way, after tensors were written


@pytest.mark.parametrize("ext", [".h5", ".msgpack"])
def test_an_interrupted_restore_leaves_no_half_restored_variable(tmp_path, ext):
    """A KeyboardInterrupt mid-read propagates as itself; touched variables become uninitialized."""
    tensors = small_tensors()
    path = str(tmp_path / ("model" + ext))
    ckpt.Saver({key: ckpt.Variable(value) for key, value in tensors}).save(path)
    real = os.preadv
    with Faults() as faults:
        ckpt.load_checkpoint(path).close()
    opening = faults.calls.count("os.preadv")  # reads of the header and index
    calls = []

    def interrupted(*args: Any) -> Any:
        calls.append(args)
        if len(calls) > opening:  # the first read of tensor data
            raise KeyboardInterrupt
        return real(*args)

    variables = {key: ckpt.Variable(sentinel_like(value)) for key, value in tensors}
    os.preadv = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            ckpt.Saver(variables).restore(path)
    finally:
        os.preadv = real
    for key, value in tensors:
        var = variables[key]
        assert not var.is_initialized() or equal_tensors(sentinel_like(value), np.asarray(var.value())), key
    assert any(not v.is_initialized() for v in variables.values())
