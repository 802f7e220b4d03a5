"""The formats' byte helpers: views of arrays as bytes (no copies), ``Runs`` that gather a
writer's small pieces into one ``write_pieces`` call, and the storage layer's blob helpers the
formats use, imported from ``ckpt.storage`` (local files, exact reads, checksums, the I/O
workers) so that a format module has one place to take them from.

Tensors move as ``memoryview``s of the arrays that hold them: nothing here copies a tensor.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import numpy as np

from ckpt.checksums import crc32c as crc32c
from ckpt.storage import Bytes, WritableBlob
from ckpt.storage.blobio import CHUNK as CHUNK
from ckpt.storage.blobio import RangeFile as RangeFile
from ckpt.storage.blobio import checksum_range as checksum_range
from ckpt.storage.blobio import pread as pread
from ckpt.storage.blobio import stream as stream
from ckpt.storage.localfile import LocalFile as LocalFile
from ckpt.storage.localfile import LocalSink as LocalSink
from ckpt.storage.workers import BIG as BIG
from ckpt.storage.workers import checksum_async as checksum_async
from ckpt.storage.workers import side_by_side as side_by_side
from ckpt.storage.workers import steal, submit
from ckpt.storage.workers import workers as workers

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("ckpt's file formats are implemented for little-endian hosts only")


def c_contiguous(arr: np.ndarray) -> np.ndarray:
    """``arr`` itself when C-contiguous, else a C-ordered copy (unlike np.ascontiguousarray, keeps 0-d)."""
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def byte_view(arr: np.ndarray) -> memoryview:
    """A flat, writable-if-possible byte view of a C-contiguous array (0-d and empty included)."""
    if not arr.dtype.hasobject:  # an object array's buffer holds pointers: numpy's view refuses it below
        try:
            return arr.data.cast("B")  # the fast path: 3x cheaper than going through numpy views
        except (ValueError, TypeError):  # no buffer (ml_dtypes' bfloat16, float8), or an empty array
            pass
    return arr.reshape(-1).view(np.uint8).data


#: Bounds on the small pieces one ``write_pieces`` call (one pwritev) writes.
RUN_PIECES, RUN_BYTES = 512, 8 << 20


class Runs:
    """Writes a blob front to back for a format: small pieces that follow each other are
    gathered into runs written by one ``write_pieces`` call, big ones (BIG and up) alone.

    A run holds its pieces (and so their arrays) until it is written: call ``flush()`` before
    reading a lazy source, so a conversion holds one tensor at a time, and at the end.

    ``lent=True`` says ``data`` is a view of an array the writer's caller handed in, alive and
    unchanged until the blob is finished: it goes to ``blob.lend_pieces``, and a blob that can
    (an S3 upload sent as one PUT) keeps a reference to it instead of a copy. A run goes to
    ``lend_pieces`` when every piece in it was lent or is an immutable ``bytes`` object.
    """

    __slots__ = ("_end", "_lendable", "_run", "_start", "blob")

    def __init__(self, blob: WritableBlob) -> None:
        self.blob = blob
        self._run: list[Bytes] = []
        self._start = self._end = 0
        self._lendable = True  # every piece of the pending run was lent or is bytes

    def write(self, data: Bytes, offset: int, lent: bool = False) -> None:
        """Write ``data`` at ``offset`` now or with its run (empty data writes nothing)."""
        n = len(data)
        run = self._run
        if run and (offset != self._end or len(run) >= RUN_PIECES or self._end - self._start + n > RUN_BYTES
                    or n >= BIG):
            self.flush()
            run = self._run
        if n >= BIG:
            if lent:
                self.blob.lend_pieces([data], offset)
            else:
                self.blob.write_at(data, offset)
        elif n:
            if not run:
                self._start = offset
            run.append(data)
            self._end = offset + n
            if not lent and type(data) is not bytes:
                self._lendable = False

    def flush(self) -> None:
        """Write the pending run."""
        if self._run:
            run, self._run = self._run, []
            lendable, self._lendable = self._lendable, True
            if lendable:
                self.blob.lend_pieces(run, self._start)
            else:
                self.blob.write_pieces(run, self._start)


def crc32c_each(pieces: Sequence[memoryview], known: Sequence[int | None]) -> list[int]:
    """The crc32c of each piece, computed where ``known`` has None (a job for an I/O worker)."""
    return [crc32c(piece) if crc is None else crc for piece, crc in zip(pieces, known)]


def write_checked(blob: WritableBlob, view: memoryview, offset: int, update: Callable[[memoryview], object]) -> None:
    """Write a streamed chunk at ``offset`` while ``update`` (its running checksum) takes it in on
    an I/O worker: the kernel's copy and crc32c release the GIL, so with a core free the checksum
    costs no wall time. Both are done when this returns (the caller reuses the chunk's buffer)."""
    if len(view) < BIG:
        blob.write_at(view, offset)
        update(view)
        return

    def checksum() -> int:
        update(view)
        return len(view)

    piece = submit(checksum)
    try:
        blob.write_at(view, offset)
    finally:
        steal(piece)  # still queued behind other pieces (a busy machine): this thread checksums it now
        piece.job.exception()  # done with the buffer, whether or not the write failed
    piece.job.result()


def expected_nbytes(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of a numeric tensor, computed with Python ints so hostile shapes cannot overflow."""
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n
