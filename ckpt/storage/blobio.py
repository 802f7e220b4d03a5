"""Helpers that read any :class:`ckpt.storage.ReadableBlob`: exact reads, checksums of a range
read in bounded chunks, and file objects over a range for parsers that want one (zipfile, h5py,
pickle streams).

Example:
    >>> import os, tempfile
    >>> from ckpt.storage.localfile import LocalFile
    >>> path = os.path.join(tempfile.mkdtemp(), "f")
    >>> with open(path, "wb") as f:
    ...     _ = f.write(bytes(range(10)))
    >>> with LocalFile(path) as blob:
    ...     pread(blob, 2, 3, "three bytes"), stream(blob).read(2)
    (b'\\x02\\x03\\x04', b'\\x00\\x01')
"""

from __future__ import annotations

import io
import os
from typing import Any
from collections.abc import Callable

from ckpt.checksums import crc32c, crc32c_combine
from ckpt.storage import ReadableBlob

__all__ = ["CHUNK", "WINDOW", "RangeFile", "checksum_range", "pread", "read_checked", "stream"]

#: Granularity of streamed checksums and of verification reads (bounded memory).
CHUNK = 2 << 20
#: Bytes of a long crc32c range read (and checksummed side by side) at a time: ``checksum_range``.
WINDOW = 8 << 20


def pread(source: ReadableBlob, offset: int, size: int, what: str) -> bytes:
    """Read exactly ``size`` bytes at ``offset`` (callers bound ``size`` by the blob's size)."""
    buf = bytearray(size)
    source.read_into(memoryview(buf), offset, what)
    return bytes(buf)


def read_checked(source: ReadableBlob, view: memoryview, offset: int, what: str) -> int:
    """Fill ``view`` from ``offset`` and return its crc32c, each chunk checksummed while it is
    still in this core's cache."""
    crc = 0
    for start in range(0, len(view), CHUNK):
        chunk = view[start:start + CHUNK]
        source.read_into(chunk, offset + start, what)
        crc = crc32c(chunk, crc)
    return crc


def checksum_range(source: ReadableBlob, offset: int, size: int, what: str, value: int = 0,
                   checksum: Callable[[Any, int], int] = crc32c, window: int = WINDOW) -> int:
    """The checksum (crc32c unless told) of ``size`` bytes of ``source`` at ``offset``, read in
    bounded chunks.

    A crc32c of ``window`` bytes or more is read a window at a time through the blob's
    ``read_spans``, which reads and checksums a big span in pieces side by side (a local file:
    on the I/O workers), so a verification uses both cores; memory holds one window.
    """
    if checksum is not crc32c or size < window:
        return _checksum_chunks(source, offset, size, what, value, checksum)
    from ckpt.buffers import aligned_empty  # lazy (numpy): storage's other helpers need none

    buf = aligned_empty((window,), "uint8").data  # uninitialized, and page-aligned as the data's file offsets
    done = 0
    while done < size:
        view = buf[:min(window, size - done)]
        got = source.read_spans([(offset + done, view)], lambda i: what)[0]
        value = crc32c_combine(value, got, len(view))  # crc32c(what came before + this window)
        done += len(view)
    return value


def _checksum_chunks(source: ReadableBlob, offset: int, size: int, what: str, value: int,
                     checksum: Callable[[Any, int], int]) -> int:
    buf = memoryview(bytearray(min(size, CHUNK)))
    done = 0
    while done < size:
        n = min(len(buf), size - done)
        source.read_into(buf[:n], offset + done, what)
        value = checksum(buf[:n], value)
        done += n
    return value


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over ``size`` bytes of ``source`` from ``start``: for parsers
    that want a file object (zipfile, h5py, pickle streams). Closing it leaves ``source`` open."""

    def __init__(self, source: ReadableBlob, start: int, size: int) -> None:
        super().__init__()
        self._source, self._start, self._size, self._pos = source, start, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._size - self._pos))
        self._source.read_into(view[:n], self._start + self._pos, "the file")
        self._pos += n
        return n


def stream(source: ReadableBlob) -> io.BufferedReader:
    """A buffered file object over the whole of ``source`` (small sequential reads are cheap)."""
    return io.BufferedReader(RangeFile(source, 0, source.size))
