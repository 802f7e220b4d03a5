"""The storage layer: the one interface between checkpoint formats and the bytes they read.

A format never touches a file descriptor or an object store itself: it reads a
:class:`ReadableBlob` (one file, or one object), which a local file
(``ckpt.formats._io.LocalFile``: ``preadv`` runs, a checksum thread pool) and an object in a
store (``ckpt._remote.RemoteFile``: concurrent ranged GETs) both implement. A new kind of
storage (per-rank shard files, another object store) is a new implementation of this
Protocol; no format module changes.

Every method raises :class:`ckpt.CorruptCheckpointError` naming the blob (``name``) and
``what`` was being read when the bytes are not there (a truncated file, EIO, a short object).

Example:
    >>> import os, tempfile
    >>> from ckpt.storage import ReadableBlob
    >>> from ckpt.formats._io import LocalFile
    >>> path = os.path.join(tempfile.mkdtemp(), "blob")
    >>> with open(path, "wb") as f:
    ...     _ = f.write(b"hello, world")
    >>> blob = LocalFile(path)
    >>> isinstance(blob, ReadableBlob), blob.size
    (True, 12)
    >>> buf = bytearray(5)
    >>> blob.read_into(memoryview(buf), 7, "a word")
    >>> bytes(buf)
    b'world'
    >>> blob.close()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

__all__ = ["ReadableBlob", "Span"]

#: ``(offset in the blob, buffer to fill)``: one range of a multi-range read.
Span = tuple[int, memoryview]


@runtime_checkable
class ReadableBlob(Protocol):
    """One readable blob of bytes (a file, an object): positioned reads into caller buffers.

    Implementations read straight into the given buffers (no copy of a tensor is made on the
    way) and may read several ranges concurrently. ``read_spans`` also returns each span's
    crc32c, which an implementation computes while the bytes are still in cache (or in
    parallel): formats compare it with the checksum they stored.
    """

    @property
    def name(self) -> str:
        """The path or URL, as error messages show it."""

    @property
    def size(self) -> int:
        """The blob's size in bytes, now."""

    def read_into(self, view: memoryview, offset: int, what: str) -> None:
        """Fill ``view`` (a flat byte view) with the bytes at ``offset``.

        Raises:
            CorruptCheckpointError: fewer bytes than ``len(view)`` are there, or the read
                failed; the message names the blob and ``what``.
        """

    def read_spans(self, spans: Sequence[Span], name: Callable[[int], str]) -> list[int]:
        """Fill each ``(offset, view)`` of ``spans`` and return the views' crc32c values.

        Spans may come in any order and may be read in any order or at once; ``name(i)``
        labels span ``i`` in errors ("tensor 'w'"). No buffer is written once this returns
        or raises.
        """

    def close(self) -> None:
        """Release what the blob holds (descriptors, caches); reading after this is an error."""
