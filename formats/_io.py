"""Low-level file I/O shared by the built-in formats: positioned reads into existing buffers,
writes of existing buffers, and crc32c checksums computed on the same bytes.

Tensors move as ``memoryview``s of the arrays that hold them: nothing here copies a tensor.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from ckpt.errors import CorruptCheckpointError

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("ckpt's file formats are implemented for little-endian hosts only")

#: Granularity of streamed checksums and of verification reads (bounded memory).
CHUNK = 8 << 20

_crc32c: Any = None


def crc32c(data: Any, value: int = 0) -> int:
    """Return the crc32c of ``data`` (a bytes-like object), continuing from ``value``."""
    global _crc32c
    if _crc32c is None:
        import crc32c as module  # imported on first use: it costs ~30 ms at import time

        _crc32c = module.crc32c
    return int(_crc32c(data, value))


def c_contiguous(arr: np.ndarray) -> np.ndarray:
    """``arr`` itself when C-contiguous, else a C-ordered copy (unlike np.ascontiguousarray, keeps 0-d)."""
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def byte_view(arr: np.ndarray) -> memoryview:
    """A flat, writable-if-possible byte view of a C-contiguous array (0-d and empty included)."""
    return memoryview(arr.reshape(-1).view(np.uint8))


def pread_into(fd: int, view: memoryview, offset: int, path: str, what: str) -> None:
    """Fill ``view`` from ``fd`` at ``offset``; a short file is a CorruptCheckpointError."""
    done, total = 0, len(view)
    while done < total:
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            raise CorruptCheckpointError(f"{path}: cannot read {what}: {exc.strerror or exc}") from exc
        if n == 0:
            raise CorruptCheckpointError(
                f"{path}: file ends in the middle of {what} (offset {offset + done}): it is truncated")
        done += n


def pread(fd: int, offset: int, size: int, path: str, what: str) -> bytes:
    """Read exactly ``size`` bytes at ``offset`` (callers bound ``size`` by the file size)."""
    buf = bytearray(size)
    pread_into(fd, memoryview(buf), offset, path, what)
    return bytes(buf)


def checksum_range(fd: int, offset: int, size: int, path: str, what: str, value: int = 0) -> int:
    """crc32c of ``size`` bytes of the file at ``offset``, read in bounded chunks."""
    buf = memoryview(bytearray(min(size, CHUNK)))
    done = 0
    while done < size:
        n = min(len(buf), size - done)
        pread_into(fd, buf[:n], offset + done, path, what)
        value = crc32c(buf[:n], value)
        done += n
    return value


def write_all(fd: int, data: Any) -> None:
    """Write every byte of ``data`` at the file's current position."""
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write every byte of ``data`` at ``offset``."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def file_size(fd: int) -> int:
    return os.fstat(fd).st_size


def expected_nbytes(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of a numeric tensor, computed with Python ints so hostile shapes cannot overflow."""
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n
