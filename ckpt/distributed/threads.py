"""Communicators between threads of one process: N simulated ranks, for tests and benchmarks.

Each thread plays one rank. Collectives meet in shared memory, in call order, and time out
like real ones, so code written against :class:`~ckpt.distributed.Communicator` can be
exercised (and a rank that never arrives simulated) without MPI.

Example:
    >>> import threading
    >>> from ckpt import distributed
    >>> comms = distributed.threads(3)
    >>> out = [None] * 3
    >>> def run(c): out[c.rank] = c.allgather(bytes([c.rank]), timeout=10)
    >>> workers = [threading.Thread(target=run, args=(c,)) for c in comms]
    >>> for w in workers: w.start()
    >>> for w in workers: w.join()
    >>> out[2]
    [b'\\x00', b'\\x01', b'\\x02']
"""

from __future__ import annotations

import threading
from typing import Any

from .comm import CollectiveTimeoutError

__all__ = ["ThreadCommunicator", "threads"]


class _Group:
    def __init__(self, size: int) -> None:
        self.size = size
        self.cond = threading.Condition()
        self.slots: dict[int, dict[str, Any]] = {}
        self.children: dict[int, _Group] = {}


class ThreadCommunicator:
    """One rank of a group made by :func:`threads`; use it from one thread only."""

    def __init__(self, group: _Group, rank: int) -> None:
        self._group = group
        self.rank = rank
        self.size = group.size
        self._calls = 0
        self._dups = 0
        self._broken = False

    def _exchange(self, data: bytes | None, timeout: float, what: str) -> list[bytes | None]:
        if self._broken:
            raise CollectiveTimeoutError(f"rank {self.rank}: this communicator timed out in an earlier "
                                         "collective; its ranks are out of step")
        group, seq = self._group, self._calls
        self._calls += 1
        with group.cond:
            slot = group.slots.setdefault(seq, {"data": [None] * self.size, "arrived": set(), "read": 0})
            slot["data"][self.rank] = data
            slot["arrived"].add(self.rank)
            group.cond.notify_all()
            if not group.cond.wait_for(lambda: len(slot["arrived"]) == self.size, timeout):
                self._broken = True
                missing = [r for r in range(self.size) if r not in slot["arrived"]]
                raise CollectiveTimeoutError(
                    f"rank {self.rank} of {self.size}: {what} did not complete within {timeout:g} s: "
                    f"rank(s) {', '.join(map(str, missing))} did not arrive")
            slot["read"] += 1
            if slot["read"] == self.size:
                del group.slots[seq]
            return list(slot["data"])

    def barrier(self, timeout: float) -> None:
        self._exchange(b"", timeout, "a barrier")

    def allgather(self, data: bytes, timeout: float) -> list[bytes]:
        return [bytes(d or b"") for d in self._exchange(bytes(data), timeout, "an allgather")]

    def broadcast(self, data: bytes | None, root: int, timeout: float) -> bytes:
        if self.rank == root and data is None:
            raise ValueError("the root of a broadcast must pass data")
        return bytes(self._exchange(data if self.rank == root else None, timeout, "a broadcast")[root] or b"")

    def dup(self, timeout: float | None = None) -> ThreadCommunicator:
        group = self._group
        with group.cond:
            child = group.children.setdefault(self._dups, _Group(self.size))
        self._dups += 1
        return ThreadCommunicator(child, self.rank)

    def __repr__(self) -> str:
        return f"<ckpt.distributed.ThreadCommunicator rank={self.rank} size={self.size}>"


def threads(size: int) -> list[ThreadCommunicator]:
    """``size`` connected communicators, one per simulated rank (each used by its own thread)."""
    if size < 1:
        raise ValueError(f"a group needs at least one rank, got {size}")
    group = _Group(size)
    return [ThreadCommunicator(group, r) for r in range(size)]
