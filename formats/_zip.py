"""Zip archives as containers (PyTorch's torch.save files, Keras's .keras files).

Members are read in place: a stored (uncompressed) member is a byte range of the archive,
so tensors are read straight into the caller's buffer and checked against the member's
CRC-32 (a member h5py must open is handed over as an ``_io.RangeFile``). Compressed members
are refused; both frameworks store their data uncompressed.
"""

from __future__ import annotations

import struct
import zlib
from typing import TYPE_CHECKING, Any

from ckpt.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckpt.storage import ReadableBlob

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


def member_span(source: ReadableBlob, info: zipfile.ZipInfo) -> tuple[int, int]:
    """(offset, size) of a stored member's bytes in the archive, checked against the file size."""
    path = source.name
    if info.flag_bits & 1:
        raise UnsupportedCheckpointError(f"{path}: zip member {info.filename!r} is encrypted")
    if info.compress_type != 0:  # ZIP_STORED
        raise UnsupportedCheckpointError(
            f"{path}: zip member {info.filename!r} is compressed (method {info.compress_type}); "
            "ckpt reads members stored uncompressed, as the framework writes them")
    size = source.size
    if info.header_offset + _LOCAL_HEADER.size > size:
        raise CorruptCheckpointError(f"{path}: zip member {info.filename!r} starts beyond the end of "
                                     "the file: it is truncated")
    fields = _LOCAL_HEADER.unpack(_io.pread(source, info.header_offset, _LOCAL_HEADER.size,
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


def crc32_range(source: ReadableBlob, offset: int, size: int, what: str) -> int:
    """CRC-32 of a byte range of the archive, read in bounded chunks."""
    return _io.checksum_range(source, offset, size, what, checksum=zlib.crc32)
