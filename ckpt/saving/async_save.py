"""Asynchronous saves: ``Saver.save(..., blocking=False)`` snapshots, then writes in a thread.

Each Saver owns one :class:`BackgroundSaves`: at most one save in flight, a staging arena
reused across saves (see ``ckpt.saving.staging``), and the error of a failed background save kept
until someone has seen it. Background threads are not daemons, so a normal interpreter exit
waits for the save in flight to commit; a failure nobody looked at is printed to stderr at
exit rather than lost.

Example:
    >>> import ckpt, os, tempfile
    >>> v = ckpt.Variable([1.0, 2.0], name="v")
    >>> saver = ckpt.Saver([v])
    >>> future = saver.save(os.path.join(tempfile.mkdtemp(), "m.msgpack"), blocking=False)
    >>> _ = v.assign([0.0, 0.0])          # training goes on; the checkpoint keeps [1, 2]
    >>> path = future.result()
    >>> ckpt.load_variable(path, "v")
    array([1., 2.], dtype=float32)
"""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import numpy as np

from ckpt.storage.atomic import remove_live_temporaries
from ckpt.storage.workers import one_thread
from ckpt.saving.staging import StagingArena

__all__ = ["SaveFuture", "BackgroundSaves", "wait_for_saves_in_flight", "saves_in_flight",
           "finish_saves_at_exit"]

_unseen_lock = threading.Lock()
_unseen: dict[int, SaveFuture] = {}  # failed saves whose error nobody has seen yet
# every Saver's save threads still running: the checkpoint each writes and an event set as it ends
# (under _unseen_lock). Not Thread.join(): a join interrupted by Ctrl-C marks the thread stopped
# although it still runs, and Python's exit then stops waiting for it.
_in_flight: dict[threading.Thread, tuple[str, threading.Event]] = {}


def wait_for_saves_in_flight() -> None:
    """Wait until every background save of this process (every Saver's) has finished.

    Their errors are left to their Savers and futures (or to the report at exit)."""
    while True:
        with _unseen_lock:
            done = [d for t, (_, d) in _in_flight.items() if t is not threading.current_thread()]
        if not done:
            return
        for event in done:
            # in short waits: a Ctrl-C the kernel hands to another thread (a save blocked in a
            # read) only sets Python's flag, which the main thread checks when it wakes; an
            # untimed wait would never wake to see it
            while not event.wait(0.1):
                pass


def saves_in_flight() -> list[str]:
    """The checkpoints this process's background saves are writing now."""
    with _unseen_lock:
        return sorted({path for path, _ in _in_flight.values()})


def finish_saves_at_exit(*, interrupted: bool, wait: Callable[[], None] = wait_for_saves_in_flight,
                         abandon: Callable[[list[str]], None] | None = None,
                         stderr: TextIO | None = None) -> None:
    """At interpreter exit, wait for the background saves in flight, saying so on Ctrl-C.

    Python's own wait for non-daemon threads turns a Ctrl-C into "Exception ignored in
    <module 'threading'>" and leaves the save's temporary file behind. Here the first Ctrl-C
    (or the one that ended the program: ``interrupted``) names the checkpoints being finished
    and says that a second one abandons them; the second removes their temporary files and
    ends the process by SIGINT (``abandon``, which never returns). The previous checkpoint
    stays the latest, as after a kill.
    """
    out = sys.stderr if stderr is None else stderr
    warned = False

    def warn() -> None:
        nonlocal warned
        paths = saves_in_flight()
        first, warned = not warned, True  # before the words: a Ctrl-C once they show is the second
        if paths and first:
            print(f"ckpt: finishing the background save of {', '.join(paths)} before exiting; "
                  "press Ctrl-C again to abandon it", file=out, flush=True)

    while True:
        try:
            if interrupted:
                warn()
            wait()
            return
        except KeyboardInterrupt:
            if warned:
                (_abandon if abandon is None else abandon)(saves_in_flight())
                return
            interrupted = True


def _abandon(paths: list[str]) -> None:
    """End the process now, by SIGINT as Python does for an unhandled Ctrl-C, leaving no
    temporary file of the saves in flight (their writers never commit them)."""
    remove_live_temporaries()
    if paths:
        print(f"ckpt: abandoned the background save of {', '.join(paths)}; the previous checkpoint "
              "is still the latest", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass  # closed or replaced streams: nothing more can be said
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(130)  # only if SIGINT did not end the process (it is blocked)


def _at_thread_shutdown() -> None:
    last = getattr(sys, "last_value", None)  # what ended the program, if it raised
    finish_saves_at_exit(interrupted=isinstance(last, KeyboardInterrupt))


def _register_exit_wait() -> None:
    """Wait for saves in flight before Python's own wait for non-daemon threads (which cannot
    be interrupted cleanly); concurrent.futures registers its exit the same way."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return  # another Python: its own wait for the thread remains
    try:
        register(_at_thread_shutdown)
    except RuntimeError:
        pass  # imported during shutdown: Python's wait for the thread remains


_register_exit_wait()


def _start(thread: threading.Thread, path: str, run: Callable[[], None]) -> threading.Thread | None:
    """Start ``thread`` as the save of ``path`` in flight; at interpreter shutdown (no new
    threads) run the save in this thread instead and return None."""
    with _unseen_lock:
        _in_flight[thread] = (path, threading.Event())
    try:
        thread.start()
    except RuntimeError:
        with _unseen_lock:
            _in_flight.pop(thread, None)
        run()
        return None
    return thread


def _finished() -> None:
    with _unseen_lock:
        entry = _in_flight.pop(threading.current_thread(), None)
    if entry is not None:
        entry[1].set()


class SaveFuture(concurrent.futures.Future[str]):
    """The pending result of ``Saver.save(..., blocking=False)``: a ``concurrent.futures.Future``.

    ``result(timeout)`` returns the checkpoint's path once it is committed (written, renamed
    and recorded in the state file) or raises the save's error; ``done()``, ``exception()``
    and ``add_done_callback()`` work as for any future. A save in flight cannot be cancelled.

    Example:
        >>> import ckpt, os, tempfile
        >>> saver = ckpt.Saver([ckpt.Variable(1.0, name="x")])
        >>> future = saver.save(os.path.join(tempfile.mkdtemp(), "m.h5"), blocking=False)
        >>> os.path.basename(future.result()), future.done()
        ('m.h5', True)
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        #: The checkpoint path being written.
        self.path = path

    def result(self, timeout: float | None = None) -> str:
        try:
            return super().result(timeout)
        except BaseException:
            if self.done():
                _seen(self)  # the caller has the error now; the Saver will not raise it again
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        exc = super().exception(timeout)
        if exc is not None:
            _seen(self)
        return exc

    def __repr__(self) -> str:
        failed = self.done() and super().exception() is not None  # not self.exception(): a repr sees nothing
        state = "running" if not self.done() else "failed" if failed else "committed"
        return f"<ckpt.SaveFuture {self.path!r} {state}>"


def _seen(future: SaveFuture) -> None:
    with _unseen_lock:
        _unseen.pop(id(future), None)


def _unseen_error(future: SaveFuture) -> BaseException | None:
    """The future's error if nobody has seen it yet (and mark it seen)."""
    with _unseen_lock:
        if _unseen.pop(id(future), None) is None:
            return None
    return future.exception()


@atexit.register
def _report_unseen() -> None:
    """At exit (after background saves finished), print failures that nobody looked at."""
    with _unseen_lock:
        failed = list(_unseen.values())
        _unseen.clear()
    for future in failed:
        exc = future.exception()
        print(f"ckpt: the background save of {future.path} failed and nobody waited for it: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)


class BackgroundSaves:
    """One Saver's asynchronous saves: the save in flight, its staging arena and its error.

    Args:
        staging_bytes: the most bytes the snapshot may copy (None: the whole model). When the
            model is larger, the writer reads the first tensors straight from the variables
            and ``submit`` returns once only the staged tail is left to write.
    """

    def __init__(self, staging_bytes: int | None = None) -> None:
        if staging_bytes is not None and (isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int)
                                          or staging_bytes < 0):
            raise ValueError(f"staging_bytes must be a non-negative int or None (a model's worth), "
                             f"got {staging_bytes!r}")
        self.staging_bytes = staging_bytes
        self.arena = StagingArena()
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._future: SaveFuture | None = None

    def wait(self) -> None:
        """Wait for the save in flight; raise its error if nobody has seen it yet."""
        with self._lock:
            thread, future = self._thread, self._future
            if thread is threading.current_thread():
                raise RuntimeError("a save's done-callback cannot wait for that save (it runs inside it)")
            if thread is not None:
                thread.join()
            self._thread = self._future = None
            if future is not None:
                error = _unseen_error(future)
                if error is not None:
                    raise error

    def submit(self, path: str, tensors: Sequence[tuple[str, np.ndarray]],
               write: Callable[[Sequence[tuple[str, Any]]], str]) -> SaveFuture:
        """Snapshot ``tensors``, start ``write(sources)`` in a thread, return once the live
        tensors are no longer needed. The caller has already waited for the previous save."""
        with self._lock:
            sources, gate = self.arena.stage(tensors, self.staging_bytes)
            future = SaveFuture(path)
            future.set_running_or_notify_cancel()

            def run() -> None:
                try:
                    with one_thread():  # one core for the write; training keeps the others
                        result = write(sources)
                except BaseException as exc:
                    gate.close()
                    with _unseen_lock:
                        _unseen[id(future)] = future
                    future.set_exception(exc)
                else:
                    gate.close()
                    future.set_result(result)
                finally:
                    _finished()

            # never a daemon (even when called from one): interpreter exit waits for the commit
            thread = threading.Thread(target=run, name=f"ckpt-save {os.path.basename(path)}", daemon=False)
            self._thread, self._future = _start(thread, path, run), future
            _wait_uninterrupted(gate)
            return future

    def take_part(self, path: str, collective: Callable[[], Any]) -> None:
        """Run ``collective`` in a background thread as the save in flight, its outcome
        ignored: a rank whose asynchronous save failed before it started (the caller raises that
        error) still takes part in the save's collectives on the duplicated communicator, so
        the other ranks' saves fail at once, naming it, and the ranks stay in step."""
        def run() -> None:
            try:
                collective()
            except Exception:
                pass  # every rank's save failed with this rank's error, which its caller has
            finally:
                _finished()

        with self._lock:
            thread = threading.Thread(target=run, name=f"ckpt-save {os.path.basename(path)}", daemon=False)
            self._thread, self._future = _start(thread, path, run), None


def _wait_uninterrupted(gate: Any) -> None:
    """Wait for the gate even through Ctrl-C: returning early would let training change variables
    the writer is still reading. The interruption is re-raised once the gate is open."""
    interrupted: BaseException | None = None
    while True:
        try:
            gate.wait()
            break
        except BaseException as exc:  # KeyboardInterrupt, or a signal handler's exception
            interrupted = exc
    if interrupted is not None:
        raise interrupted
