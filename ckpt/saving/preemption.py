"""Preemption: ``ckpt.PreemptionGuard`` turns the scheduler's signal into a flag the loop checks.

A preempted job gets a signal (SIGTERM, or SIGUSR1 from SLURM's ``--signal``) and a grace period.
The default action kills the process at once, mid-step; the guard's handlers only record the
signal, so the training loop decides where to stop: ``if guard.requested: saver.save(...); break``.

Example:
    >>> import ckpt, signal
    >>> with ckpt.PreemptionGuard() as guard:
    ...     signal.raise_signal(signal.SIGUSR1)   # what the scheduler sends
    ...     guard.requested, guard.signal == signal.SIGUSR1
    (True, True)
"""

from __future__ import annotations

import signal as _signal
import threading
from collections.abc import Iterable
from types import FrameType, TracebackType
from typing import Any

from ckpt.saving.async_save import wait_for_saves_in_flight

__all__ = ["PreemptionGuard"]

_Handler = Any  # what signal.getsignal returns: a callable, SIG_DFL, SIG_IGN or None


class PreemptionGuard:
    """A context manager whose signal handlers only record that the job is asked to stop.

    Args:
        signals: the signals to catch while the block runs (default SIGTERM and SIGUSR1).
        comm: a :class:`ckpt.distributed.Communicator`: ``requested`` is then agreed across
            ranks. Every rank must read it at the same points of the loop (it is a collective:
            one allgather of one byte, bounded by ``timeout``); when any rank has been
            signalled, every rank sees True at the same check, so all save the same step.
        timeout: with ``comm``, seconds a check waits for the other ranks
            (``ckpt.distributed.CollectiveTimeoutError`` after that).

    Entering the block (in the main thread: Python runs signal handlers there) installs the
    handlers; leaving it first waits for every asynchronous save (``blocking=False``) still in
    flight, with the handlers still installed, so that a second signal cannot kill the process
    before that checkpoint is committed, and then restores the previous handlers.
    """

    def __init__(self, signals: Iterable[int] = (_signal.SIGTERM, _signal.SIGUSR1), *, comm: Any = None,
                 timeout: float = 300.0) -> None:
        self.signals = tuple(_signal.Signals(s) for s in signals)
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self._comm = comm
        self._timeout = float(timeout)
        self._received: int | None = None
        self._agreed = False
        self._previous: dict[int, _Handler] | None = None

    @property
    def signal(self) -> int | None:
        """The first signal this process received under the guard (or passed to ``request``), or None."""
        return self._received

    @property
    def requested(self) -> bool:
        """True once a stop was requested: on this process, or with ``comm`` on any rank.

        With ``comm`` each read is a collective until it returns True (every rank gets True at
        the same read; later reads return True without communicating)."""
        if self._comm is None:
            return self._received is not None
        if not self._agreed:
            from ckpt.distributed.comm import CollectiveTimeoutError  # lazy: only with comm=

            flags = self._comm.allgather(b"\x01" if self._received is not None else b"\x00", self._timeout)
            if len(flags) != self._comm.size or any(len(f) != 1 for f in flags):
                raise CollectiveTimeoutError(f"rank {self._comm.rank}: PreemptionGuard.requested: the ranks "
                                             "are out of step (a rank answered another collective)")
            self._agreed = any(f != b"\x00" for f in flags)
        return self._agreed

    def request(self, signum: int | None = None) -> None:
        """Ask for a stop as a signal would (a time limit the job checks itself, a test)."""
        if self._received is None:
            self._received = 0 if signum is None else int(signum)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # only record: a handler that saved or raised here would do it mid-step, at any bytecode
        self.request(signum)

    def __enter__(self) -> PreemptionGuard:
        if self._previous is not None:
            raise RuntimeError("this PreemptionGuard is already active")
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("a PreemptionGuard must be entered in the main thread (Python runs signal "
                             "handlers there only)")
        previous: dict[int, _Handler] = {}
        try:
            for signum in self.signals:
                previous[signum] = _signal.signal(signum, self._handle)
        except BaseException:
            _restore(previous)
            raise
        self._previous = previous
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            wait_for_saves_in_flight()
        finally:
            previous, self._previous = self._previous or {}, None
            _restore(previous)

    def __repr__(self) -> str:  # never a collective: a debugger's repr must not desynchronise ranks
        names = ", ".join(s.name for s in self.signals)
        return f"<ckpt.PreemptionGuard signals=({names}) signal={self._received}>"


def _restore(previous: dict[int, _Handler]) -> None:
    for signum, handler in previous.items():
        # None: a handler not installed from Python; the default is the closest we can restore
        _signal.signal(signum, _signal.SIG_DFL if handler is None else handler)
