"""The MPI communicator (mpi4py): non-blocking collectives polled against a deadline.

MPI's blocking collectives cannot time out, so every collective here is started with its
non-blocking form (``Ibarrier``, ``Iallgather``/``Iallgatherv``, ``Ibcast``) and polled with
``Test`` until it completes or the timeout passes. Messages are raw bytes (``MPI.BYTE``):
mpi4py's pickle-based lower-case methods are never used.

Example:
    >>> from ckpt import distributed
    >>> comm = distributed.mpi()  # doctest: +SKIP
    >>> comm.allgather(b"%d" % comm.rank, timeout=60)  # doctest: +SKIP
    [b'0', b'1', b'2', b'3']
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .comm import CollectiveTimeoutError

__all__ = ["MPICommunicator", "mpi"]


def _mpi() -> Any:
    try:
        from mpi4py import MPI  # lazy: an optional dependency, imported only by mpi()
    except ImportError as exc:
        raise ImportError("ckpt.distributed.mpi() needs mpi4py and an MPI library: "
                          "pip install 'ckpt-numpy[mpi]' (mpi4py and the mpich wheel)") from exc
    return MPI


class MPICommunicator:
    """A Communicator over an mpi4py communicator (its own duplicate of it).

    Args:
        comm: an ``mpi4py.MPI.Comm``; it is duplicated (``Dup``, a collective), so
            checkpoint traffic never matches the caller's own collectives.
    """

    def __init__(self, comm: Any, *, _duplicated: bool = False) -> None:
        self._MPI = _mpi()
        self._comm = comm if _duplicated else comm.Dup()
        self.rank: int = self._comm.Get_rank()
        self.size: int = self._comm.Get_size()
        self._stuck: list[Any] = []  # requests abandoned at a timeout (freeing them is not allowed)

    def _wait(self, request: Any, timeout: float, what: str) -> None:
        if self._stuck:
            raise CollectiveTimeoutError(
                f"rank {self.rank}: this communicator timed out in an earlier collective; its ranks are "
                "out of step (create a new one with distributed.mpi())")
        deadline = time.monotonic() + timeout
        pause = 0.0001
        while not request.Test():
            if time.monotonic() > deadline:
                self._stuck.append(request)
                raise CollectiveTimeoutError(
                    f"rank {self.rank} of {self.size}: {what} did not complete within {timeout:g} s: "
                    "another rank died, hangs, or never called it")
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    def barrier(self, timeout: float) -> None:
        self._wait(self._comm.Ibarrier(), timeout, "a barrier")

    def allgather(self, data: bytes, timeout: float) -> list[bytes]:
        MPI = self._MPI
        data = bytes(data)
        sizes = np.zeros(self.size, np.int64)
        self._wait(self._comm.Iallgather([np.array([len(data)], np.int64), MPI.INT64_T], [sizes, MPI.INT64_T]),
                   timeout, "an allgather (sizes)")
        counts = [int(n) for n in sizes]
        displs = [sum(counts[:i]) for i in range(self.size)]
        out = bytearray(sum(counts))
        self._wait(self._comm.Iallgatherv([data, MPI.BYTE], [out, counts, displs, MPI.BYTE]), timeout,
                   "an allgather")
        view = memoryview(out)
        return [bytes(view[d:d + n]) for d, n in zip(displs, counts)]

    def broadcast(self, data: bytes | None, root: int, timeout: float) -> bytes:
        MPI = self._MPI
        size = np.array([len(data) if self.rank == root and data is not None else 0], np.int64)
        if self.rank == root and data is None:
            raise ValueError("the root of a broadcast must pass data")
        self._wait(self._comm.Ibcast([size, MPI.INT64_T], root=root), timeout, "a broadcast (size)")
        buf = bytearray(data) if self.rank == root else bytearray(int(size[0]))  # type: ignore[arg-type]
        self._wait(self._comm.Ibcast([buf, MPI.BYTE], root=root), timeout, "a broadcast")
        return bytes(buf)

    def dup(self, timeout: float | None = None) -> MPICommunicator:
        """A duplicate (its own traffic). With ``timeout``, MPI's non-blocking ``Idup`` polled
        against it: a rank that never calls ``dup`` makes the others raise
        CollectiveTimeoutError instead of waiting in ``Dup`` for ever."""
        if timeout is None:
            return MPICommunicator(self._comm)
        new, request = self._comm.Idup()
        self._wait(request, timeout, "duplicating the communicator (Idup)")
        return MPICommunicator(new, _duplicated=True)

    def __repr__(self) -> str:
        return f"<ckpt.distributed.MPICommunicator rank={self.rank} size={self.size}>"


def mpi(comm: Any = None) -> MPICommunicator:
    """A Communicator over ``comm`` (default: mpi4py's ``COMM_WORLD``); a collective call.

    Raises:
        ImportError: mpi4py is not installed (``pip install 'ckpt-numpy[mpi]'``).
    """
    MPI = _mpi()
    return MPICommunicator(MPI.COMM_WORLD if comm is None else comm)
