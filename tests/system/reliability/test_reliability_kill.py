"""Crash safety: a process saving in a loop is killed with SIGKILL at random moments.

After every kill: the directory's latest checkpoint restores and verifies, all its tensors
agree on one step and that step is the state file's (pending entries counted once in place),
and no complete checkpoint is newer; no checkpoint ever goes back in time;
temporary leftovers never count as checkpoints and the next save removes them.
"""

from __future__ import annotations

import collections
import json
import os
import random
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from reliability_support import step_of, step_tensors

import ckpt
from ckpt.storage.atomic import is_temporary
from ckpt.saving.stores import open_store
from ckpt.storage.state import LOCK_FILE, STATE_FILE, read_state
from conftest import OUTSIDE_CHECKOUT, TESTS

HERE = TESTS
KILLS_PER_FORMAT = 100  # x --reliability-scale; 200 kills of blocking saves in all by default
ASYNC_KILLS_PER_FORMAT = 50  # and 100 of asynchronous ones
MAX_TO_KEEP = 2
MIN_MAX_DELAY = 0.012  # seconds; the delays span several saves, so kills land in every phase


class Zygote:
    """tests/reliability_child.py zygote: forks saving children without re-importing ckpt."""

    def __init__(self, stderr_path: str) -> None:
        self._stderr = open(stderr_path, "wb")
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "reliability_child.py"), "zygote"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     env=env, cwd=HERE)
        self._buffer = b""

    def readline(self, timeout: float = 60.0) -> str:
        """One line from the zygote; fail instead of blocking forever."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise AssertionError(f"the zygote did not answer within {timeout} s")
            chunk = os.read(fd, 4096)
            if not chunk:
                raise AssertionError(f"the zygote exited (code {self.proc.wait()})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def spawn(self, **command: object) -> int:
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        self.proc.stdin.flush()
        kind, pid = self.readline().split()
        assert kind == "pid"
        return int(pid)

    def reap(self, pid: int) -> int:
        """Wait for the child's end; return its exit code (-9 for SIGKILL)."""
        kind, got, code = self.readline().split()
        assert kind == "exit" and int(got) == pid
        return int(code)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()
        self._stderr.close()


def check_directory(directory: str, ext: str, stats: collections.Counter) -> tuple[int, set[str]]:
    """Check every guarantee after a kill; return (latest step, temporary names left)."""
    names = set(os.listdir(directory))
    temporaries = {n for n in names if is_temporary(n)}
    state = open_store(directory).effective_state()  # what readers go by: pending entries settled
    assert state is not None, "the state file vanished"
    listed = {e.path: e for e in state.checkpoints}

    latest = ckpt.latest_checkpoint(directory)
    assert latest is not None
    name = os.path.basename(latest)
    assert not is_temporary(name) and name in listed, f"latest {name!r} is not a recorded checkpoint"
    step = listed[name].step
    assert name == f"model-{step}{ext}"

    # the restore a training job does on start-up: complete, consistent, the recorded step
    variables = {key: ckpt.Variable(np.zeros_like(v) if v.dtype.kind != "O" else np.full(v.shape, b"", object))
                 for key, v in step_tensors(0).items()}
    result = ckpt.Saver(variables).restore(directory)
    assert result.path == latest
    assert step_of({k: np.asarray(v.value()) for k, v in variables.items()}) == step

    # every recorded checkpoint exists, verifies and holds its own step
    for entry in state.checkpoints:
        with ckpt.load_checkpoint(os.path.join(directory, entry.path)) as reader:
            assert reader.verify() == [], entry.path
            assert step_of({k: reader.get_tensor(k) for k in reader.tensors}) == entry.step
    # no bound on len(state.checkpoints) here: saves killed after their rename are counted before
    # retention ran for them; the next completed save applies it to all (checked below)

    # anything else is a leftover: a temporary, or a complete checkpoint the state does not list
    for other in sorted(names - set(listed) - temporaries - {STATE_FILE, LOCK_FILE}):
        other_step = int(other[len("model-"):-len(ext)])
        with ckpt.load_checkpoint(os.path.join(directory, other)) as reader:
            assert reader.verify() == [], other  # never a half-written file under a real name
            assert step_of({k: reader.get_tensor(k) for k in reader.tensors}) == other_step
        # the state file names a newer one pending (counted once renamed), so only an older one is left over
        assert other_step < step, f"{other} is newer than the latest {name}"
        stats["recorded, old one not yet deleted"] += 1
    for tmp in temporaries:
        stats["state file being written" if tmp.startswith(f".{STATE_FILE}.") else "checkpoint being written"] += 1
    if not temporaries and names - set(listed) - {STATE_FILE, LOCK_FILE} == set():
        stats["between saves (nothing left over)"] += 1
    return step, temporaries


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
@pytest.mark.parametrize("ext", [".h5", ".msgpack"])
def test_sigkill_during_save_loop(tmp_path, ext, blocking, reliability_scale):
    """Async saves (``blocking=False``): the child assigns the next step while a save is in flight."""
    kills = (KILLS_PER_FORMAT if blocking else ASYNC_KILLS_PER_FORMAT) * reliability_scale
    rng = random.Random(f"kill{ext}{'' if blocking else 'async'}")
    directory = str(tmp_path / "run")
    os.mkdir(directory)
    parent_vars = {key: ckpt.Variable(value) for key, value in step_tensors(0).items()}
    parent_saver = ckpt.Saver(parent_vars, max_to_keep=MAX_TO_KEEP)
    parent_saver.save(os.path.join(directory, "model" + ext), global_step=0)
    # size the delays to this machine's save time (sizing only: nothing asserts on time)
    durations = []
    for _ in range(5):
        start = time.perf_counter()
        parent_saver.save(os.path.join(directory, "model" + ext), global_step=0)
        durations.append(time.perf_counter() - start)
    max_delay = max(MIN_MAX_DELAY, 4 * sorted(durations)[2])

    stats: collections.Counter = collections.Counter()
    zygote = Zygote(str(tmp_path / "zygote.stderr"))
    step, old_temporaries, saves_by_children = 0, set(), 0
    try:
        for kill in range(kills):
            pid = zygote.spawn(dir=directory, ext=ext, start=step + 1, max_to_keep=MAX_TO_KEEP, blocking=blocking)
            time.sleep(rng.uniform(0, max_delay))
            os.kill(pid, signal.SIGKILL)
            code = zygote.reap(pid)
            assert code == -signal.SIGKILL, \
                f"the saving child ended on its own (code {code}): {(tmp_path / 'zygote.stderr').read_text()}"

            new_step, temporaries = check_directory(directory, ext, stats)
            assert new_step >= step, f"kill {kill}: the latest checkpoint went back from {step} to {new_step}"
            if new_step > step:
                # the child completed a save, and every save first removes dead saves' leftovers
                assert not old_temporaries & temporaries, f"kill {kill}: leftovers survived a save"
            saves_by_children += new_step - step
            step = new_step

            if kill % 2:  # every other time the parent is "the next save" and checks it cleans up
                for key, value in step_tensors(step + 1).items():
                    parent_vars[key].assign(value)
                path = parent_saver.save(os.path.join(directory, "model" + ext), global_step=step + 1,
                                         blocking=blocking)
                if not blocking:
                    for key, value in step_tensors(step + 2).items():  # the snapshot must not see these
                        parent_vars[key].assign(value)
                    path = path.result()
                assert ckpt.latest_checkpoint(directory) == path
                # nothing else survives a completed save: no temporaries, and no checkpoint dropped
                # by max_to_keep whose deletion a kill interrupted (the state's "deleting" list)
                listed = {e.path for e in read_state(directory).checkpoints}
                assert set(os.listdir(directory)) == listed | {STATE_FILE, LOCK_FILE}
                step, temporaries = step + 1, set()
            old_temporaries = temporaries
    finally:
        zygote.close()
    print(f"\n{ext} {'blocking' if blocking else 'async'}: {kills} kills, {saves_by_children} checkpoints completed by killed children; "
          f"states found after a kill: {dict(stats)}")
    assert saves_by_children > 0  # the delays are long enough for children to complete saves


KILLED_CONVERT = """
import os, signal, sys
from ckpt.formats import base
from ckpt.cli import main
fmt = base.get_format("hdf5")
write = fmt.write_blob
def killed(blob, tensors, metadata):  # the whole file written, then SIGKILL before the rename
    write(blob, tensors, metadata)
    os.kill(os.getpid(), signal.SIGKILL)
fmt.write_blob = killed
main(["convert", sys.argv[1], sys.argv[2]])
"""


def test_a_killed_convert_leaves_nothing_once_the_next_convert_ran(tmp_path):
    """Killed converts leave their temporary files; the next convert into that directory
    removes every one whose writer is dead, and none a live writer still holds."""
    from ckpt.storage.atomic import replace_atomically

    src = str(tmp_path / "src.msgpack")
    values = {"w": np.arange(1000.0), "b": np.ones(3, np.float32)}
    ckpt.Saver({k: ckpt.Variable(v) for k, v in values.items()}).save(src)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("dst.h5", "dst.h5", "other.h5"):
        proc = subprocess.run([sys.executable, "-c", KILLED_CONVERT, src, str(out / name)], capture_output=True,
                              cwd=OUTSIDE_CHECKOUT)
        assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
        left = [n for n in os.listdir(out) if is_temporary(n)]  # each convert removed what the last left
        assert len(left) == 1 and left[0].startswith(f".{name}."), left
    with replace_atomically(str(out / "live.h5")) as live:  # a writer still at work
        proc = subprocess.run([sys.executable, "-c", "import sys; from ckpt.cli import main; main(sys.argv[1:])",
                               "convert", src, str(out / "dst.h5")], capture_output=True, cwd=OUTSIDE_CHECKOUT)
        assert proc.returncode == 0, proc.stderr.decode()[-2000:]
        assert sorted(os.listdir(out)) == sorted(["dst.h5", os.path.basename(live)])
        open(live, "wb").close()
    with ckpt.load_checkpoint(str(out / "dst.h5")) as reader:
        for key, value in values.items():
            assert reader.get_tensor(key).tolist() == value.tolist()
