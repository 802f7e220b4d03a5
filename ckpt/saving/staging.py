"""Staging for asynchronous saves: a snapshot of the variables in reusable page-aligned memory.

An asynchronous save copies the variables' values into a *staging arena* (one page-aligned
block, allocated on the first save and reused by every later one) and hands the copies to the
writer, so training may change the variables while the file is written. With a staging bound
smaller than the model, only the last tensors (in the writer's order) are copied; the writer
reads the others straight from the variables while ``save`` waits for it (a :class:`Gate`
tells ``save`` when the writer has finished with every one of them).

Example:
    >>> import numpy as np
    >>> from ckpt.saving.staging import StagingArena
    >>> arena = StagingArena()
    >>> live = np.arange(4.0)
    >>> (key, copy), = arena.stage([("w", live)], limit=None)[0]
    >>> live[:] = 0
    >>> copy
    array([0., 1., 2., 3.])
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ckpt.buffers import ALIGN_MIN_BYTES, PAGE, aligned_empty
from ckpt.errors import CheckpointWriteError
from ckpt.storage.workers import workers

__all__ = ["StagingArena", "Gate", "slot_bytes", "peek"]

#: Small tensors are packed at cache-line offsets (enough alignment for every dtype).
_SMALL_ALIGN = 64
#: Snapshots at least this large are copied by the I/O worker threads in pieces of _PIECE bytes
#: (np.copyto releases the GIL: several cores copy side by side, and save blocks less).
_PARALLEL_MIN = 16 << 20
_PIECE = 8 << 20


def _copy_all(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Copy each (destination, source) byte array; large totals in parallel pieces."""
    if sum(len(src) for _, src in pairs) < _PARALLEL_MIN:
        for dst, src in pairs:
            np.copyto(dst, src)
        return
    pieces = [(dst[i:i + _PIECE], src[i:i + _PIECE]) for dst, src in pairs for i in range(0, len(src), _PIECE)]
    for future in [workers().submit(np.copyto, dst, src) for dst, src in pieces]:
        future.result()


def slot_bytes(nbytes: int) -> int:
    """Bytes a tensor of ``nbytes`` takes in the arena: page-rounded when large, else 64-rounded."""
    align = PAGE if nbytes >= ALIGN_MIN_BYTES else _SMALL_ALIGN
    return -(-nbytes // align) * align


class Gate:
    """Tells the saving thread when the writer no longer needs any live (unstaged) tensor.

    The writer materializes its sources one at a time (the format contract); once it asks for
    another source, or returns, it is done with the previous one. ``save`` waits on the gate
    until every live source is done, then returns while the staged tail is still being written.
    """

    def __init__(self, live: int) -> None:
        self._lock = threading.Lock()
        self._open = threading.Event()
        self._remaining = live  # live sources the writer has not finished with yet
        self._current: _Source | None = None
        if live == 0:
            self._open.set()

    def entered(self, source: _Source) -> None:
        """The writer asks for ``source``: it is done with the one it asked for before."""
        with self._lock:
            if source.done and source.live:  # read again after save returned: training may have changed it
                raise CheckpointWriteError(
                    f"tensor {source.key!r} was read twice by the format's writer; it cannot be saved "
                    "asynchronously with a staging bound below the model's size (raise staging_bytes)")
            previous, self._current = self._current, source
            if previous is not None and previous is not source:
                self._finish(previous)

    def close(self) -> None:
        """The writer returned (or failed): nothing is read any more."""
        with self._lock:
            if self._current is not None:
                self._finish(self._current)
                self._current = None
            self._open.set()

    def _finish(self, source: _Source) -> None:
        source.done = True
        if source.live:
            self._remaining -= 1
            if self._remaining == 0:
                self._open.set()

    def wait(self) -> None:
        """Block until the writer no longer reads any live tensor."""
        self._open.wait()


class _Source:
    """A tensor handed to the writer as a lazy source, reporting to the gate when it is read."""

    __slots__ = ("array", "done", "gate", "key", "live")

    def __init__(self, key: str, array: np.ndarray, live: bool, gate: Gate) -> None:
        self.key, self.array, self.live, self.gate, self.done = key, array, live, gate, False

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        self.gate.entered(self)
        if (dtype is not None and np.dtype(dtype) != self.array.dtype) or copy:
            return np.array(self.array, dtype=dtype, copy=True)
        return self.array


def peek(source: Any) -> np.ndarray:
    """The array behind a source ``StagingArena.stage`` returned (or an array), without telling the
    gate: a look before the writer starts (a sharded save's replicated-value check), while the gate
    is still closed, so training cannot change a live tensor meanwhile."""
    return source.array if isinstance(source, _Source) else np.asarray(source)


class StagingArena:
    """One page-aligned block holding the snapshot of a save, reused across saves.

    The block grows only when a save needs more than it holds (a Saver's variables never
    change size, so after the first save it is never reallocated).
    """

    def __init__(self) -> None:
        self._block: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        """Bytes allocated for staging so far (0 before the first asynchronous save)."""
        return 0 if self._block is None else self._block.nbytes

    def _reserve(self, nbytes: int) -> np.ndarray:
        if self._block is None or self._block.nbytes < nbytes:
            self._block = None  # drop the old block before allocating the new one
            self._block = aligned_empty((max(nbytes, ALIGN_MIN_BYTES),), np.uint8)
        return self._block

    def stage(self, tensors: Sequence[tuple[str, np.ndarray]],
              limit: int | None) -> tuple[list[tuple[str, Any]], Gate]:
        """Copy the tensors (or the longest tail of them fitting in ``limit`` bytes) into the arena.

        Returns the sources to hand to the writer, in the same order, and the gate that
        opens once the writer no longer reads a tensor that was not copied. Byte-string
        tensors hold references to immutable ``bytes``: they are snapshotted by copying the
        references (counted against ``limit`` at 8 bytes an element, but not in the arena).
        """
        first = len(tensors)  # tensors[first:] are staged
        used = 0
        for i in range(len(tensors) - 1, -1, -1):
            size = slot_bytes(tensors[i][1].nbytes)
            if limit is not None and used + size > limit:
                break
            used, first = used + size, i
        arena_bytes = sum(slot_bytes(a.nbytes) for _, a in tensors[first:] if a.dtype.kind != "O")
        block = self._reserve(arena_bytes) if arena_bytes else None
        staged: list[tuple[str, np.ndarray]] = []
        copies: list[tuple[np.ndarray, np.ndarray]] = []  # (arena bytes, variable bytes)
        offset = 0
        for key, arr in tensors[first:]:
            if arr.dtype.kind == "O":
                staged.append((key, arr.copy()))
                continue
            if arr.size == 0:  # nothing to snapshot, and no arena when every staged tensor is empty
                staged.append((key, np.empty(arr.shape, arr.dtype)))
                continue
            assert block is not None and arr.flags.c_contiguous
            copies.append((block[offset:offset + arr.nbytes], arr.reshape(-1).view(np.uint8)))
            staged.append((key, block[offset:offset + arr.nbytes].view(arr.dtype).reshape(arr.shape)))
            offset += slot_bytes(arr.nbytes)
        _copy_all(copies)
        if first == 0:
            return list(staged), Gate(0)  # all staged: plain arrays, nothing to wait for
        gate = Gate(first)
        sources: list[tuple[str, Any]] = [(key, _Source(key, arr, True, gate)) for key, arr in tensors[:first]]
        sources += [(key, _Source(key, arr, False, gate)) for key, arr in staged]
        return sources, gate
