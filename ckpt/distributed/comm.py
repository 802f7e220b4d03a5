"""The Communicator interface sharded saves and restores run on, and the one-process one.

A communicator moves small byte strings between the processes of a job; ckpt encodes what
it sends with msgpack (never pickle). Every call takes a timeout in seconds and raises
:class:`CollectiveTimeoutError` when it passes, so a rank that died or never arrived makes
the others fail instead of hanging. After a timeout the communicator's collectives are out
of step: it refuses further use.

Adapting another engine (torch.distributed, a job scheduler's key-value store) takes the
five members of :class:`Communicator`; docs/distributed.md shows one for torch.distributed.

Example:
    >>> from ckpt import distributed
    >>> comm = distributed.local()
    >>> comm.rank, comm.size, comm.allgather(b"hi", timeout=1.0)
    (0, 1, [b'hi'])
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

import msgpack

from ..errors import CheckpointError, CheckpointWriteError

__all__ = ["Communicator", "LocalCommunicator", "CollectiveTimeoutError", "OutcomeUnknownError", "local", "encode",
           "decode", "duplicate"]


class CollectiveTimeoutError(CheckpointError, TimeoutError):
    """A collective did not complete in time: another rank died, hangs, or never called it."""


class OutcomeUnknownError(CheckpointWriteError, TimeoutError):
    """A sharded save timed out on this rank after it reported its part written, before rank 0
    told the outcome: the checkpoint may or may not be committed (``latest_checkpoint`` tells)."""


@runtime_checkable
class Communicator(Protocol):
    """What ckpt needs from a group of processes: their number, this one's rank, and three
    collectives on small byte strings, each bounded by a timeout in seconds.

    Every rank calls the same collectives in the same order. Implementations raise
    :class:`CollectiveTimeoutError` when ``timeout`` seconds pass.
    """

    rank: int
    size: int

    def barrier(self, timeout: float) -> None:
        """Return once every rank has called barrier."""

    def allgather(self, data: bytes, timeout: float) -> list[bytes]:
        """Return every rank's ``data``, indexed by rank."""

    def broadcast(self, data: bytes | None, root: int, timeout: float) -> bytes:
        """Return ``root``'s ``data`` on every rank (the others pass None)."""

    def dup(self) -> Communicator:
        """A communicator over the same ranks whose collectives never match this one's
        (checkpoint collectives must not interleave with training's own). A collective: an
        implementation whose ``dup`` also takes a ``timeout`` keyword (seconds, raising
        CollectiveTimeoutError) gets the Saver's, as ``distributed.mpi()``'s does."""


class LocalCommunicator:
    """One process: rank 0 of 1. A Saver with it writes a sharded checkpoint by itself.

    Example:
        >>> LocalCommunicator().broadcast(b"x", root=0, timeout=1.0)
        b'x'
    """

    rank = 0
    size = 1

    def barrier(self, timeout: float) -> None:
        return None

    def allgather(self, data: bytes, timeout: float) -> list[bytes]:
        return [bytes(data)]

    def broadcast(self, data: bytes | None, root: int, timeout: float) -> bytes:
        if root != 0 or data is None:
            raise ValueError("a one-process communicator broadcasts from rank 0, which must pass data")
        return bytes(data)

    def dup(self, timeout: float | None = None) -> LocalCommunicator:
        return LocalCommunicator()

    def __repr__(self) -> str:
        return "<ckpt.distributed.LocalCommunicator rank=0 size=1>"


def local() -> LocalCommunicator:
    """The communicator of a single process (no MPI needed)."""
    return LocalCommunicator()


def encode(obj: Any) -> bytes:
    """msgpack bytes of plain data (what ranks tell each other)."""
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def decode(raw: bytes, what: str) -> Any:
    """The plain data behind ``encode``'s bytes; CheckpointError if another rank sent garbage."""
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise CheckpointError(f"{what}: a rank sent a message that is not valid msgpack ({exc})") from exc


def duplicate(comm: Communicator, timeout: float) -> Communicator:
    """``comm.dup()``, bounded by ``timeout`` where the implementation's ``dup`` takes one
    (``distributed.mpi()``'s does: MPI's blocking ``Dup`` cannot time out)."""
    try:
        timed = "timeout" in inspect.signature(comm.dup).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): call it plainly
        timed = False
    return comm.dup(timeout=timeout) if timed else comm.dup()  # type: ignore[call-arg]
