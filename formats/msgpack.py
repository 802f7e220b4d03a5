"""ckpt's msgpack checkpoint format (.msgpack).

The whole file is one msgpack array (version 3), so ``msgpack.unpackb(data)`` and a
streaming ``msgpack.Unpacker`` both decode it without ckpt:

    array32  dd + the number of elements below (uint32, big-endian)
    header   {"format": "ckpt-msgpack", "version": 3}
    payload  one bin object per tensor (several bin32 objects above 4 GiB - 1 bytes);
             a byte-string tensor is one array of bin objects
    index    {"format", "version", "metadata": {...},
              "tensors": {key: [dtype, shape, [[offset, nbytes], ...], crc32c]},
              "block_bytes": 1048576, "block_crcs": {key: crc32c per block (uint32 LE), ...}}
    footer   [b"ckpt-idx", index offset (uint64), index length (uint64), index crc32c (uint32)]

The footer has a fixed size (34 bytes), so a reader finds the index from the end of the
file and then reads only the tensors it is asked for; the block checksums of tensors over
1 MiB let ``read_slice`` read and verify just the blocks holding a slice. Version 1 files
(the same objects as a stream, without the array header) and version 2 files (no block
checksums) are still read. docs/formats.md specifies every byte.

Example:
    >>> import numpy as np, tempfile, os
    >>> from ckpt.formats.builtin import MsgpackFormat
    >>> path = os.path.join(tempfile.mkdtemp(), "t.msgpack")
    >>> MsgpackFormat().write(path, [("w", np.arange(3, dtype=np.float32))], {"step": 1})
    >>> with MsgpackFormat().open(path) as r:
    ...     r.read("w"), r.metadata
    (array([0., 1., 2.], dtype=float32), {'step': 1})
"""

from __future__ import annotations

import itertools
import operator
import struct
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from ckpt import dtypes
from ckpt.buffers import PAGE
from ckpt.checksums import crc32c_combine
from ckpt.errors import CorruptCheckpointError, checksum_error

from . import _io
from ._blocks import BlockSlicing, parse_table, read_part, table_problems
from ._codec import unpack
from ._planes import CODEC as CODEC  # the compression codec msgpack files offer
from ._mpindex import _compressed_table, _header_len, _parse_entries, _parse_planes
from .base import (
    FileReader,
    TensorInfo,
    check_metadata,
    check_version,
)

FORMAT_NAME = "ckpt-msgpack"
VERSION = 3
#: The version of files written with compression (version 3 plus compressed tensors).
COMPRESSED_VERSION = 4
#: Numeric tensors smaller than this are stored plain in compressed files (too small to pay).
COMPRESS_MIN = 4096
HEADER_PREFIX = b"\x82\xa6format\xac" + FORMAT_NAME.encode() + b"\xa7version"
HEADER = HEADER_PREFIX + bytes([VERSION])
#: Version 2 and later files open with an array 32 header: this byte, then the element count (4 bytes).
ARRAY32 = 0xDD
#: Where payloads start: after the array header and the header map (version 1: after the map).
DATA_START = 5 + len(HEADER)
DATA_START_V1 = len(HEADER)
FOOTER_MAGIC = b"ckpt-idx"
_FOOTER = struct.Struct(">B2s8sBQBQBI")
FOOTER_SIZE = _FOOTER.size  # 34
#: Largest bin object msgpack allows; bigger tensors are split (tests shrink it).
MAX_BIN = 2 ** 32 - 1


def _bin_header(n: int) -> bytes:
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def _padding(data_start: int) -> bytes:
    """A zero-filled bin object that moves ``data_start`` to the next multiple of PAGE."""
    gap = -data_start % PAGE
    if gap == 0:
        return b""
    if gap < 2:  # the smallest bin object takes two bytes
        gap += PAGE
    if gap - 2 < 256:
        return b"\xc4" + bytes([gap - 2]) + bytes(gap - 2)
    return b"\xc5" + (gap - 3).to_bytes(2, "big") + bytes(gap - 3)  # bin 16 even below 256 bytes


def is_ckpt_msgpack(head: bytes) -> bool:
    """True when ``head`` (a file's first bytes) starts a ckpt msgpack file of any version."""
    return head.startswith(HEADER_PREFIX) or (head[:1] == bytes([ARRAY32]) and
                                              head[5:5 + len(HEADER_PREFIX)] == HEADER_PREFIX)


#: Chunks one task decodes, at least and at most; between, a tensor is cut into three tasks (this
#: thread and the two I/O threads). A task's stored bytes are one read, on an object store one
#: ranged GET: 4-chunk tasks made a 64 MiB restore from moto's S3 3x slower than 16-chunk ones.
_DECODE_GROUP, _DECODE_GROUP_MAX = 4, 16


def _decode_group(chunks: int) -> int:
    """How many chunks of a compressed tensor of ``chunks`` chunks one task decodes."""
    return min(max(_DECODE_GROUP, chunks // 3), _DECODE_GROUP_MAX)


class MsgpackReader(BlockSlicing, FileReader):
    """Reads the footer and index on open; tensors (or blocks of them: ``read_slice``) on
    request, straight into caller buffers."""

    format_name = "msgpack"
    _checks_shapes = True  # every entry's shape is bounded while the index is parsed

    def _open(self) -> None:
        path, source = self.path, self._source
        size = source.size
        if size < DATA_START_V1 + FOOTER_SIZE:
            raise CorruptCheckpointError(f"{path}: {size} bytes is too short for a ckpt msgpack "
                                         "checkpoint: it is truncated")
        head = _io.pread(source, 0, min(DATA_START, size), "the header")
        version, start, count = _parse_head(head, path)
        if start + FOOTER_SIZE > size:
            raise CorruptCheckpointError(f"{path}: {size} bytes is too short for a ckpt msgpack "
                                         "checkpoint: it is truncated")
        footer = _io.pread(source, size - FOOTER_SIZE, FOOTER_SIZE, "the footer")
        fields = _FOOTER.unpack(footer)
        if fields[:4] != (0x94, b"\xc4\x08", FOOTER_MAGIC, 0xCF) or fields[5] != 0xCF or fields[7] != 0xCE:
            raise CorruptCheckpointError(f"{path}: the footer is damaged or the file is truncated "
                                         "(no index found at its end)")
        index_offset, index_len, index_crc = fields[4], fields[6], fields[8]
        if index_offset < start or index_offset + index_len + FOOTER_SIZE != size:
            raise CorruptCheckpointError(f"{path}: the footer points to an index at {index_offset} "
                                         f"(+{index_len} bytes) in a {size}-byte file")
        raw = _io.pread(source, index_offset, index_len, "the index")
        if _io.crc32c(raw) != index_crc:
            raise checksum_error(path, "the index")
        index = unpack(raw, path, "the index")
        if not isinstance(index, dict) or index.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError(f"{path}: the index is not a ckpt msgpack index")
        check_version(index.get("version"), COMPRESSED_VERSION, "msgpack", path)
        if index["version"] != version:
            raise CorruptCheckpointError(f"{path}: the header says format version {version}, the index "
                                         f"{index['version']}")
        metadata, tensors = index.get("metadata"), index.get("tensors")
        if not isinstance(metadata, dict) or not isinstance(tensors, dict):
            raise CorruptCheckpointError(f"{path}: the index lacks its metadata or tensors map")
        self._metadata = check_metadata(metadata, path)
        compressed = _compressed_table(index, path) if version >= COMPRESSED_VERSION else {}
        self._tensors, objects, self._columns = _parse_entries(tensors, path, start, index_offset, compressed)
        if count is not None and count != objects:
            raise CorruptCheckpointError(f"{path}: the file's array header counts {count} objects, its "
                                         f"index describes {objects}: the file is damaged")
        self._blocks, self._block_bytes = parse_table(index, self._tensors, path) if version >= 3 else ({}, 0)
        self._planes = _parse_planes(compressed, self._tensors, self._block_bytes, path)
        self.version = version
        self._start = start
        self._index_offset = index_offset

    def data_extents(self, key: str) -> list[tuple[int, int]] | None:
        info = self.info(key)
        if dtypes.is_string(info.dtype) or key in self._planes:  # compressed: not the C-order bytes
            return None
        return [(o, n) for o, n in info.extra.extents]

    def _read_box(self, info: TensorInfo, offset: tuple[int, ...], out: np.ndarray) -> None:
        sizes, crcs = self._planes.get(info.key), self._blocks.get(info.key)
        if sizes is None or crcs is None or out.shape == info.shape or out.size == 0:
            super()._read_box(info, offset, out)
            return
        block_bytes = self._block_bytes

        def fetch(start: int, view: memoryview) -> None:  # whole chunks, decoded
            first = start // block_bytes
            self._decode(info, sizes, first, first + -(-len(view) // block_bytes), view)

        self.bytes_read += read_part(self, [], info.key, info.dtype, info.shape, crcs, block_bytes, offset,
                                     tuple(out.shape), out, fetch)

    def _decode(self, info: TensorInfo, sizes: np.ndarray, first: int, last: int, out: memoryview) -> int:
        """Decode chunks ``[first, last)`` of a compressed tensor into ``out``, back to back; return
        the crc32c of the bytes decoded (each chunk checksummed while it is in cache)."""
        from ._planes import decode_chunk  # lazy: only compressed tensors need zstandard

        extents, block_bytes, itemsize = info.extra.extents, self._block_bytes, info.dtype.itemsize
        what = f"tensor {info.key!r}"
        start, end = extents[first][0], extents[last - 1][0] + extents[last - 1][1]
        if all(b[0] - a[0] - a[1] == _header_len(b[1]) for a, b in itertools.pairwise(extents[first:last])):
            span = np.empty(end - start, np.uint8).data  # back to back, as written: one read (not zeroed)
            self._source.read_into(span, start, what)
        else:  # (an index that scatters them is read chunk by chunk, never the gaps)
            span, start = np.empty(max(n for _, n in extents[first:last]), np.uint8).data, -1
        pos = crc = 0
        for chunk in range(first, last):
            offset, n = extents[chunk]
            if start < 0:
                view = span[:n]
                self._source.read_into(view, offset, what)
            else:
                view = span[offset - start:offset - start + n]
            length = min(block_bytes, info.nbytes - chunk * block_bytes)
            piece = out[pos:pos + length]
            decode_chunk(view, sizes[chunk].tolist(), itemsize, piece, f"{self.path}: {what}, chunk {chunk}")
            crc = _io.crc32c(piece, crc)
            pos += length
        return crc

    def _decode_all(self, info: TensorInfo, sizes: np.ndarray, view: memoryview) -> int:
        """Decode a whole compressed tensor into ``view``, groups of chunks on the I/O threads beside
        this one; return its crc32c (combined from the groups')."""
        group = _decode_group(len(sizes))
        span = self._block_bytes * group
        firsts = range(0, len(sizes), group)
        futures = [_io.workers().submit(self._decode, info, sizes, first, min(first + group, len(sizes)),
                                        view[first * self._block_bytes:][:span]) for first in firsts[1:]]
        crc = self._decode(info, sizes, 0, min(group, len(sizes)), view[:span])
        for future in futures:  # (every one waited for: none writes into ``view`` after a raise)
            future.exception()
        for future, first in zip(futures, firsts[1:]):
            crc = crc32c_combine(crc, future.result(), min(span, len(view) - first * self._block_bytes))
        return crc

    def block_checksums(self, key: str) -> tuple[np.ndarray, int] | None:
        crcs = self._blocks.get(key)
        return None if crcs is None else (crcs, self._block_bytes)

    def _read_many(self, pairs: list[tuple[TensorInfo, np.ndarray]]) -> None:
        spans, simple = [], []
        byte_view = _io.byte_view
        for info, out in pairs:  # a hot loop (10,000s of small tensors): few calls per tensor
            extents = info.extra.extents
            if len(extents) > 1 or info.dtype.kind == "O" or info.key in self._planes:  # split, strings, compressed
                self._read_into(info, out)
            else:
                spans.append((extents[0][0], byte_view(out)))
                simple.append(info)
        crcs = self._source.read_spans(spans, lambda i: f"tensor {simple[i].key!r}")
        for info, crc in zip(simple, crcs):
            if crc != info.extra.crc32c:
                self._check_crc(info, crc, info.extra.crc32c)

    def match_exact(self, keys: Sequence[str], shapes: Sequence[tuple[int, ...]],
                    dtypes: Sequence[np.dtype]) -> Sequence[Any] | None:
        columns = self._columns
        if columns is None:  # an index read entry by entry: TensorInfos as handles
            return super().match_exact(keys, shapes, dtypes)
        # row numbers as handles, matched column by column in C loops: no TensorInfo is built
        found = list(map(columns.rows.get, keys))
        if None in found:
            return None
        rows = cast(list[int], found)
        if list(map(columns.dtypes.__getitem__, rows)) != dtypes:
            return None
        bounds = columns.bounds
        if len(rows) == len(columns.keys) and rows == list(range(len(rows))):  # every tensor, in file order
            # the shapes back to back and where each starts: two list comparisons, no tuple per tensor
            same = list(itertools.chain.from_iterable(shapes)) == columns.dims and \
                list(itertools.accumulate(map(len, shapes), initial=0)) == bounds
            return rows if same else None
        ranges = map(slice, map(bounds.__getitem__, rows), map(bounds.__getitem__, map((1).__add__, rows)))
        return rows if list(map(tuple, map(columns.dims.__getitem__, ranges))) == shapes else None

    def read_matched(self, handles: Sequence[Any], buffers: Sequence[np.ndarray]) -> None:
        columns = self._columns
        if columns is None:
            super().read_matched(handles, buffers)
            return
        keys = columns.keys
        offsets = list(map(columns.offsets.__getitem__, handles))

        def name(i: int) -> str:
            return f"tensor {keys[handles[i]]!r}"

        if isinstance(self._source, _io.LocalFile):  # preadv into the arrays themselves: no byte views
            crcs = self._source.read_buffers(offsets, buffers, name, _io.byte_view)
        else:
            crcs = self._source.read_spans(list(zip(offsets, _byte_views(buffers))), name)
        expected = list(map(columns.crcs.__getitem__, handles))
        if crcs != expected:  # one list comparison for all; the first tensor that differs is named
            i = next(i for i, (got, crc) in enumerate(zip(crcs, expected)) if got != crc)
            raise checksum_error(self.path, f"tensor {keys[handles[i]]!r}", crcs[i], expected[i],
                                 key=keys[handles[i]])

    def _read_into(self, info: TensorInfo, out: np.ndarray) -> None:
        extents, expected = info.extra
        what = f"tensor {info.key!r}"
        if dtypes.is_string(info.dtype):
            (offset, n), = extents
            raw = _io.pread(self._source, offset, n, what)
            self._check_crc(info, _io.crc32c(raw), expected)
            items = unpack(raw, self.path, what, max_items=info.size)
            if not isinstance(items, list) or len(items) != info.size or \
                    not all(isinstance(x, bytes) for x in items):
                raise CorruptCheckpointError(f"{self.path}: tensor {info.key!r} should hold {info.size} "
                                             "byte strings")
            flat = out.reshape(-1)
            for i, item in enumerate(items):
                flat[i] = item
            return
        sizes = self._planes.get(info.key)
        if sizes is not None:
            self._check_crc(info, self._decode_all(info, sizes, _io.byte_view(out)), expected)
            return
        view, pos, crc = _io.byte_view(out), 0, 0
        for offset, n in extents:  # a tensor split across several bin objects
            piece = view[pos:pos + n]
            self._source.read_into(piece, offset, what)
            crc = _io.crc32c(piece, crc)
            pos += n
        self._check_crc(info, crc, expected)

    def _check_crc(self, info: TensorInfo, got: int, expected: int) -> None:
        if got != expected:
            raise checksum_error(self.path, f"tensor {info.key!r}", got, expected, key=info.key)

    def verify(self, progress: Callable[[int], None] | None = None) -> list[str]:
        problems = []
        for key, info in self._tensors.items():
            extents, expected = info.extra
            crc = 0
            try:
                if key in self._planes:
                    crc = self._decoded_crc(info, self._planes[key])
                else:
                    for offset, n in extents:
                        crc = _io.checksum_range(self._source, offset, n, f"tensor {key!r}", crc)
                self._check_crc(info, crc, expected)
            except CorruptCheckpointError as exc:
                problems.append(str(exc))
            if progress is not None:
                progress(info.nbytes)
        return problems + table_problems(self.path, self._blocks, self._tensors, self._block_bytes) + \
            self._framing_problems()

    def _decoded_crc(self, info: TensorInfo, sizes: np.ndarray) -> int:
        """The crc32c of a compressed tensor's bytes, decoded a task's chunks at a time (``verify``)."""
        group, block_bytes = _decode_group(len(sizes)), self._block_bytes
        buf = memoryview(bytearray(min(block_bytes * group, info.nbytes)))
        crc = 0
        for first in range(0, len(sizes), group):
            piece = buf[:min(block_bytes * group, info.nbytes - first * block_bytes)]
            crc = crc32c_combine(crc, self._decode(info, sizes, first, min(first + group, len(sizes)), piece),
                                 len(piece))
        return crc

    def _framing_problems(self) -> list[str]:
        """Payload objects must sit back to back between header and index, each numeric extent
        behind the bin header (and alignment padding) ckpt writes for it, so plain msgpack
        decodes the stream too."""
        spans = sorted((offset, n, key, dtypes.is_string(info.dtype))
                       for key, info in self._tensors.items() for offset, n in info.extra.extents)
        pos = self._start
        for offset, n, key, is_string in spans:
            prefix = b"" if is_string else _bin_header(n)  # a string extent is its whole array object
            if offset != pos + len(prefix) and not is_string:
                prefix = _padding(pos + len(prefix)) + prefix
            if offset - len(prefix) != pos or (prefix and _io.pread(
                    self._source, pos, len(prefix), f"tensor {key!r}'s bin header") != prefix):
                return [f"{self.path}: the msgpack framing before tensor {key!r} (offset {pos}) is damaged: "
                        "plain msgpack readers cannot decode the file"]
            pos = offset + n
        if pos != self._index_offset:
            return [f"{self.path}: {self._index_offset - pos} unexpected bytes before the index at {pos}"]
        return []


def _byte_views(arrays: Sequence[np.ndarray]) -> list[memoryview]:
    """``_io.byte_view`` of each numeric array (no object dtypes: the index columns hold none),
    in C loops when every array exports a buffer numpy can describe (ml_dtypes' cannot)."""
    try:
        return list(map(_AS_BYTES, map(_DATA, arrays)))
    except (ValueError, TypeError):
        return list(map(_io.byte_view, arrays))


_DATA, _AS_BYTES = operator.attrgetter("data"), operator.methodcaller("cast", "B")


def _parse_head(head: bytes, path: str) -> tuple[int, int, int | None]:
    """(format version, payload start, array element count or None) from a file's first bytes."""
    if head.startswith(HEADER_PREFIX):  # version 1: a stream of objects, no array around them
        version, start, count = head[len(HEADER) - 1], DATA_START_V1, None
    elif is_ckpt_msgpack(head) and len(head) == DATA_START:
        version, start, count = head[-1], DATA_START, int.from_bytes(head[1:5], "big")
    else:
        raise CorruptCheckpointError(f"{path}: not a ckpt msgpack checkpoint (bad header)")
    check_version(version, COMPRESSED_VERSION, "msgpack", path)
    if (version == 1) != (count is None):
        raise CorruptCheckpointError(f"{path}: the header says format version {version}, but the file "
                                     f"{'has' if count is not None else 'lacks'} the array header of "
                                     "versions 2 and later")
    return version, start, count
