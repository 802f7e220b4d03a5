"""Reading one tensor of a checkpoint in bounded chunks, each checked as it streams.

For ckpt's own formats (a tensor's bytes at known file extents, one crc32c per tensor) the
chunks are read straight from the file on the I/O pool that restores use, one or two chunks
ahead of the consumer, and the tensor's crc32c is built up from the chunks' as they come: the
last chunk is followed by the check, so a damaged tensor raises CorruptCheckpointError before
the caller's result is complete. Memory holds two chunks, never the tensor. Other formats are
read through their own (verified) readers: by blocks of rows where they can read part of a
tensor, whole otherwise.

Chunks are views of reused buffers: a consumer must be done with one before asking for the next.

Example:
    >>> import ckpt, numpy as np, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "m.msgpack")
    >>> _ = ckpt.Saver({"w": ckpt.Variable(np.arange(6.0))}).save(path)
    >>> with ckpt.load_checkpoint(path) as reader:
    ...     [c.tolist() for c in tensor_chunks(reader, "w", chunk_elements=4)]
    [[0.0, 1.0], [2.0, 3.0, 4.0, 5.0]]
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np

from ckpt.buffers import ALIGN_MIN_BYTES, PAGE, aligned_empty
from ckpt.checksums import crc32c_combine
from ckpt.errors import checksum_error
from ckpt.formats.base import Reader
from ckpt.saving.reader import CheckpointReader

__all__ = ["CHUNK_BYTES", "OneThread", "aligned_chunks", "chunk_elements", "paired_chunks", "reusing_buffers",
           "stored_crc32c", "tensor_chunks"]

#: Bytes of a tensor in one chunk (a multiple of the I/O pool's 4 MiB pieces).
CHUNK_BYTES = 8 << 20
_PIECE = 4 << 20  # the crc32c combination below works in pieces of this size


def chunk_elements(*itemsizes: int, chunk_bytes: int | None = None) -> int:
    """Elements per chunk for tensors of these item sizes: about ``chunk_bytes`` for the widest,
    and a whole number of 4 MiB pieces for every one (so their checksums combine).

    Example:
        >>> chunk_elements(4), chunk_elements(4, 2), chunk_elements(1, 16) * 16 >> 20
        (2097152, 2097152, 64)
    """
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    sizes = [max(1, s) for s in itemsizes] or [1]
    per_piece = _PIECE // min(sizes)  # elements in one piece of the narrowest dtype
    pieces = max(1, chunk_bytes // (per_piece * max(sizes)))
    return per_piece * pieces


_default_elements = chunk_elements


def stored_crc32c(reader: CheckpointReader, key: str) -> int | None:
    """The crc32c a checkpoint stores for a numeric tensor's C-order bytes, or None."""
    crc: int | None = reader._reader.stored_crc32c(key)
    return crc


def _streamable(reader: Reader, key: str) -> tuple[list[tuple[int, int]], int] | None:
    """The file extents and crc32c of a tensor a format reader stores that way, else None."""
    expected = reader.stored_crc32c(key)
    extents = reader.data_extents(key)
    if extents is None or expected is None:
        return None
    return [(int(o), int(n)) for o, n in extents], expected


def _read_range(reader: Reader, extents: list[tuple[int, int]], start: int, view: memoryview, what: str) -> int:
    """Fill ``view`` with the tensor's bytes from ``start`` on (across extents); return their crc32c."""
    spans, pos, done = [], 0, 0
    for offset, n in extents:
        if done < len(view) and pos + n > start + done:
            skip = start + done - pos
            take = min(n - skip, len(view) - done)
            spans.append((offset + skip, view[done:done + take]))
            done += take
        pos += n
    if done != len(view):
        raise AssertionError(f"{what}: {len(view)} bytes at {start} are past the tensor's extents")
    crc = 0
    for i, (offset, piece) in enumerate(spans):
        got = reader.read_range_crc32c(offset, piece, what)
        crc = got if i == 0 else crc32c_combine(crc, got, len(piece))
    return crc


class OneThread:
    """One worker thread, started on first use and forgotten in a forked child (which has none).

    Example:
        >>> OneThread("ckpt-doc").get().submit(sum, [1, 2]).result()
        3
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        os.register_at_fork(after_in_child=self._forget)

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
            return self._executor

    def _forget(self) -> None:
        self._executor, self._lock = None, threading.Lock()


_ahead = OneThread("ckpt-chunks")  # reads chunks ahead of their consumers (each read runs on the I/O pool)
_lock = threading.Lock()
_free: list[np.ndarray] = []  # chunk buffers kept for reuse while a reusing_buffers() block runs
_users = 0


def _forget_lock() -> None:
    global _lock
    _lock = threading.Lock()  # a forked child: no other thread holds it


os.register_at_fork(after_in_child=_forget_lock)


@contextmanager
def reusing_buffers() -> Iterator[None]:
    """Keep chunk buffers for the next tensor until the outermost block ends (fresh memory costs
    a page fault per 4 KiB on first touch: about as much as reading the bytes into it)."""
    global _users
    with _lock:
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if not _users:
                _free.clear()


def _take(nbytes: int) -> np.ndarray:
    """A chunk buffer, page-aligned where it is large (the kernel copies file pages into it ~1.6x faster:
    ckpt.buffers)."""
    with _lock:
        for i, whole in enumerate(_free):
            start = -whole.ctypes.data % PAGE if nbytes >= ALIGN_MIN_BYTES else 0
            if whole.size - start >= nbytes:
                return _free.pop(i)[start:start + nbytes]
    return aligned_empty((nbytes,), np.uint8)


def _give(buffer: np.ndarray) -> None:
    whole = buffer if buffer.base is None else buffer.base
    with _lock:
        if _users and len(_free) < 8 and isinstance(whole, np.ndarray):
            _free.append(whole)


def _shift(crc: int, pieces: int) -> int:
    """crc32c of some bytes -> the crc32c of them followed by ``pieces`` x 4 MiB of zeros."""
    for _ in range(pieces):
        crc = crc32c_combine(crc, 0, _PIECE)
    return crc


def _stream(reader: Any, key: str, extents: list[tuple[int, int]], expected: int,
            elements: int) -> Iterator[np.ndarray]:
    info = reader.tensors[key]
    item = max(info.dtype.itemsize, 1)
    total = info.nbytes
    step = elements * item  # a whole number of 4 MiB pieces (chunk_elements)
    first = total % step or step  # the odd chunk first: every later one is `step` bytes, whose crc shifts
    bounds = [(0, min(first, total))] + [(s, s + step) for s in range(first, total, step)]
    what = f"tensor {key!r}"
    buffers = [_take(min(step, total)) for _ in range(min(2, len(bounds)))]
    crc, pieces = 0, step // _PIECE
    pending: dict[int, Future[int]] = {}

    def submit(i: int) -> None:
        lo, hi = bounds[i]
        view = buffers[i % len(buffers)].data[:hi - lo]
        pending[i] = _ahead.get().submit(_read_range, reader, extents, lo, view, what)

    try:
        for i in range(len(buffers)):
            submit(i)
        for i, (lo, hi) in enumerate(bounds):
            chunk_crc = pending.pop(i).result()
            crc = chunk_crc if i == 0 else _shift(crc, pieces) ^ chunk_crc  # crc32c(so far + this chunk)
            yield buffers[i % len(buffers)][:hi - lo].view(info.dtype)
            if i + len(buffers) < len(bounds):
                submit(i + len(buffers))
    finally:
        for job in pending.values():  # no read may land in a buffer once we are gone
            job.cancel() or job.exception()
        for buffer in buffers:
            _give(buffer)
    if crc != expected:
        raise checksum_error(reader.path, f"tensor {key!r}", crc, expected, key=key)


def tensor_chunks(reader: CheckpointReader, key: str, chunk_elements: int | None = None, *,
                  chunk_bytes: int | None = None) -> Iterator[np.ndarray]:
    """Yield tensor ``key``'s values as flat arrays of about CHUNK_BYTES, in order, checked.

    ``chunk_elements`` (a whole number of 4 MiB pieces for streamed tensors: see
    :func:`chunk_elements`) sets the chunk size; the first chunk may be shorter.
    ``chunk_bytes`` sets it in bytes instead (None: CHUNK_BYTES), where ``chunk_elements`` is None.
    """
    formatted = reader._reader
    info = formatted.tensors[key] if key in formatted.tensors else reader.tensors[key]
    item = max(info.dtype.itemsize, 1)
    elements = chunk_elements if chunk_elements is not None else _default_elements(item, chunk_bytes=chunk_bytes)
    found = _streamable(formatted, key)
    if found is not None and info.nbytes > elements * item and (elements * item) % _PIECE == 0:
        yield from _stream(formatted, key, found[0], found[1], elements)
        return
    if info.nbytes > elements * item and info.shape and formatted.partial_reads:
        rows = max(1, elements // max(1, info.size // info.shape[0]))  # blocks of whole rows, the odd one first
        first = info.shape[0] % rows or rows
        for start, stop in [(0, first)] + [(s, s + rows) for s in range(first, info.shape[0], rows)]:
            yield np.ascontiguousarray(reader.get_slice(key, np.s_[start:stop])).reshape(-1)
        return
    flat = reader.get_tensor(key).reshape(-1)  # small, or a format that reads whole tensors only
    first = flat.size % elements or elements
    for lo, hi in [(0, min(first, flat.size))] + [(s, s + elements) for s in range(first, flat.size, elements)]:
        yield flat[lo:hi]


def _aligned(a: Iterator[np.ndarray], b: Iterator[np.ndarray]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Pair the elements of two streams of flat chunks cut at different places, piece by piece
    (each stream moves on only once its chunk is used up: chunks are reused buffers)."""
    ca: np.ndarray | None = np.empty(0)
    cb: np.ndarray | None = np.empty(0)
    ia = ib = 0
    while True:
        if ca is not None and ia == ca.size:
            ca, ia = next(a, None), 0
        if cb is not None and ib == cb.size:
            cb, ib = next(b, None), 0
        if ca is None or cb is None:
            if ca is not None or cb is not None:  # the callers compare sizes first
                raise AssertionError("two tensors of different sizes were paired")
            return
        n = min(ca.size - ia, cb.size - ib)
        yield ca[ia:ia + n], cb[ib:ib + n]
        ia, ib = ia + n, ib + n


def paired_chunks(ra: CheckpointReader, rb: CheckpointReader, key: str, key_b: str | None = None, *,
                  chunk_bytes: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield matching flat chunks (the same elements) of tensor ``key`` of two checkpoints
    (``key_b`` in the second, if it is called otherwise there).

    Both tensors are read to their end, so each one's checksum is checked. ``chunk_bytes``:
    about this many bytes of the wider tensor per read (None: CHUNK_BYTES).
    """
    key_b = key if key_b is None else key_b
    ia, ib = ra.tensors[key], rb.tensors[key_b]
    if ia.size != ib.size:
        raise ValueError(f"tensor {key!r} has {ia.size} elements in {ra.path}, {ib.size} in {rb.path}")
    elements = chunk_elements(ia.dtype.itemsize, ib.dtype.itemsize, chunk_bytes=chunk_bytes)
    yield from _aligned(tensor_chunks(ra, key, elements), tensor_chunks(rb, key_b, elements))


def aligned_chunks(readers: list[CheckpointReader], key: str, *,
                   chunk_bytes: int | None = None) -> Iterator[list[np.ndarray]]:
    """Yield lists of matching flat chunks (the same elements) of tensor ``key`` of every reader.

    Each stream moves on only once its chunk is used up (chunks are reused buffers); every
    tensor is read to its end, so each one's checksum is checked. The sizes must be equal.
    ``chunk_bytes``: about this many bytes of the widest tensor per read (None: CHUNK_BYTES).
    """
    sizes = {r.tensors[key].size for r in readers}
    if len(sizes) != 1:
        raise ValueError(f"tensor {key!r} has different sizes in {', '.join(r.path for r in readers)}")
    elements = chunk_elements(*(r.tensors[key].dtype.itemsize for r in readers), chunk_bytes=chunk_bytes)
    streams = [tensor_chunks(r, key, elements) for r in readers]
    current: list[np.ndarray | None] = [np.empty(0) for _ in readers]
    used = [0] * len(readers)
    while True:
        for i, stream in enumerate(streams):
            chunk = current[i]
            if chunk is not None and used[i] == chunk.size:
                current[i], used[i] = next(stream, None), 0
        if any(c is None for c in current):
            if not all(c is None for c in current):
                raise AssertionError("tensors of equal sizes streamed different numbers of elements")
            return
        n = min(c.size - u for c, u in zip(current, used) if c is not None)
        yield [c[u:u + n] for c, u in zip(current, used) if c is not None]
        used = [u + n for u in used]
