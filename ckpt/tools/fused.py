"""A tensor of a local file worked through in pieces, each read, checksummed and used by one thread.

Where a tensor's bytes lie at known offsets of a local file (msgpack, contiguous HDF5 datasets),
each worker thread reads the next piece itself (``preadv`` into its own buffer), runs the crc32c
of those bytes and the caller's numpy passes over them while they are still in its core's cache;
the two threads take piece numbers from one counter. The pieces' results are merged strictly in
piece order (so results do not depend on thread timing), and their crc32c values are combined in
order into the tensor's, checked at the end: a damaged tensor raises CorruptCheckpointError naming
the file and tensor, and the caller's result is never complete.

Pieces are cut where ``tensor_chunks`` and the statistics cut them (the odd chunk first, each chunk
into pieces from its start), so results are the same bits as the chunked path's.

Example:
    >>> import ckpt, numpy as np, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "m.msgpack")
    >>> _ = ckpt.Saver({"w": ckpt.Variable(np.arange(6.0))}).save(path)
    >>> with ckpt.load_checkpoint(path) as reader:
    ...     layout = local_layout(reader, "w")
    ...     sums = []
    ...     work_pieces(layout, piece_bounds(6, 4, 2), lambda i, x: float(x.sum()), sums.append, OneThread("doc"))
    >>> sums
    [1.0, 5.0, 9.0]
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import numpy as np

from ckpt.buffers import aligned_empty
from ckpt.checksums import crc32c, crc32c_combine
from ckpt.errors import checksum_error
from ckpt.formats.base import Reader
from ckpt.saving.reader import CheckpointReader
from ckpt.storage.localfile import LocalFile
from ckpt.tools.chunks import OneThread

__all__ = ["Layout", "local_layout", "piece_bounds", "work_paired_pieces", "work_pieces"]

T = TypeVar("T")


class Layout(NamedTuple):
    """Where a tensor's C-order bytes lie in a local file, and the crc32c stored for them."""

    reader: Reader
    key: str
    dtype: np.dtype
    extents: list[tuple[int, int]]
    crc: int


def local_layout(reader: CheckpointReader, key: str) -> Layout | None:
    """The layout of tensor ``key`` when it is raw bytes at known offsets of a local file with a
    stored crc32c; None otherwise (compressed, chunked HDF5, incremental, strings, URLs)."""
    formatted = reader._reader
    if not isinstance(getattr(formatted, "_source", None), LocalFile):
        return None  # a URL's reads are requests: read there in big chunks, ahead (tensor_chunks)
    extents, crc = formatted.data_extents(key), formatted.stored_crc32c(key)
    if extents is None or crc is None:
        return None
    info = formatted.tensors[key]
    return Layout(formatted, key, info.dtype, [(int(o), int(n)) for o, n in extents], crc)


def piece_bounds(size: int, chunk: int, piece: int) -> list[tuple[int, int]]:
    """Element bounds of the pieces of a tensor of ``size`` elements cut in chunks of ``chunk``
    (the odd one first) and each chunk in pieces of ``piece`` from its start.

    Example:
        >>> piece_bounds(10, 4, 3)
        [(0, 2), (2, 5), (5, 6), (6, 9), (9, 10)]
    """
    first = size % chunk or chunk
    starts = [0, *range(first, size, chunk)] if size else []
    return [(lo, min(lo + piece, hi)) for s in starts for hi in [min(s + chunk if s else first, size)]
            for lo in range(s, hi, piece)]


_local = threading.local()


def _buffer(nbytes: int, slot: int = 0) -> np.ndarray:
    """This thread's page-aligned read buffer number ``slot``, at least ``nbytes`` long (kept:
    pages touched once)."""
    buffers: list[np.ndarray | None] = _local.__dict__.setdefault("buffers", [])
    buffers.extend([None] * (slot + 1 - len(buffers)))
    buffer = buffers[slot]
    if buffer is None or buffer.size < nbytes:
        buffer = buffers[slot] = aligned_empty((max(nbytes, 1),), np.uint8)
    return buffer


def _read(layout: Layout, start: int, view: memoryview) -> int:
    """Fill ``view`` with the tensor's bytes from byte ``start`` on (across extents), on this thread;
    return their crc32c."""
    what = f"tensor {layout.key!r}"
    pos = done = 0
    crc = 0
    for offset, n in layout.extents:
        if done < len(view) and pos + n > start + done:
            skip = start + done - pos
            part = view[done:done + min(n - skip, len(view) - done)]
            layout.reader.read_range_into(offset + skip, part, what)
            crc = crc32c(part) if not done else crc32c_combine(crc, crc32c(part), len(part))
            done += len(part)
        pos += n
    if done != len(view):
        raise AssertionError(f"{what}: {len(view)} bytes at {start} are past the tensor's extents")
    return crc


def work_pieces(layout: Layout, bounds: list[tuple[int, int]], work: Callable[[int, np.ndarray], T],
                merge: Callable[[T], None], helper: OneThread, *, alone: int = 1) -> None:
    """``merge(work(i, values))`` for each piece ``bounds[i]`` of the tensor, merges in piece order.

    The first ``alone`` pieces are worked on this thread before the others start (a caller's first
    piece may set what the others need); then this thread and ``helper``'s take the next piece as
    they finish one. Merges run under a lock, in order, on whichever thread completes the run.
    Raises the checksum error (after every piece) where the bytes read are not those the file
    stored a crc32c for.
    """
    _work_all([layout], bounds, lambda i, values: work(i, values[0]), merge, helper, alone)


def work_paired_pieces(a: Layout, b: Layout, bounds: list[tuple[int, int]],
                       work: Callable[[int, np.ndarray, np.ndarray], T], merge: Callable[[T], None],
                       helper: OneThread) -> None:
    """``work_pieces`` over the same pieces of two tensors of one size: each piece of both is read
    by the thread that calls ``work(i, values_a, values_b)``; both crc32c values are checked (A's
    first) after every piece."""
    _work_all([a, b], bounds, lambda i, values: work(i, values[0], values[1]), merge, helper, 0)


def _work_all(layouts: list[Layout], bounds: list[tuple[int, int]], work: Callable[[int, list[np.ndarray]], T],
              merge: Callable[[T], None], helper: OneThread, alone: int) -> None:
    """work_pieces over the same pieces of each of ``layouts``."""
    crcs: list[list[int]] = [[0] * len(bounds) for _ in layouts]
    results: dict[int, Any] = {}
    lock = threading.Lock()
    merged = 0
    counter = itertools.count(alone)
    failed: list[BaseException] = []

    def one(i: int) -> None:
        lo, hi = bounds[i]
        values = []
        for slot, layout in enumerate(layouts):
            item = max(layout.dtype.itemsize, 1)
            buffer = _buffer((hi - lo) * item, slot)[:(hi - lo) * item]
            crcs[slot][i] = _read(layout, lo * item, buffer.data)
            values.append(buffer.view(layout.dtype))
        result = work(i, values)
        nonlocal merged
        with lock:  # the run of finished pieces from the next to merge on, in order
            results[i] = result
            while merged in results:
                merge(results.pop(merged))
                merged += 1

    def share() -> None:
        while not failed:
            with lock:
                i = next(counter)
            if i >= len(bounds):
                return
            try:
                one(i)
            except BaseException as exc:
                failed.append(exc)  # the other thread stops at its next piece
                raise

    for i in range(min(alone, len(bounds))):
        one(i)
    if alone < len(bounds):
        job = helper.get().submit(share) if len(bounds) - alone > 1 else None
        try:
            share()
        finally:
            if job is not None:
                job.exception()  # no thread may still use the pieces once we are gone
        if failed:
            raise failed[0]
    for layout, got in zip(layouts, crcs):
        _check(layout, bounds, got)


def _check(layout: Layout, bounds: list[tuple[int, int]], crcs: list[int]) -> None:
    """Raise the checksum error unless the pieces' crc32c values, combined in order, are the stored one."""
    item = max(layout.dtype.itemsize, 1)
    crc = crcs[0] if crcs else 0
    for (lo, hi), got in zip(bounds[1:], crcs[1:]):
        crc = crc32c_combine(crc, got, (hi - lo) * item)
    if crc != layout.crc:
        raise checksum_error(layout.reader.path, f"tensor {layout.key!r}", crc, layout.crc, key=layout.key)
