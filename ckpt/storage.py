"""The storage layer: the one interface between checkpoint formats and the bytes.

A format never touches a file descriptor or an object store itself: it reads a
:class:`ReadableBlob` (one file, or one object), which a local file
(``ckpt.formats._io.LocalFile``: ``preadv`` runs, a checksum thread pool) and an object in a
store (``ckpt._remote.RemoteFile``: concurrent ranged GETs) both implement, and it writes a
:class:`WritableBlob` (``ckpt.formats._io.LocalSink``: ``pwrite``/``pwritev``). A new kind of
storage (per-rank shard files, another object store) is a new implementation of these
Protocols; no format module changes.

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

__all__ = ["ReadableBlob", "WritableBlob", "Span", "Bytes"]

#: ``(offset in the blob, buffer to fill)``: one range of a multi-range read.
Span = tuple[int, memoryview]
#: What a write takes: bytes, or a flat byte view of an array (never copied on the way).
Bytes = bytes | bytearray | memoryview


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


@runtime_checkable
class WritableBlob(Protocol):
    """One blob being written (a new file, a new object): positioned writes of caller buffers.

    The order of writes is a contract, so that an object store can upload a blob in parts
    while it is written (without a local copy): **the head** is every byte before the end of
    the blob's first write; writes into the head may come at any time (a header reserved at
    the start and filled in last: hdf5's user block, safetensors' header, msgpack's element
    count), while every write past the head starts at or after the end of the write before
    it. Bytes never written (gaps between writes) read as zeros. ckpt's writers keep to this.

    Example:
        >>> import os, pathlib, tempfile
        >>> from ckpt.formats._io import LocalSink
        >>> path = os.path.join(tempfile.mkdtemp(), "blob")
        >>> with LocalSink(path) as out:
        ...     out.write_pieces([b"body ", b"text"], 4)  # the first write: bytes 0-3 are the head
        ...     out.write_at(b"HEAD", 0)  # filled in last
        ...     out.size
        13
        >>> pathlib.Path(path).read_bytes()
        b'HEADbody text'
    """

    @property
    def name(self) -> str:
        """The path or URL, as error messages show it."""

    @property
    def size(self) -> int:
        """The end of the furthest byte written so far."""

    def write_at(self, data: Bytes, offset: int) -> None:
        """Write all of ``data`` at ``offset`` (OSError when the storage fails: a full disk)."""

    def write_pieces(self, pieces: Sequence[Bytes], offset: int) -> None:
        """Write ``pieces`` back to back from ``offset`` without joining them into one copy."""

    def close(self) -> None:
        """Finish the blob: everything written is in the storage once this returns."""
