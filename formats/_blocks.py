"""Checksums per fixed-size block of a tensor's bytes, and verified reads of part of a tensor.

A tensor's C-order bytes are cut into blocks of ``BLOCK_BYTES`` (the last one may be shorter)
and each block gets its own crc32c, so reading part of a tensor reads and verifies only the
blocks that hold it. ckpt's msgpack (version 3) and HDF5 (version 2) files store them beside
the per-tensor crc32c; sharded checkpoints store them in their commit record.

Writers get both kinds from one pass: ``checksums(view)`` computes each block's crc32c and
folds them into the tensor's (crc32c(a + b) is a linear function of crc32c(a) and crc32c(b)).

Example:
    >>> import numpy as np
    >>> data = np.arange(700_000, dtype=np.float32)  # 2.8 MB: three blocks
    >>> whole, packed = checksums(memoryview(data).cast("B"))()
    >>> whole == crc32c(data.tobytes()), len(unpack_crcs(packed, data.nbytes, BLOCK_BYTES, "f", "w"))
    (True, 3)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ckpt import boxes
from ckpt.errors import CorruptCheckpointError, checksum_error

from . import _io
from ._readers import FileReader
from ._slicing import check_box
from ckpt.checksums import crc32c, gf2_times

__all__ = ["BLOCK_BYTES", "block_crcs", "checksums", "RunningChecksums", "combine", "pack_crcs", "unpack_crcs",
           "read_part", "BlockSlicing"]

#: Bytes per checksum block: a partial read verifies (and so reads) whole blocks of this size.
BLOCK_BYTES = 1 << 20

_operators: dict[int, list[int]] = {}


def _shift(value: int, nbytes: int) -> int:
    """The crc32c register ``value`` advanced over ``nbytes`` zero bytes without the constant
    part: crc32c(a + b) == _shift(crc32c(a), len(b)) ^ crc32c(b)."""
    op = _operators.get(nbytes)
    if op is None:  # the operator's columns, from crc32c of zeros (one pass of 32 x nbytes, once)
        zeros = bytes(nbytes)
        base = crc32c(zeros)
        op = [crc32c(zeros, 1 << bit) ^ base for bit in range(32)]
        if len(_operators) < 64:  # the block size and a few last-block sizes
            _operators[nbytes] = op
    return gf2_times(op, value)


def combine(crcs: Sequence[int], nbytes: int, block_bytes: int = BLOCK_BYTES) -> int:
    """The crc32c of a tensor's ``nbytes`` bytes from the crc32c values of its blocks."""
    whole = 0
    for i, crc in enumerate(crcs):
        whole = (_shift(whole, min(block_bytes, nbytes - i * block_bytes)) if i else 0) ^ int(crc)
    return whole


def block_crcs(view: memoryview, block_bytes: int = BLOCK_BYTES) -> list[int]:
    """crc32c of each ``block_bytes`` of ``view`` (one value for an empty view)."""
    return [crc32c(view[i:i + block_bytes]) for i in range(0, max(len(view), 1), block_bytes)]


def _both(view: memoryview, block_bytes: int) -> tuple[int, bytes | None]:
    crcs = block_crcs(view, block_bytes)
    full = len(view) // block_bytes
    whole = 0
    for i in range(full):  # whole blocks: the cached block-size operator
        whole = _shift(whole, block_bytes) ^ crcs[i] if i else crcs[i]
    if full < len(crcs):  # a shorter last block: continue the register over its bytes
        whole = crc32c(view[full * block_bytes:], whole)
    return whole, pack_crcs(crcs) if len(crcs) > 1 else None


def checksums(view: memoryview, block_bytes: int = BLOCK_BYTES) -> Callable[[], tuple[int, bytes | None]]:
    """Start the tensor's crc32c and its packed block crc32c values (None for one block);
    return a function that waits for them. Large views are checksummed on a worker thread."""
    if len(view) <= block_bytes:
        value = crc32c(view)
        return lambda: (value, None)
    if len(view) < _io.BIG:
        result = _both(view, block_bytes)
        return lambda: result
    return _io.workers().submit(_both, view, block_bytes).result


class RunningChecksums:
    """``checksums`` of bytes that arrive in pieces cut anywhere (a streamed tensor): the
    block being filled keeps its crc32c register across pieces.

    Example:
        >>> data = memoryview(bytes(range(256)) * 9000).cast("B")
        >>> running = RunningChecksums(block_bytes=1000)
        >>> for start in range(0, len(data), 777):
        ...     running.update(data[start:start + 777])
        >>> running.result() == checksums(data, 1000)()
        True
    """

    def __init__(self, block_bytes: int = BLOCK_BYTES) -> None:
        self.block_bytes = block_bytes
        self.nbytes = self._filled = self._register = 0
        self._crcs: list[int] = []

    def update(self, view: memoryview) -> None:
        pos = 0
        while pos < len(view):
            take = min(self.block_bytes - self._filled, len(view) - pos)
            self._register = crc32c(view[pos:pos + take], self._register)
            self._filled += take
            pos += take
            if self._filled == self.block_bytes:
                self._crcs.append(self._register)
                self._register = self._filled = 0
        self.nbytes += len(view)

    def result(self) -> tuple[int, bytes | None]:
        """The tensor's crc32c and its packed block crc32c values (None for one block)."""
        crcs = self._crcs + ([self._register] if self._filled or not self._crcs else [])
        return combine(crcs, self.nbytes, self.block_bytes), pack_crcs(crcs) if len(crcs) > 1 else None


def pack_crcs(crcs: Sequence[int]) -> bytes:
    """Block crc32c values as the formats store them: little-endian uint32s, back to back."""
    return np.asarray(crcs, dtype="<u4").tobytes()


def unpack_crcs(raw: Any, nbytes: int, block_bytes: int, path: str, key: str) -> np.ndarray:
    """Packed block checksums as a uint32 array, checked against the tensor's size."""
    count = -(-nbytes // block_bytes)
    if type(raw) is not bytes or len(raw) != 4 * count:
        raise CorruptCheckpointError(f"{path}: tensor {key!r}: its block checksums should be {count} "
                                     f"little-endian uint32 values for {nbytes} bytes")
    return np.frombuffer(raw, dtype="<u4")


def _read_logical(reader: Any, extents: Sequence[tuple[int, int]], start: int, out: memoryview,
                  what: str) -> None:
    """Read the tensor bytes ``[start, start + len(out))``, whose file pieces are ``extents``."""
    pos = 0
    for offset, n in extents:
        if start < pos + n and len(out):
            skip = start - pos
            take = min(n - skip, len(out))
            reader.read_range_into(offset + skip, out[:take], what)
            out, start = out[take:], start + take
        pos += n


def read_part(reader: Any, extents: Sequence[tuple[int, int]], key: str, dtype: np.dtype,
              shape: tuple[int, ...], crcs: Any, block_bytes: int, src: tuple[int, ...],
              part: tuple[int, ...], dst: np.ndarray,
              fetch: Callable[[int, memoryview], None] | None = None) -> int:
    """Read the checksum blocks holding ``[src, src + part)`` of a stored C-order array of
    ``shape`` (its bytes at ``extents`` of ``reader``'s file), verify each against ``crcs``, copy
    that part into ``dst``; return the bytes read.

    ``fetch(start, out)``, when given, fills ``out`` with the array's bytes from ``start`` (a
    multiple of ``block_bytes``) instead of reading ``extents``: a compressed tensor's decoder.

    Raises:
        CorruptCheckpointError: a block fails its checksum (naming the file, key and bytes).
    """
    itemsize = dtype.itemsize
    nbytes = boxes.volume(shape) * itemsize
    starts, run = boxes.byte_runs(shape, itemsize, src, part)
    ranges = boxes.touched_ranges(starts, run, block_bytes, nbytes)
    if not ranges:
        return 0
    lo, hi = ranges[0][0], ranges[-1][1]
    buf = np.empty(hi - lo, np.uint8)
    what = f"tensor {key!r}"
    done = 0
    for a, b in ranges:
        if fetch is None:
            _read_logical(reader, extents, a, buf.data[a - lo:b - lo], what)
        else:
            fetch(a, buf.data[a - lo:b - lo])
        done += b - a
        for start in range(a, b, block_bytes):
            end = min(start + block_bytes, b)
            got, want = crc32c(buf.data[start - lo:end - lo]), int(crcs[start // block_bytes])
            if got != want:
                raise checksum_error(reader.path, f"tensor {key!r}, bytes {start}..{end},", got, want, key=key)
    strides = [itemsize] * len(shape)
    for axis in range(len(shape) - 2, -1, -1):
        strides[axis] = strides[axis + 1] * shape[axis + 1]
    dst[...] = np.ndarray(part, dtype, buffer=buf, offset=int(starts[0]) - lo, strides=strides)
    return done


class BlockSlicing(FileReader):
    """``read_box_into`` (and so ``read_slice``) for single-file readers with block checksums.

    A subclass provides ``data_extents(key)`` and ``block_checksums(key)`` -> (crc values, block
    bytes) or None (a tensor of one block, a string tensor, a file of a version without them):
    then the whole tensor is read and verified, and the part copied out. ``bytes_read`` counts the
    tensor bytes these reads read.
    """

    bytes_read = 0
    partial_reads = True

    def read_box_into(self, key: str, offset: Sequence[int], out: np.ndarray) -> None:
        """Read the block ``[offset, offset + out.shape)`` of tensor ``key`` into ``out``, reading
        and verifying only the checksum blocks that hold it."""
        info = self.info(key)
        check_box(info, offset, out.shape, self.path)
        self._read_box(info, tuple(int(o) for o in offset), out)

    def _read_box(self, info: Any, offset: tuple[int, ...], out: np.ndarray) -> None:
        if out.size == 0:
            return
        blocks = self.block_checksums(info.key) if out.shape != info.shape else None
        extents = None if blocks is None else self.data_extents(info.key)
        if blocks is None or extents is None:
            if out.shape == info.shape and out.flags.c_contiguous and out.flags.writeable:
                self.read_into(info.key, out)
            else:
                whole = np.empty(info.shape, info.dtype)
                self.read_into(info.key, whole)
                out[...] = whole[tuple(slice(o, o + n) for o, n in zip(offset, out.shape))]
            self.bytes_read += info.nbytes
            return
        crcs, block_bytes = blocks
        self.bytes_read += read_part(self, extents, info.key, info.dtype, info.shape, crcs, block_bytes, offset,
                                     tuple(out.shape), out)


def parse_table(index: dict[str, Any], tensors: Any, path: str) -> tuple[dict[str, np.ndarray], int]:
    """The block checksums of an index (its "block_bytes" and "block_crcs" fields), checked
    against the tensors they belong to. A tensor without them is read whole."""
    block_bytes, table = index.get("block_bytes"), index.get("block_crcs")
    if type(block_bytes) is not int or block_bytes < 1 or type(table) is not dict:
        raise CorruptCheckpointError(f"{path}: the index lacks its block size or block checksums")
    out: dict[str, np.ndarray] = {}
    for key, raw in table.items():
        info = tensors.get(key)
        if info is None or info.dtype.kind == "O":
            raise CorruptCheckpointError(f"{path}: block checksums for {key!r}, which is not a numeric tensor "
                                         "in the index")
        out[key] = unpack_crcs(raw, info.nbytes, block_bytes, path, key)
    return out, block_bytes


def table_problems(path: str, table: dict[str, np.ndarray], tensors: Any, block_bytes: int) -> list[str]:
    """Tensors whose block checksums do not combine into their own crc32c (``verify``)."""
    return [f"{path}: tensor {key!r}: its block checksums do not match its crc32c: the index is damaged"
            for key, crcs in table.items()
            if combine(crcs.tolist(), tensors[key].nbytes, block_bytes) != tensors[key].extra.crc32c]
