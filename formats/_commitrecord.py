"""A sharded checkpoint's commit record as one object: :class:`CommitRecord` (its files and one
:class:`TensorEntry` per tensor, with named fields), built by both sharded writers (a
``Saver(comm=)`` save, ``ckpt convert --shards``) and parsed by the reader, through
``to_bytes``/``from_bytes`` (docs/formats.md, "Sharded checkpoints", gives the bytes).

Example:
    >>> record = CommitRecord(step=3, metadata={}, block_bytes=1 << 20, ranks=1,
    ...                       files=[("0123456789abcdef.00000-of-00001.msgpack", 100)],
    ...                       tensors={"w": TensorEntry("float32", [2])})
    >>> record.tensors["w"].add(0, (0,), (2,), 8, [7])
    >>> back = CommitRecord.from_bytes(record.to_bytes(), "COMMIT")
    >>> back.step, back.tensors["w"].files, back.tensors["w"].crcs
    (3, [0], [7])
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ckpt.errors import CorruptCheckpointError, checksum_error

from . import _io
from ._codec import packb, unpack
from ._validation import check_version
from .msgpack import _FOOTER, FOOTER_SIZE

__all__ = ["CommitRecord", "TensorEntry", "FORMAT_NAME", "VERSION", "HEADER", "FOOTER_MAGIC"]

FORMAT_NAME = "ckpt-commit"
VERSION = 2
_HEADER_PREFIX = b"\x82\xa6format\xab" + FORMAT_NAME.encode() + b"\xa7version"  # plain msgpack
#: A fixarray of 3 (header, record, footer) and the header map: one object for msgpack.unpackb.
HEADER = b"\x93" + _HEADER_PREFIX + bytes([VERSION])
FOOTER_MAGIC = b"ckpt-cmt"


@dataclass
class TensorEntry:
    """One tensor's saved blocks, flat as the record stores them: block i is in file
    ``files[i]``, at ``offsets[i*ndim:(i+1)*ndim]`` with shape ``shapes[...]``, ``nbytes[i]``
    bytes; ``crcs`` lists every block's checksums of ``block_bytes`` each (None for strings).
    The reader validates these values (``ckpt_sharded._parse``); here they are as stored."""

    dtype: Any
    shape: Any
    files: Any = field(default_factory=list)
    offsets: Any = field(default_factory=list)
    shapes: Any = field(default_factory=list)
    nbytes: Any = field(default_factory=list)
    crcs: Any = field(default_factory=list)

    def add(self, file: int, offset: Iterable[int], shape: Iterable[int], nbytes: int,
            crcs: Iterable[int] | None) -> None:
        """Append one block (its checksums ignored for a string tensor, whose ``crcs`` is None)."""
        self.files.append(file)
        self.offsets.extend(offset)
        self.shapes.extend(shape)
        self.nbytes.append(nbytes)
        if self.crcs is not None:
            self.crcs.extend(crcs or [])

    def to_list(self) -> list[Any]:
        return [self.dtype, self.shape, self.files, self.offsets, self.shapes, self.nbytes, self.crcs]


@dataclass
class CommitRecord:
    """A sharded checkpoint's commit record: its step, metadata, checksum block size, the number
    of ranks that wrote it, its files ``(name, size)`` and its tensors."""

    step: Any
    metadata: Any
    block_bytes: Any
    ranks: Any
    files: Any
    tensors: dict[str, TensorEntry]

    def to_bytes(self) -> bytes:
        """The bytes of a ``COMMIT`` holding this record."""
        body = packb({"format": FORMAT_NAME, "version": VERSION, "step": self.step, "metadata": self.metadata,
                      "block_bytes": self.block_bytes, "ranks": self.ranks,
                      "files": [list(f) for f in self.files],
                      "tensors": {key: entry.to_list() for key, entry in self.tensors.items()}})
        footer = _FOOTER.pack(0x94, b"\xc4\x08", FOOTER_MAGIC, 0xCF, len(HEADER), 0xCF, len(body), 0xCE,
                              _io.crc32c(body))
        return HEADER + body + footer

    @classmethod
    def from_bytes(cls, raw: bytes, path: str) -> CommitRecord:
        """Parse a ``COMMIT`` (``path`` names it in errors): its header, footer, checksum and the
        record's shape (a list of files, a map of 7-field tensor entries); the values inside are
        as stored.

        Raises:
            CorruptCheckpointError: anything else.
        """
        record = _record(raw, path)
        files, tensors, block_bytes = record.get("files"), record.get("tensors"), record.get("block_bytes")
        if type(block_bytes) is not int or block_bytes < 1 or not isinstance(files, list) or \
                not isinstance(tensors, dict):
            raise CorruptCheckpointError(f"{path}: the record lacks its files, tensors or block size")
        entries = {}
        for key, entry in tensors.items():
            if not isinstance(entry, list) or len(entry) != 7:
                raise CorruptCheckpointError(f"{path}: tensor {key!r}: malformed entry")
            entries[key] = TensorEntry(*entry)
        return cls(record.get("step"), record.get("metadata", {}), block_bytes, record.get("ranks"), files, entries)


def _record(raw: bytes, path: str) -> dict[str, Any]:
    """The record map of a ``COMMIT``'s bytes, its envelope checked."""
    if raw.startswith(HEADER[:-1]):  # version 2 and later: one array
        start = len(HEADER)
    elif raw.startswith(_HEADER_PREFIX):  # version 1: three objects as a stream
        start = len(_HEADER_PREFIX) + 1
    else:
        raise CorruptCheckpointError(f"{path}: not a ckpt commit record (bad header)")
    if len(raw) < start + FOOTER_SIZE:
        raise CorruptCheckpointError(f"{path}: the commit record is truncated")
    version = raw[start - 1]
    check_version(version, VERSION, "commit record", path)
    if (version == 1) != (start == len(_HEADER_PREFIX) + 1):
        raise CorruptCheckpointError(f"{path}: the header says version {version}, but the record "
                                     f"{'lacks' if version > 1 else 'has'} the array around it")
    fields = _FOOTER.unpack(raw[-FOOTER_SIZE:])
    if fields[:4] != (0x94, b"\xc4\x08", FOOTER_MAGIC, 0xCF) or fields[4] != start or \
            fields[4] + fields[6] + FOOTER_SIZE != len(raw):
        raise CorruptCheckpointError(f"{path}: the footer is damaged or the file is truncated")
    body = raw[start:len(raw) - FOOTER_SIZE]
    if _io.crc32c(body) != fields[8]:
        raise checksum_error(path, "the commit record")
    record = unpack(body, path, "the commit record")
    if not isinstance(record, dict) or record.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{path}: not a ckpt commit record")
    if record.get("version") != version:
        raise CorruptCheckpointError(f"{path}: the header says version {version}, the record "
                                     f"{record.get('version')!r}")
    return record
