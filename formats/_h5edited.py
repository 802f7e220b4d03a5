"""ckpt HDF5 files that an HDF5 tool rewrote after ckpt saved them (h5repack, h5py edits that grew them).

Such a file keeps ckpt's user block, but its index no longer says where anything is: the
tensors moved, the file's size changed. What h5py sees is read through h5py, as a foreign
file is (a child process reads it with libhdf5 first), and every tensor is still checked
against what ckpt's index recorded for its key: the same dtype and shape (checked on open)
and the same crc32c (checked on each read). A dataset the index does not know (added after
the save) is refused when read: nothing could check its bytes. ``rewritten`` tells such a file
from a truncated or extended one by the end of file HDF5's superblock records.

Example:
    >>> import h5py, numpy as np, os, tempfile
    >>> from ckpt.formats.builtin import Hdf5Format
    >>> path = os.path.join(tempfile.mkdtemp(), "m.h5")
    >>> Hdf5Format().write(path, [("a", np.ones(2)), ("opt/m", np.zeros(3))], {})
    >>> with h5py.File(path, "r+") as f:
    ...     f["b"] = np.arange(3.0)  # the file grows: libhdf5 rewrote part of it
    >>> with Hdf5Format().open(path) as r:
    ...     type(r).__name__, r.read("a")
    ('RewrittenReader', array([1., 1.]))
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from ckpt import dtypes
from ckpt.errors import CorruptCheckpointError, checksum_error
from ckpt.storage import ReadableBlob

from . import _io, h5plain
from ._codec import encode_strings
from .base import TensorInfo

#: Where a superblock's end-of-file address lies, by superblock version (HDF5 file format spec).
_EOF_AT = {0: 40, 1: 44, 2: 28, 3: 28}


def rewritten(source: ReadableBlob, userblock: int, size: int) -> bool:
    """True when the HDF5 superblock after the user block records this file's size as its end.

    libhdf5 writes the end of file when it closes a file it changed, so a file an HDF5 tool
    rewrote or extended records its new size; a truncated file, or one with bytes appended,
    still records the size ckpt wrote.
    """
    if size < userblock + 64:
        return False
    head = _io.pread(source, userblock, 64, "the HDF5 superblock")
    at = _EOF_AT.get(head[8]) if head.startswith(b"\x89HDF\r\n\x1a\n") else None
    return at is not None and struct.unpack_from("<Q", head, at)[0] == size


class RewrittenReader(h5plain.H5pyReader):
    """A ckpt HDF5 file an HDF5 tool rewrote, read through h5py; every tensor is checked
    against ckpt's index (dtype and shape on open, crc32c on read)."""

    checksummed = True
    _refuses_ckpt_marks = False  # ckpt's index was found and checked: the marks are expected

    def __init__(self, path: str, index: Mapping[str, TensorInfo], metadata: dict[str, Any]) -> None:
        self._index = index
        super().__init__(path)
        try:
            self._check_against_index(metadata)
        except BaseException:
            self.close()
            raise

    def _check_against_index(self, metadata: dict[str, Any]) -> None:
        """Refuse what h5py sees when it contradicts the index: a tensor's dtype or shape, the metadata."""
        for key, info in self._tensors.items():
            known = self._index.get(key)
            if known is not None and (known.dtype != info.dtype or known.shape != info.shape):
                raise CorruptCheckpointError(
                    f"{self.path}: tensor {key!r} is {dtypes.dtype_name(info.dtype)} {list(info.shape)} in the "
                    f"HDF5 structure but ckpt saved {dtypes.dtype_name(known.dtype)} {list(known.shape)}: the file "
                    "was changed or damaged after ckpt saved it")
        if self._metadata != metadata:
            raise CorruptCheckpointError(f"{self.path}: the ckpt_metadata attribute differs from the metadata "
                                         "ckpt saved: the file was changed or damaged after ckpt saved it")

    def _read_into(self, info: TensorInfo, out: np.ndarray) -> None:
        known = self._index.get(info.key)
        if known is None:
            raise CorruptCheckpointError(
                f"{self.path}: tensor {info.key!r} was added after ckpt saved this file (its index does not "
                "know it), so nothing can check its bytes")
        super()._read_into(info, out)
        raw = encode_strings(out)[0] if dtypes.is_string(info.dtype) else out
        crc = _io.crc32c(_io.byte_view(raw))
        if crc != known.extra.crc32c:
            raise checksum_error(self.path, f"tensor {info.key!r}", crc, known.extra.crc32c, key=info.key,
                                 cause="its value changed after ckpt saved the file, or the file is damaged")
