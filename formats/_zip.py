"""Zip archives as containers (PyTorch's torch.save files, Keras's .keras files).

Members are read in place: a stored (uncompressed) member is a byte range of the archive,
so tensors are read straight into the caller's buffer and checked against the member's
CRC-32. Compressed members are refused; both frameworks store their data uncompressed.
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from typing import TYPE_CHECKING, Any

from ckpt.errors import CorruptCheckpointError, UnsupportedCheckpointError

from . import _io

if TYPE_CHECKING:
    import zipfile

ZIP_MAGIC = b"PK\x03\x04"
_LOCAL_HEADER = struct.Struct("<4s5H3I2H")  # signature ... name length, extra length


def open_archive(file: Any, path: str) -> zipfile.ZipFile:
    """Read a zip's central directory, turning zipfile's many exceptions into one."""
    import zipfile  # imported on first use: it is not needed to import ckpt

    try:
        return zipfile.ZipFile(file)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, struct.error, NotImplementedError,
            OverflowError, KeyError) as exc:
        raise CorruptCheckpointError(f"{path}: not a readable zip archive ({exc})") from exc


def first_member_name(head: bytes) -> str | None:
    """The name in the first local header of a zip that starts with ``head``, or None."""
    if len(head) < _LOCAL_HEADER.size or not head.startswith(ZIP_MAGIC):
        return None
    name_len = _LOCAL_HEADER.unpack_from(head)[9]
    raw = head[_LOCAL_HEADER.size:_LOCAL_HEADER.size + name_len]
    return raw.decode("utf-8", "replace") if len(raw) == name_len else None


def member_span(fd: int, info: zipfile.ZipInfo, path: str) -> tuple[int, int]:
    """(offset, size) of a stored member's bytes in the archive, checked against the file size."""
    if info.flag_bits & 1:
        raise UnsupportedCheckpointError(f"{path}: zip member {info.filename!r} is encrypted")
    if info.compress_type != 0:  # ZIP_STORED
        raise UnsupportedCheckpointError(
            f"{path}: zip member {info.filename!r} is compressed (method {info.compress_type}); "
            "ckpt reads members stored uncompressed, as the framework writes them")
    size = _io.file_size(fd)
    if info.header_offset + _LOCAL_HEADER.size > size:
        raise CorruptCheckpointError(f"{path}: zip member {info.filename!r} starts beyond the end of "
                                     "the file: it is truncated")
    fields = _LOCAL_HEADER.unpack(_io.pread(fd, info.header_offset, _LOCAL_HEADER.size, path,
                                            f"the zip header of {info.filename!r}"))
    if fields[0] != ZIP_MAGIC:
        raise CorruptCheckpointError(f"{path}: zip member {info.filename!r} has no local header at "
                                     f"offset {info.header_offset}: the archive is damaged")
    start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
    if info.file_size != info.compress_size or start + info.file_size > size:
        raise CorruptCheckpointError(
            f"{path}: zip member {info.filename!r} needs {info.file_size} bytes at offset {start} of a "
            f"{size}-byte file: it is truncated or damaged")
    return start, info.file_size


def crc32(data: Any, value: int = 0) -> int:
    """zlib's CRC-32 (the checksum zip stores per member)."""
    return zlib.crc32(data, value)


def crc32_range(fd: int, offset: int, size: int, path: str, what: str) -> int:
    """CRC-32 of a byte range of the file, read in bounded chunks."""
    buf = memoryview(bytearray(min(size, _io.CHUNK)))
    value = done = 0
    while done < size:
        n = min(len(buf), size - done)
        _io.pread_into(fd, buf[:n], offset + done, path, what)
        value = zlib.crc32(buf[:n], value)
        done += n
    return value


class MemberFile(io.RawIOBase):
    """A read-only, seekable file over one stored member (what h5py needs to open it in place)."""

    def __init__(self, fd: int, start: int, size: int) -> None:
        super().__init__()
        self._fd, self._start, self._size, self._pos = fd, start, size, 0

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
        done = 0
        while done < n:
            got = os.preadv(self._fd, [view[done:n]], self._start + self._pos + done)
            if got == 0:
                break
            done += got
        self._pos += done
        return done
