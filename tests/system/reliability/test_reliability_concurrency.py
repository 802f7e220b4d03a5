"""Concurrency: Savers in threads and in processes share one directory while others restore.

No saver loses another's entries in the state file; no reader ever sees a half-written
checkpoint under a real name; a restore while others save always reads one complete,
consistent checkpoint (every tensor of it encodes the same writer and step).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
from reliability_support import step_of, step_tensors

import ckpt
from ckpt.saving import locations as _locations
from ckpt.storage.atomic import is_temporary
from ckpt.storage.state import LOCK_FILE, STATE_FILE, read_state
from conftest import TESTS

HERE = TESTS
SAVES = 30  # per writer, x --reliability-scale
NAME = re.compile(r"w(\d+)-(\d+)\.(h5|msgpack)$")


def fresh_variables() -> dict[str, ckpt.Variable]:
    return {key: ckpt.Variable(np.zeros_like(v) if v.dtype.kind != "O" else np.full(v.shape, b"", object))
            for key, v in step_tensors(0).items()}


class Watcher:
    """Restores the directory's latest checkpoint and opens every visible checkpoint, repeatedly."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.variables = fresh_variables()
        self.saver = ckpt.Saver(self.variables)
        self.counts: collections.Counter = collections.Counter()

    def check_once(self) -> None:
        if ckpt.latest_checkpoint(self.directory) is not None:
            result = self.saver.restore(self.directory)
            writer, step = map(int, NAME.search(result.path).groups()[:2])
            values = {k: np.asarray(v.value()) for k, v in self.variables.items()}
            assert step_of(values, writer) == step, result.path  # one complete, consistent checkpoint
            self.counts["restores"] += 1
        for name in os.listdir(self.directory):
            match = NAME.search(name)
            if match is None or is_temporary(name):
                continue
            try:
                reader = ckpt.load_checkpoint(os.path.join(self.directory, name))
            except ckpt.CheckpointNotFoundError:
                continue  # deleted by max_to_keep since the listing
            with reader:  # a visible name is always a complete file
                assert reader.verify() == [], name
                values = {k: reader.get_tensor(k) for k in reader.tensors}
            assert step_of(values, int(match.group(1))) == int(match.group(2)), name
            self.counts["files opened"] += 1


def check_final_state(directory: str, expected_names: set[str], max_to_keep: int | None) -> None:
    state = read_state(directory)
    listed = [e.path for e in state.checkpoints]
    assert len(listed) == len(set(listed))
    if max_to_keep is None:
        assert set(listed) == expected_names, f"lost entries: {sorted(expected_names - set(listed))}"
    else:
        assert len(listed) == max_to_keep and set(listed) <= expected_names
    names = set(os.listdir(directory))
    assert names == set(listed) | {STATE_FILE, LOCK_FILE}, sorted(names - set(listed))
    for name in listed:
        writer, step = map(int, NAME.search(name).groups()[:2])
        with ckpt.load_checkpoint(os.path.join(directory, name)) as reader:
            assert reader.verify() == []
            assert step_of({k: reader.get_tensor(k) for k in reader.tensors}, writer) == step


@pytest.mark.parametrize("max_to_keep", [None, 3])
def test_savers_in_threads_share_a_directory(tmp_path, max_to_keep, reliability_scale):
    directory = str(tmp_path)
    saves = SAVES * reliability_scale
    errors: list[BaseException] = []
    done = threading.Event()

    def writer(number: int, ext: str) -> None:
        try:
            variables = {k: ckpt.Variable(v) for k, v in step_tensors(1, number).items()}
            saver = ckpt.Saver(variables, max_to_keep=max_to_keep)
            for step in range(1, saves + 1):
                for key, value in step_tensors(step, number).items():
                    variables[key].assign(value)
                saver.save(os.path.join(directory, f"w{number}{ext}"), global_step=step)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(1, ".h5")), threading.Thread(target=writer, args=(2, ".msgpack"))]
    watcher = Watcher(directory)
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            watcher.check_once()
    finally:
        for t in threads:
            t.join()
        done.set()
    assert not errors, errors
    expected = {f"w1-{s}.h5" for s in range(1, saves + 1)} | {f"w2-{s}.msgpack" for s in range(1, saves + 1)}
    check_final_state(directory, expected, max_to_keep)
    assert watcher.counts["restores"] > 0
    print(f"\nthreads, max_to_keep={max_to_keep}: {2 * saves} saves, {dict(watcher.counts)} while saving")


@pytest.mark.parametrize("max_to_keep", [None, 2])
def test_savers_in_processes_share_a_directory_while_restoring(tmp_path, max_to_keep, reliability_scale):
    directory = str(tmp_path)
    saves = SAVES * reliability_scale
    keep = "none" if max_to_keep is None else str(max_to_keep)
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "reliability_child.py"), "saver", directory,
                               str(number), ext, str(saves), keep], cwd=HERE, stderr=subprocess.PIPE, text=True)
             for number, ext in ((1, ".h5"), (2, ".msgpack"), (3, ".h5"))]
    watcher = Watcher(directory)
    try:
        while any(p.poll() is None for p in procs):
            watcher.check_once()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        outputs = [p.communicate(timeout=60)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    expected = {f"w{n}-{s}{ext}" for n, ext in ((1, ".h5"), (2, ".msgpack"), (3, ".h5")) for s in range(1, saves + 1)}
    check_final_state(directory, expected, max_to_keep)
    assert watcher.counts["restores"] > 0 and watcher.counts["files opened"] > 0
    print(f"\nprocesses, max_to_keep={max_to_keep}: {3 * saves} saves, {dict(watcher.counts)} while saving")


@pytest.mark.parametrize("ext", [".h5", ".msgpack"])
def test_restore_retries_when_the_latest_is_deleted_between_resolving_and_opening(tmp_path, monkeypatch, ext):
    """Another process's max_to_keep can delete the latest checkpoint after the directory was resolved
    to it but before it is opened: the restore looks up the latest again. Once open_reader has opened
    the file, the format reads through that same open file (Format.open's blob), so a deletion then no longer
    matters: the checkpoint is read whole."""
    directory = str(tmp_path)
    variables = {k: ckpt.Variable(v) for k, v in step_tensors(1, 1).items()}
    saver = ckpt.Saver(variables)
    for step in (1, 2):
        for key, value in step_tensors(step, 1).items():
            variables[key].assign(value)
        saver.save(os.path.join(directory, "w1" + ext), global_step=step)
    real_resolve = _locations.resolve_checkpoint
    deleted = []

    def racing_resolve(path, *args, **kwargs):
        resolved = real_resolve(path, *args, **kwargs)
        if not deleted:  # the other process deletes it right now
            deleted.append(resolved)
            os.unlink(resolved)
        return resolved

    monkeypatch.setattr(_locations, "resolve_checkpoint", racing_resolve)
    restored = fresh_variables()
    result = ckpt.Saver(restored).restore(directory)
    assert deleted == [os.path.join(directory, f"w1-2{ext}")]
    assert result.path == os.path.join(directory, f"w1-1{ext}")
    assert step_of({k: np.asarray(v.value()) for k, v in restored.items()}, 1) == 1
    monkeypatch.undo()

    for key, value in step_tensors(3, 1).items():
        variables[key].assign(value)
    saver.save(os.path.join(directory, "w1" + ext), global_step=3)
    fmt = ckpt.formats.base.get_format("hdf5" if ext == ".h5" else "msgpack")
    real_open = type(fmt).open

    def racing_open(self, path, blob=None, declined=None):
        os.unlink(path)  # deleted after open_reader opened and sniffed it
        return real_open(self, path, blob, declined)

    monkeypatch.setattr(type(fmt), "open", racing_open)
    restored = fresh_variables()
    result = ckpt.Saver(restored).restore(directory)
    assert result.path == os.path.join(directory, f"w1-3{ext}") and not os.path.exists(result.path)
    assert step_of({k: np.asarray(v.value()) for k, v in restored.items()}, 1) == 3


def test_retention_never_deletes_a_file_another_saver_just_saved(tmp_path, monkeypatch):
    """Saver A drops "m-1" (max_to_keep) and, before A deletes it, Saver B saves a new "m-1".
    B's save returned, so its file must stay and the state file must list only existing files."""
    directory = str(tmp_path)
    a = ckpt.Saver({"v": ckpt.Variable(np.float64(1.0))}, max_to_keep=1)
    b_var = ckpt.Variable(np.float64(2.0))
    b = ckpt.Saver({"v": b_var}, max_to_keep=None)
    a.save(os.path.join(directory, "m"), global_step=1)
    real_unlink, b_done, b_errors = os.unlink, threading.Event(), []

    def b_save() -> None:
        try:
            b.save(os.path.join(directory, "m"), global_step=1)
            b_done.set()
        except BaseException as exc:  # reported by the main thread
            b_errors.append(exc)

    def unlink(path, *args, **kwargs):
        if os.path.basename(str(path)) == "m-1.h5" and threading.current_thread() is threading.main_thread() \
                and not hasattr(unlink, "thread"):
            unlink.thread = threading.Thread(target=b_save)  # B saves m-1 while A is about to delete it
            unlink.thread.start()
            b_done.wait(2.0)  # B finishes here unless A's retention holds the directory's lock
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    a.save(os.path.join(directory, "m"), global_step=2)
    unlink.thread.join(30)
    assert not b_errors and b_done.is_set()
    monkeypatch.undo()
    state = read_state(directory)
    listed = [e.path for e in state.checkpoints]
    assert "m-1.h5" in listed
    missing = [name for name in listed if not os.path.exists(os.path.join(directory, name))]
    assert not missing, f"the state file lists deleted checkpoints: {missing}"
    ckpt.Saver({"v": b_var}).restore(os.path.join(directory, "m-1.h5"))
    assert float(b_var.value()) == 2.0
