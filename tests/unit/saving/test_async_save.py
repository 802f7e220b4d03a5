"""Asynchronous saves: Saver.save(..., blocking=False) -> ckpt.SaveFuture.

Snapshot semantics (every dtype, every writable format, every staging bound), one save in
flight, errors never lost, the state file seeing a checkpoint only once committed, staging
memory reused, interpreter exit waiting for the save in flight. Timing never decides an
outcome: a test format whose writer waits on events makes "in flight" deterministic.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import tracemalloc

import numpy as np
import pytest
from ckpt.formats import base
from ckpt.formats.builtin import MsgpackFormat
from conftest import assert_bit_exact, every_dtype_tensors
from reliability_support import sentinel_like

import ckpt
from ckpt.storage.atomic import is_temporary
from ckpt.storage.state import read_state

WRITABLE = [f.name for f in base.formats() if f.can_write]
EXT = {name: base.get_format(name).extensions[0] for name in WRITABLE}


def storable(fmt: str) -> list[tuple[str, np.ndarray]]:
    """every_dtype_tensors() minus what the format refuses (safetensors: no strings, no complex)."""
    tensors = every_dtype_tensors()
    if fmt == "safetensors":
        from ckpt.formats.safetensors import _CODE_OF
        tensors = [(k, v) for k, v in tensors if v.dtype in _CODE_OF]
    return tensors


def model_of(tensors):
    return {key: ckpt.Variable(value.copy())
            for key, value in tensors}


def load_all(path):
    with ckpt.load_checkpoint(path) as reader:
        assert reader.verify() == []
        return {key: reader.get_tensor(key) for key in reader.tensors}


class GatedFormat(MsgpackFormat):
    """ckpt's msgpack format under another name whose writer waits for the test's go-ahead."""

    name = "gated"
    extensions = (".gated",)

    def __init__(self) -> None:
        self.started = threading.Event()   # set when a write begins
        self.go = threading.Event()        # the write proceeds once set
        self.fail: BaseException | None = None  # raised instead of writing, when set
        self.log: list[str] = []

    def sniff(self, head: bytes) -> bool:
        return False  # never claims files: the msgpack format reads them

    def write_blob(self, blob, tensors, metadata):
        self.log.append(f"start {metadata.get('n')}")
        self.started.set()
        assert self.go.wait(60), "the test never let the write proceed"
        if self.fail is not None:
            raise self.fail
        super().write_blob(blob, tensors, metadata)
        self.log.append(f"end {metadata.get('n')}")


@pytest.fixture
def gated():
    fmt = GatedFormat()
    base.register_format(fmt)
    try:
        yield fmt
    finally:
        fmt.go.set()
        base.unregister_format(fmt.name)


def small_saver(**kwargs):
    return ckpt.Saver({"w": ckpt.Variable(np.arange(6.0).reshape(2, 3)), "b": ckpt.Variable(np.int64(7))},
                      **kwargs)


# --- snapshot semantics -----------------------------------------------------------------------
@pytest.mark.parametrize("fmt", WRITABLE)
@pytest.mark.parametrize("staging", [None, 0, 200], ids=["model", "zero", "partial"])
def test_checkpoint_holds_the_values_of_the_call(tmp_path, fmt, staging):
    tensors = storable(fmt)
    variables = model_of(tensors)
    saver = ckpt.Saver(variables, staging_bytes=staging)
    future = saver.save(str(tmp_path / ("model" + EXT[fmt])), global_step=1, blocking=False)
    for key, value in tensors:  # training changes every variable at once
        variables[key].assign(sentinel_like(value))
    assert isinstance(future, ckpt.SaveFuture) and isinstance(future, concurrent.futures.Future)
    path = future.result()
    assert path == str(tmp_path / ("model-1" + EXT[fmt]))
    saved = load_all(path)
    for key, value in tensors:
        assert_bit_exact(value, saved[key])
    if staging is not None:
        assert saver._background.arena.nbytes <= max(staging, 64 << 10)  # the arena's minimum block


@pytest.mark.parametrize("staging", [None, 0], ids=["model", "zero"])
@pytest.mark.parametrize("shapes", [[(0,), (0, 3)], [(4,), (0, 3)]], ids=["all-empty", "empty-last"])
@pytest.mark.parametrize("ext", [".h5", ".msgpack"])
def test_empty_tensors_need_no_staging_memory(tmp_path, ext, shapes, staging):
    """Nothing to copy (every staged tensor empty) is a save like any other."""
    values = {f"v{i}": np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
              for i, shape in enumerate(shapes)}
    variables = {key: ckpt.Variable(value) for key, value in values.items()}
    saver = ckpt.Saver(variables, staging_bytes=staging)
    future = saver.save(str(tmp_path / ("m" + ext)), global_step=1, blocking=False)
    for variable in variables.values():
        variable.assign(np.full(variable.shape, -1, np.float32))
    saved = load_all(future.result())
    for key, value in values.items():
        assert_bit_exact(value, saved[key])


@pytest.mark.parametrize("ext", [".h5", ".msgpack"])
def test_large_tensors_snapshot_with_a_bound_between(tmp_path, ext):
    """Half the model staged: the first tensors are written before save returns, the rest later."""
    rng = np.random.default_rng(5)
    values = {f"layer{i}/kernel": rng.standard_normal((64, 1024)).astype(np.float32) for i in range(6)}
    variables = {k: ckpt.Variable(v) for k, v in values.items()}
    model_bytes = sum(v.nbytes for v in values.values())
    saver = ckpt.Saver(variables, staging_bytes=model_bytes // 2)
    for step in range(3):
        future = saver.save(str(tmp_path / ("m" + ext)), global_step=step, blocking=False)
        changed = {key: value + 1 for key, value in values.items()}
        for key, value in changed.items():
            variables[key].assign(value)
        saved = load_all(future.result())
        for key, value in values.items():
            np.testing.assert_array_equal(saved[key], value)
        values = changed
    assert saver._background.arena.nbytes <= model_bytes // 2


@pytest.mark.parametrize("ext", [".h5", ".msgpack"])
def test_the_background_write_keeps_to_its_own_thread(tmp_path, monkeypatch, ext):
    """A blocking save checksums big tensors on the I/O worker threads; a background save does it
    in the saving thread (one core: the others are left to training), with the same bytes."""
    from ckpt.formats import _blocks

    where: list[str] = []
    real = _blocks._both

    def both(view, block_bytes):
        where.append(threading.current_thread().name)
        return real(view, block_bytes)

    monkeypatch.setattr(_blocks, "_both", both)
    values = {f"w{i}": np.random.default_rng(i).standard_normal(3 << 20).astype(np.float32) for i in range(2)}
    saver = ckpt.Saver({k: ckpt.Variable(v) for k, v in values.items()}, max_to_keep=None)
    blocking = saver.save(str(tmp_path / ("a" + ext)))
    assert len(where) == 2 and all(name.startswith("ckpt-io") for name in where), where
    where.clear()
    background = saver.save(str(tmp_path / ("b" + ext)), blocking=False).result()
    assert len(where) == 2 and all(name.startswith("ckpt-save") for name in where), where
    for path in (blocking, background):
        with ckpt.load_checkpoint(path) as reader:
            for key, value in values.items():
                assert_bit_exact(value, reader.get_tensor(key))


def test_global_step_variable_is_read_at_the_call(tmp_path):
    step = ckpt.Variable(np.int64(5), name="gs")
    saver = ckpt.Saver({"step": step})
    future = saver.save(str(tmp_path / "m.h5"), global_step=step, blocking=False)
    step.assign(6)
    assert os.path.basename(future.result()) == "m-5.h5"
    assert int(ckpt.load_variable(future.result(), "step")) == 5


# --- the future ------------------------------------------------------------------------------
def test_future_interface_and_commit_visibility(tmp_path, gated):
    saver = small_saver(max_to_keep=1)
    first = saver.save(str(tmp_path / "m.msgpack"), global_step=1)
    future = saver.save(str(tmp_path / "m.gated"), global_step=2, metadata={"n": 2}, blocking=False)
    gated.started.wait(60)
    assert not future.done() and future.running()
    assert not future.cancel()  # a save in flight cannot be cancelled
    with pytest.raises(concurrent.futures.TimeoutError):
        future.result(timeout=0.01)
    # not committed yet: the state file, retention and latest_checkpoint still see the previous one
    assert ckpt.latest_checkpoint(str(tmp_path)) == first
    assert [e.path for e in read_state(str(tmp_path)).checkpoints] == ["m-1.msgpack"]
    assert os.path.exists(first)
    called = []
    future.add_done_callback(lambda f: called.append(f.result()))
    gated.go.set()
    path = future.result(timeout=60)
    assert path == str(tmp_path / "m-2.gated") and future.done() and future.exception() is None
    assert called == [path]
    assert ckpt.latest_checkpoint(str(tmp_path)) == path
    assert not os.path.exists(first)  # max_to_keep=1 applied at commit
    assert saver.last_checkpoints == [path]
    future.add_done_callback(lambda f: called.append("late"))  # on a finished future: runs at once
    assert called == [path, "late"]


def test_one_save_in_flight(tmp_path, gated):
    saver = small_saver()
    future = saver.save(str(tmp_path / "m.gated"), global_step=1, metadata={"n": 1}, blocking=False)
    gated.started.wait(60)
    second: list[object] = []
    thread = threading.Thread(target=lambda: second.append(
        saver.save(str(tmp_path / "m.gated"), global_step=2, metadata={"n": 2})))
    thread.start()
    thread.join(0.2)
    assert thread.is_alive() and gated.log == ["start 1"]  # the second save waits for the first
    gated.go.set()
    thread.join(60)
    assert gated.log == ["start 1", "end 1", "start 2", "end 2"]
    assert future.result() == str(tmp_path / "m-1.gated") and second == [str(tmp_path / "m-2.gated")]
    assert [e.step for e in read_state(str(tmp_path)).checkpoints] == [1, 2]


def test_wait_waits_for_the_save_in_flight(tmp_path, gated):
    saver = small_saver()
    future = saver.save(str(tmp_path / "m.gated"), blocking=False)
    gated.started.wait(60)
    threading.Timer(0.05, gated.go.set).start()
    saver.wait()
    assert future.done() and ckpt.latest_checkpoint(str(tmp_path)) == future.result()
    saver.wait()  # nothing in flight: returns at once


# --- errors are never lost -------------------------------------------------------------------
def failing_save(tmp_path, gated, saver):
    gated.fail = OSError(errno.ENOSPC, "No space left on device")
    future = saver.save(str(tmp_path / "m.gated"), global_step=2, blocking=False)
    gated.go.set()
    concurrent.futures.wait([future])
    return future


def assert_nothing_half_written(tmp_path, latest):
    assert ckpt.latest_checkpoint(str(tmp_path)) == latest
    assert not [n for n in os.listdir(tmp_path) if is_temporary(n) or n.endswith(".gated")]


def test_error_raised_by_result(tmp_path, gated):
    saver = small_saver()
    latest = saver.save(str(tmp_path / "m.msgpack"), global_step=1)
    future = failing_save(tmp_path, gated, saver)
    with pytest.raises(ckpt.CheckpointWriteError, match="No space left") as info:
        future.result()
    assert str(tmp_path / "m-2.gated") in str(info.value) and ".ckpt-tmp-" not in str(info.value)
    assert isinstance(future.exception(), ckpt.CheckpointWriteError)
    assert_nothing_half_written(tmp_path, latest)
    gated.fail = None
    saver.wait()  # seen through the future: not raised again
    assert saver.save(str(tmp_path / "m.msgpack"), global_step=3)


def test_error_raised_by_the_next_save(tmp_path, gated):
    saver = small_saver()
    latest = saver.save(str(tmp_path / "m.msgpack"), global_step=1)
    failing_save(tmp_path, gated, saver)
    with pytest.raises(ckpt.CheckpointWriteError, match="No space left"):
        saver.save(str(tmp_path / "m.msgpack"), global_step=3, blocking=False)
    assert_nothing_half_written(tmp_path, latest)  # the save that raised did not start
    saver.wait()  # raised once: not again
    assert saver.save(str(tmp_path / "m.msgpack"), global_step=3) == str(tmp_path / "m-3.msgpack")


def test_error_raised_by_wait(tmp_path, gated):
    saver = small_saver()
    latest = saver.save(str(tmp_path / "m.msgpack"), global_step=1)
    failing_save(tmp_path, gated, saver)
    with pytest.raises(ckpt.CheckpointWriteError, match="No space left"):
        saver.wait()
    saver.wait()
    assert_nothing_half_written(tmp_path, latest)


def test_directory_removed_during_the_write(tmp_path, gated):
    directory = tmp_path / "run"
    directory.mkdir()
    saver = small_saver()
    future = saver.save(str(directory / "m.gated"), blocking=False)
    gated.started.wait(60)
    shutil.rmtree(directory)
    gated.go.set()
    with pytest.raises(ckpt.CheckpointError, match="m.gated"):
        future.result()
    assert not directory.exists()


def test_errors_found_at_the_call_raise_at_once(tmp_path):
    saver = small_saver()
    (tmp_path / "file").write_text("")
    with pytest.raises(ckpt.CheckpointWriteError, match="cannot create the directory"):
        saver.save(str(tmp_path / "file" / "m.h5"), blocking=False)  # a file where a directory must go
    with pytest.raises(ValueError, match="metadata"):
        saver.save(str(tmp_path / "m.h5"), metadata={"x": object()}, blocking=False)
    with ckpt.deferred_init():
        unset = ckpt.Variable(ckpt.initializers.Zeros(), shape=(2,), name="unset_async")
    with pytest.raises(ckpt.UninitializedVariableError):
        ckpt.Saver([unset]).save(str(tmp_path / "u.h5"), blocking=False)
    saver.wait()
    assert os.listdir(tmp_path) == ["file"]


def test_staging_bytes_is_checked():
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="staging_bytes"):
            small_saver(staging_bytes=bad)


class TwiceFormat(MsgpackFormat):
    """A writer breaking the contract: it reads every source twice."""

    name, extensions = "twice", (".twice",)

    def sniff(self, head):
        return False

    def write_blob(self, blob, tensors, metadata):
        for _, source in tensors:
            base.materialize(source)
        super().write_blob(blob, tensors, metadata)


def test_a_writer_reading_a_live_tensor_again_fails_instead_of_tearing(tmp_path):
    base.register_format(TwiceFormat())
    try:
        saver = small_saver(staging_bytes=0)
        future = saver.save(str(tmp_path / "m.twice"), blocking=False)
        with pytest.raises(ckpt.CheckpointWriteError, match="read twice"):
            future.result()
        # with the whole model staged, reading twice is harmless
        assert small_saver().save(str(tmp_path / "m.twice"), blocking=False).result()
    finally:
        base.unregister_format("twice")


# --- memory ------------------------------------------------------------------------------------
def test_staging_memory_is_reused(tmp_path):
    rng = np.random.default_rng(3)
    variables = {f"t{i}": ckpt.Variable(rng.standard_normal(50_000 + i).astype(np.float64)) for i in range(8)}
    variables["small"] = ckpt.Variable(np.float32(1.0))
    model_bytes = sum(v.numpy().nbytes for v in variables.values())
    saver = ckpt.Saver(variables, max_to_keep=2)
    saver.save(str(tmp_path / "m.msgpack"), global_step=0, blocking=False).result()
    block = saver._background.arena.nbytes
    address = saver._background.arena._block.ctypes.data
    assert model_bytes <= block <= model_bytes + 9 * 4096  # one model's worth, page-rounded
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for step in range(1, 21):
            saver.save(str(tmp_path / "m.msgpack"), global_step=step, blocking=False)
            variables["t0"].assign_add(1.0)
        saver.wait()
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert saver._background.arena._block.ctypes.data == address and saver._background.arena.nbytes == block
    assert current - before < model_bytes // 20  # no growth over 20 saves
    assert peak - before < model_bytes // 2  # no per-save copy of the model either


# --- interpreter exit --------------------------------------------------------------------------
EXIT_SCRIPT = """
import os, sys, threading
import numpy as np
import ckpt
from ckpt.formats import base
from ckpt.formats.builtin import MsgpackFormat

exiting = threading.Event()

class AfterMain(MsgpackFormat):
    # writes only once the main program has finished: the save is in flight at exit
    name, extensions = "aftermain", (".aftermain",)
    def sniff(self, head):
        return False
    def write_blob(self, blob, tensors, metadata):
        exiting.wait()
        if os.environ.get("FAIL"):
            raise OSError(28, "No space left on device")
        super().write_blob(blob, tensors, metadata)

base.register_format(AfterMain())
v = ckpt.Variable(np.arange(1000.0), name="v")
saver = ckpt.Saver([v])
saver.save(os.path.join(sys.argv[1], "m.aftermain"), global_step=7, blocking=False)
threading._register_atexit(exiting.set)  # after ckpt's exit wait (the save loaded it): runs before it
v.assign(np.zeros(1000))
print("main done", flush=True)
if os.environ.get("HOW") == "raise":
    raise RuntimeError("training crashed")
if os.environ.get("HOW") == "exit":
    sys.exit(3)
"""


@pytest.mark.parametrize("fail,how,code", [(False, "end", 0), (True, "end", 0), (False, "raise", 1),
                                           (False, "exit", 3)])
def test_exit_waits_for_the_save_in_flight(tmp_path, fail, how, code):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(EXIT_SCRIPT))
    directory = tmp_path / "run"
    directory.mkdir()
    env = dict(os.environ, FAIL="1" if fail else "", HOW=how)
    proc = subprocess.run([sys.executable, str(script), str(directory)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == "main done\n"
    if fail:  # nobody waited: the error is printed, not lost; nothing half-written remains
        assert "background save of" in proc.stderr and "No space left on device" in proc.stderr
        assert "m-7.aftermain" in proc.stderr
        assert os.listdir(directory) == []
    else:
        assert ("RuntimeError: training crashed" in proc.stderr) == (how == "raise")
        assert "background save" not in proc.stderr
        path = ckpt.latest_checkpoint(str(directory))
        assert path == str(directory / "m-7.aftermain")
        np.testing.assert_array_equal(ckpt.load_variable(path, "v"), np.arange(1000.0))


ATEXIT_SCRIPT = """
import atexit, os, sys
import numpy as np
import ckpt

path, how = os.path.join(sys.argv[1], "m.h5"), sys.argv[2]
v = ckpt.Variable(np.arange(6.0), name="v")
saver = ckpt.Saver([v]) if how != "created-at-exit" else None

@atexit.register
def checkpoint_on_exit():
    if how == "save_file":
        ckpt.save_file({"v": v.numpy()}, path)
        return
    saved = (saver or ckpt.Saver([v])).save(path, global_step=9, blocking=how != "background")
    if not isinstance(saved, str):
        saved.result()
"""


@pytest.mark.parametrize("how", ["blocking", "background", "created-at-exit", "save_file"])
def test_an_hdf5_save_from_an_atexit_handler_exits_cleanly(tmp_path, how):
    """h5py first imported during shutdown loses its own exit hook, and libhdf5's then calls into a
    finalized interpreter (SIGSEGV): ckpt runs h5py's hook itself (ckpt/hdf5exit.py), whether the
    Saver was made before exit, at exit, or save_file wrote the file."""
    script = tmp_path / "train.py"
    script.write_text(ATEXIT_SCRIPT)
    directory = tmp_path / "run"
    directory.mkdir()
    proc = subprocess.run([sys.executable, str(script), str(directory), how], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    path = str(directory / "m.h5") if how == "save_file" else ckpt.latest_checkpoint(str(directory))
    assert path == str(directory / ("m.h5" if how == "save_file" else "m-9.h5"))
    np.testing.assert_array_equal(ckpt.load_variable(path, "v"), np.arange(6.0))


INTERRUPT_SCRIPT = """
import os, sys
import numpy as np
import ckpt
from ckpt.formats import base
from ckpt.formats.builtin import MsgpackFormat

class Stalled(MsgpackFormat):
    # writes the whole temporary file, then waits for the test's word before it is committed
    name, extensions = "stalled", (".stalled",)
    def sniff(self, head):
        return False
    def write_blob(self, blob, tensors, metadata):
        super().write_blob(blob, tensors, metadata)
        print("written", flush=True)
        word = sys.stdin.readline()
        if word == "interrupt this thread\\n":  # a Ctrl-C the kernel hands to this thread, not main
            import signal, threading
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
            word = sys.stdin.readline()
        if word != "go\\n":
            raise OSError("the test said stop")

base.register_format(Stalled())
v = ckpt.Variable(np.arange(1 << 17, dtype=np.float64), name="v")
saver = ckpt.Saver([v])
saver.save(os.path.join(sys.argv[1], "m.msgpack"), global_step=1)
saver.save(os.path.join(sys.argv[1], "m.stalled"), global_step=2, blocking=False)
raise KeyboardInterrupt  # the user's Ctrl-C, in the training loop
"""


class Output:
    """A child's merged stdout and stderr, read as it comes (a hang guard, never a timing check)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.text = proc, ""

    def wait_for(self, text: str) -> None:
        import select

        while text not in self.text:
            ready, _, _ = select.select([self.proc.stdout], [], [], 60)
            chunk = os.read(self.proc.stdout.fileno(), 65536) if ready else b""
            assert chunk, f"the child never printed {text!r}; it printed:\n{self.text}"
            self.text += chunk.decode()

    def rest(self) -> str:
        import select

        while True:  # until the child closes its output, or 60 s pass without a byte (a hang)
            ready, _, _ = select.select([self.proc.stdout], [], [], 60)
            assert ready, f"the child hangs; it printed:\n{self.text}"
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                break
            self.text += chunk.decode()
        self.proc.wait(60)
        return self.text


@pytest.mark.parametrize("second_interrupt", ["main thread", "save thread", None],
                         ids=["abandoned", "abandoned-via-save-thread", "finished"])
def test_ctrl_c_at_exit_names_the_save_and_a_second_abandons_it(tmp_path, second_interrupt):
    """The program ends by Ctrl-C while a background save is in flight: ckpt says what it is
    finishing; a second Ctrl-C ends the process at once and leaves no temporary file."""
    import signal

    script = tmp_path / "train.py"
    script.write_text(INTERRUPT_SCRIPT)
    directory = tmp_path / "run"
    directory.mkdir()
    proc = subprocess.Popen([sys.executable, str(script), str(directory)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = Output(proc)
    try:
        out.wait_for("written")
        out.wait_for("press Ctrl-C again to abandon it")
        if second_interrupt == "main thread":
            proc.send_signal(signal.SIGINT)
        elif second_interrupt == "save thread":  # the main thread must still wake to see it
            proc.stdin.write(b"interrupt this thread\n")
            proc.stdin.flush()
        else:
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
        text = out.rest()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdin.close()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGINT, text  # as Python ends on an unhandled Ctrl-C (shell: 130)
    assert "Exception ignored" not in text and "threading" not in text, text
    stalled = str(directory / "m-2.stalled")
    assert f"ckpt: finishing the background save of {stalled} before exiting" in text
    assert not [n for n in os.listdir(directory) if is_temporary(n)]
    if second_interrupt:
        assert f"ckpt: abandoned the background save of {stalled}" in text
        assert ckpt.latest_checkpoint(str(directory)) == str(directory / "m-1.msgpack")
    else:
        assert "abandoned" not in text
        assert ckpt.latest_checkpoint(str(directory)) == stalled


def test_a_first_ctrl_c_while_exit_waits_names_the_save_and_a_second_abandons(tmp_path, gated):
    """The program ended normally and exit waits for the save: the first Ctrl-C only says what is
    being finished, the second abandons it."""
    import io

    from ckpt.saving.async_save import finish_saves_at_exit

    saver = small_saver()
    future = saver.save(str(tmp_path / "m.gated"), global_step=3, blocking=False)
    gated.started.wait(60)
    calls, abandoned, err = [], [], io.StringIO()

    def wait():
        calls.append(err.getvalue())
        raise KeyboardInterrupt

    finish_saves_at_exit(interrupted=False, wait=wait, abandon=abandoned.append, stderr=err)
    gated.go.set()
    future.result()
    target = str(tmp_path / "m-3.gated")
    assert calls == ["", f"ckpt: finishing the background save of {target} before exiting; press Ctrl-C "
                         "again to abandon it\n"]
    assert abandoned == [[target]]


def test_a_ctrl_c_that_comes_as_the_warning_shows_abandons_the_save(tmp_path, gated):
    """The second Ctrl-C may arrive while the first one's words are being written (a user who
    reads fast, or a test that answers the words): it abandons the save, rather than being taken
    for the first and leaving the process waiting for a third."""
    import io

    from ckpt.saving.async_save import finish_saves_at_exit

    class Interrupted(io.StringIO):
        def write(self, text: str) -> int:
            super().write(text)
            raise KeyboardInterrupt  # the second Ctrl-C, as the words reach the terminal

    saver = small_saver()
    future = saver.save(str(tmp_path / "m.gated"), global_step=3, blocking=False)
    gated.started.wait(60)
    abandoned, waits = [], []
    finish_saves_at_exit(interrupted=True, wait=lambda: waits.append(1), abandon=abandoned.append,
                         stderr=Interrupted())
    gated.go.set()
    future.result()
    assert abandoned == [[str(tmp_path / "m-3.gated")]] and waits == []


def test_exit_without_saves_in_flight_says_nothing():
    import io

    from ckpt.saving.async_save import finish_saves_at_exit

    err = io.StringIO()
    finish_saves_at_exit(interrupted=True, stderr=err)
    assert err.getvalue() == ""


def test_abandoning_removes_this_process_temporaries_only(tmp_path):
    from ckpt.storage.atomic import remove_live_temporaries, replace_atomically

    (tmp_path / ".other.h5.ckpt-tmp-0123456789ab").write_bytes(b"another process's")
    with pytest.raises(ckpt.CheckpointWriteError, match="m.h5: writing failed"):  # the rename finds nothing
        with replace_atomically(str(tmp_path / "m.h5"), clean=False) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"x" * 1000)
            assert remove_live_temporaries() == [tmp]
    assert sorted(os.listdir(tmp_path)) == [".other.h5.ckpt-tmp-0123456789ab"]
    assert remove_live_temporaries() == []


# --- the staging bound ---------------------------------------------------------------------------
class RecordingFormat(MsgpackFormat):
    """Records, for each tensor the writer reads, whether save() had already returned."""

    name, extensions = "recording", (".recording",)

    def __init__(self) -> None:
        self.returned = threading.Event()
        self.reads: list[tuple[str, bool]] = []

    def sniff(self, head):
        return False

    def write_blob(self, blob, tensors, metadata):
        fmt = self

        class Recorder:
            def __init__(self, key, source):
                self.key, self.source = key, source
                self.dtype, self.shape = source.dtype, source.shape

            def __array__(self, dtype=None, copy=None):
                fmt.reads.append((self.key, fmt.returned.is_set()))
                return np.asarray(self.source)

        super().write_blob(blob, [(key, Recorder(key, source)) for key, source in tensors], metadata)


def test_save_returns_once_only_the_staged_tail_is_left(tmp_path):
    fmt = RecordingFormat()
    base.register_format(fmt)
    try:
        values = {f"t{i}": np.full(100_000, i, dtype=np.float32) for i in range(4)}  # 400 KB each
        variables = {k: ckpt.Variable(v) for k, v in values.items()}
        bound = 2 * 400 * 1024  # two tensors' slots (page-rounded)
        saver = ckpt.Saver(variables, staging_bytes=bound)
        future = saver.save(str(tmp_path / "m.recording"), blocking=False)
        fmt.returned.set()
        for key in values:
            variables[key].assign(-1)
        future.result()
        reads = dict(fmt.reads)
        assert [k for k, _ in fmt.reads] == ["t0", "t1", "t2", "t3"]
        assert reads["t0"] is False and reads["t1"] is False  # written from the variables before save returned
        assert 0 < saver._background.arena.nbytes <= bound  # the last two were copied
        saved = load_all(future.path)
        for key, value in values.items():
            np.testing.assert_array_equal(saved[key], value)
    finally:
        base.unregister_format("recording")


def test_an_interrupt_while_save_waits_is_raised_after_the_writer_is_done():
    from ckpt.saving.async_save import _wait_uninterrupted

    class Gate:
        calls = 0

        def wait(self):
            Gate.calls += 1
            if Gate.calls == 1:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _wait_uninterrupted(Gate())
    assert Gate.calls == 2  # it kept waiting before re-raising


# --- sharded saves (comm=) -----------------------------------------------------------------------
def sharded_async_save(comm, directory, staging=None, unset_rank=None):
    """One rank: save asynchronously, then change every variable and run training's own collectives
    on ``comm`` while the save's collectives run on its duplicate."""
    from distributed_support import global_tensors, make_variables

    variables = make_variables(global_tensors(), "rows", comm.rank, comm.size)
    if comm.rank == unset_rank:
        variables["step"]._mark_uninitialized()
    saver = ckpt.Saver(variables, comm=comm, timeout=30, staging_bytes=staging)
    future = saver.save(os.path.join(directory, "model.msgpack"), global_step=5, blocking=False)
    for var in variables.values():
        if var.is_initialized():
            var.assign(sentinel_like(np.asarray(var.numpy())))
    gathered = [comm.allgather(b"training %d" % i, 30) for i in range(3)]  # training's own collectives
    assert gathered[2] == [b"training 2"] * comm.size
    return future.result()


@pytest.mark.parametrize("staging", [None, 0], ids=["staged", "unstaged"])
def test_sharded_async_save_snapshot_on_a_duplicated_communicator(tmp_path, staging):
    from distributed_support import global_tensors, run_ranks

    results = run_ranks(3, lambda comm: sharded_async_save(comm, str(tmp_path), staging))
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert set(results) == {str(tmp_path / "model-5.msgpack")}
    assert ckpt.latest_checkpoint(str(tmp_path)) == str(tmp_path / "model-5.msgpack")
    with ckpt.load_checkpoint(str(tmp_path / "model-5.msgpack")) as reader:
        for key, value in global_tensors().items():
            assert_bit_exact(value, reader.get_tensor(key))
        assert int(reader.get_tensor("step")) == 42


def test_sharded_async_save_with_an_uninitialized_variable_fails_on_every_rank(tmp_path):
    from distributed_support import run_ranks

    results = run_ranks(3, lambda comm: sharded_async_save(comm, str(tmp_path), unset_rank=1))
    assert all(isinstance(r, ckpt.CheckpointError) and "uninitialized" in str(r) for r in results), results
    assert ckpt.latest_checkpoint(str(tmp_path)) is None
