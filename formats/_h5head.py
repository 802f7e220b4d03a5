"""What an HDF5 file's first bytes say: ckpt's own HDF5 files versus HDF5 files other programs wrote.

Shared by the formats that read HDF5 (hdf5.py for ckpt's own files, h5plain.py and keras.py for
foreign ones) so that each recognises the same files the same way without importing another.
ckpt's HDF5 files start with ckpt's header (``MAGIC``) in the HDF5 user block; any other file
with HDF5's signature is *foreign*: it carries no checksums and libhdf5 reads it, at the user's
own risk (formats/_h5child.py reads it in a child process first).

Example:
    >>> from ckpt.formats import _h5head
    >>> _h5head.foreign_hdf5(b"\\x89HDF\\r\\n\\x1a\\n" + bytes(100)), _h5head.foreign_hdf5(_h5head.MAGIC)
    (True, False)
"""

from __future__ import annotations

import struct

from ckpt.errors import CorruptCheckpointError
from ckpt.storage import ReadableBlob

from . import _io

#: The name in a ckpt HDF5 file's ``ckpt_format`` attribute.
FORMAT_NAME = "ckpt-hdf5"
MAGIC = b"\x89CKPTH5\n"
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
#: The dataset name of a tensor whose key is also a scope: "dense/kernel" beside "dense/kernel/Adam"
#: is the dataset "dense/kernel/__ckpt_tensor__" in the group "dense/kernel" (HDF5 has no node that
#: is both a group and a dataset). HDF5 files refuse keys whose last part is this name.
SCOPE_TENSOR = "__ckpt_tensor__"
#: magic, layout version, user block size, index length, index crc32c, crc32c of the preceding 28 bytes
HEADER = struct.Struct("<8sIIQII")
#: Bytes only ckpt writes into an HDF5 file (its attribute names and format name).
MARKS = (FORMAT_NAME.encode(), b"ckpt_format", b"ckpt_version", b"ckpt_metadata", b"ckpt_dtype", b"ckpt_lengths")
#: How much of a file's start is searched for MARKS (a small file's whole HDF5 structure).
MARK_WINDOW = 1 << 16


def damaged_magic(head: bytes) -> bool:
    """A ckpt header whose checksum holds once the expected magic is put back."""
    return len(head) >= HEADER.size and head[:8] != MAGIC and \
        _io.crc32c(MAGIC + head[8:28]) == int.from_bytes(head[28:32], "little")


def ckpt_head(head: bytes) -> bool:
    """True when ``head`` starts with ckpt's HDF5 header, intact or with damaged magic bytes."""
    return head.startswith(MAGIC) or damaged_magic(head)


def hdf5_signature(head: bytes) -> bool:
    """True when HDF5's signature is where libhdf5 looks for it: at 0, 512, 1024, 2048, ..."""
    offset = 0
    while offset + 8 <= len(head):
        if head[offset:offset + 8] == HDF5_SIGNATURE:
            return True
        offset = 512 if offset == 0 else offset * 2
    return False


def foreign_hdf5(head: bytes) -> bool:
    """True for an HDF5 file ckpt's header does not start: one libhdf5 has to read."""
    return hdf5_signature(head) and not ckpt_head(head)


def refuse_damaged_ckpt_file(f: ReadableBlob) -> None:
    """Raise CorruptCheckpointError for a ckpt HDF5 file whose header is damaged, so that its
    bytes never reach libhdf5: its magic is damaged, or its user block is there but holds no
    ckpt header while ckpt's marks (``MARKS``) show. A file rewritten without a user block
    (an h5py copy) lost nothing by damage and passes. Searched: the start of the user
    block and of the HDF5 structure after it.
    """
    path, size = f.name, f.size
    if damaged_magic(_io.pread(f, 0, min(size, HEADER.size), "the header")):
        raise CorruptCheckpointError(f"{path}: the ckpt header's magic bytes are damaged")
    offset = 512  # HDF5's signature sits at 0 or at a user block's end: 512, 1024, 2048, ...
    while offset + 8 <= size and _io.pread(f, offset, 8, "the HDF5 signature") != HDF5_SIGNATURE:
        offset *= 2
    if offset + 8 > size or _io.pread(f, 0, 8, "the HDF5 signature") == HDF5_SIGNATURE:
        return
    for start in (0, offset):
        window = _io.pread(f, start, min(MARK_WINDOW, size - start), "the user block")
        for mark in MARKS:
            if mark in window:  # ckpt wrote it and its index is gone: never an unchecksummed foreign file
                raise CorruptCheckpointError(
                    f"{path}: ckpt wrote this HDF5 file ({mark.decode()!r} at byte {start + window.index(mark)}) "
                    "but its user block holds no valid ckpt header: the index is damaged, so no value can be "
                    "checked")
