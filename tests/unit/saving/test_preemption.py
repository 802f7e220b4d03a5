"""ckpt.PreemptionGuard: signals only recorded, handlers restored, saves in flight committed
before the guard lets go, and the flag agreed across ranks with comm=."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from distributed_support import run_ranks

import ckpt
from ckpt.distributed import CollectiveTimeoutError


def test_a_signal_is_only_recorded_and_the_previous_handler_comes_back():
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        guard = ckpt.PreemptionGuard()
        with guard:
            assert not guard.requested and guard.signal is None
            signal.raise_signal(signal.SIGUSR1)
            assert guard.requested and guard.signal == signal.SIGUSR1
            signal.raise_signal(signal.SIGTERM)  # the default action would end pytest here
            assert guard.signal == signal.SIGUSR1  # the first one is kept
        assert seen == []  # the guard's handler ran, not the previous one
        signal.raise_signal(signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]  # restored on exit
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_handlers_are_restored_when_the_block_raises_and_only_the_chosen_signals_are_caught():
    with pytest.raises(KeyError):
        with ckpt.PreemptionGuard(signals=(signal.SIGUSR2,)):
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
            raise KeyError("boom")
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL


def test_the_guard_is_entered_in_the_main_thread_once_and_refuses_bad_arguments():
    guard = ckpt.PreemptionGuard()
    with guard, pytest.raises(RuntimeError, match="already active"):
        guard.__enter__()
    errors: list[BaseException] = []

    def enter() -> None:
        try:
            with ckpt.PreemptionGuard():
                pass
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=enter)
    worker.start()
    worker.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])
    with pytest.raises(ValueError, match="timeout must be a positive"):
        ckpt.PreemptionGuard(timeout=0)
    with pytest.raises(ValueError):
        ckpt.PreemptionGuard(signals=(999,))


def test_leaving_the_guard_waits_for_an_asynchronous_save_in_flight(tmp_path):
    w = ckpt.Variable(np.arange(2 ** 22, dtype=np.float32), name="w")  # 16 MiB: not written in an instant
    with ckpt.PreemptionGuard() as guard:
        guard.request()
        future = ckpt.Saver([w]).save(str(tmp_path / "model.h5"), global_step=1, blocking=False)
    assert future.done()  # committed before the handlers were restored
    assert ckpt.latest_checkpoint(str(tmp_path)) == future.result()


CHILD = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import ckpt

    w = ckpt.Variable(np.zeros(2 ** 22, np.float32), name="w")  # 16 MiB
    saver = ckpt.Saver([w])
    future, step = None, 0
    try:
        with ckpt.PreemptionGuard() as guard:
            while True:  # training steps until the scheduler's signal
                step += 1
                w.assign_add(np.ones(2 ** 22, np.float32))
                if step == 1:
                    print("ready", flush=True)  # after a step: the signal lands at step 1 or later
                if guard.requested:
                    break
                if step == 100000:
                    sys.exit(5)
            future = saver.save(os.path.join(sys.argv[1], "model.h5"), global_step=step, blocking=False)
            os.kill(os.getpid(), signal.SIGTERM)  # schedulers signal again: still only recorded
            w.assign(np.full(2 ** 22, -1, np.float32))  # the checkpoint keeps the snapshot
            sys.exit(3)  # leave the block (and the process) with the save still in flight
    finally:
        print("exit", step, future is not None and future.done(), flush=True)
""")


def test_a_signalled_child_saves_asynchronously_and_the_save_is_committed_before_exit(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    directory = tmp_path / "run"
    directory.mkdir()
    proc = subprocess.Popen([sys.executable, str(script), str(directory)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 3, err
    word, step, done = out.split()
    assert word == "exit" and int(step) > 0 and done == "True", out
    latest = ckpt.latest_checkpoint(str(directory))
    assert latest is not None and latest.endswith(f"model-{step}.h5")
    np.testing.assert_array_equal(ckpt.load_variable(latest, "w"), np.full(2 ** 22, int(step), np.float32))


def test_with_comm_every_rank_sees_the_request_at_the_same_check():
    def rank(comm):
        guard = ckpt.PreemptionGuard(signals=(), comm=comm, timeout=30)
        for step in range(10):
            if comm.rank == 1 and step == 4:
                guard.request(signal.SIGTERM)
            if guard.requested:
                # agreed: later reads need no collective (a rank reading again alone cannot hang)
                assert all(guard.requested for _ in range(comm.rank + 1))
                return step, guard.signal
        return None

    assert run_ranks(3, rank) == [(4, None), (4, signal.SIGTERM), (4, None)]


def test_with_comm_a_rank_that_never_checks_makes_the_others_time_out():
    def rank(comm):
        guard = ckpt.PreemptionGuard(signals=(), comm=comm, timeout=0.5)
        return None if comm.rank == 2 else guard.requested

    results = run_ranks(3, rank)
    assert results[2] is None
    assert all(isinstance(r, CollectiveTimeoutError) and "did not arrive" in str(r) for r in results[:2]), results
