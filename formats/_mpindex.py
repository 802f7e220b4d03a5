"""Checking a ckpt msgpack file's index against the file, before any tensor is read: every entry's
dtype, shape, extents and checksum; all entries at once for an index as ckpt writes it (columns a
restore of every tensor uses without a TensorInfo each), entry by entry otherwise; and the
"compressed" table of a version 4 index (docs/formats.md).

Example:
    >>> import numpy as np
    >>> _dtype_name(np.dtype(np.float32)), _header_len(100), _header_len(1 << 20)
    ('float32', 2, 5)
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from ckpt import dtypes
from ckpt.errors import CorruptCheckpointError, UnsupportedCheckpointError

from . import _io
from ._planes import CODEC
from ._readers import LazyIndex
from ._validation import _FILE_DTYPES
from .base import TensorInfo, all_exactly, all_lists, index_entry, keys_plainly_valid, \
    plain_extents

class MsgpackLocation(NamedTuple):
    """Where a tensor's bytes are in a ckpt msgpack file (TensorInfo.extra of MsgpackReader)."""

    #: [offset, nbytes] of each bin object holding the tensor (several above 4 GiB).
    extents: list[list[int]]
    crc32c: int


class _Columns(NamedTuple):
    """An index as ckpt writes it, as the columns ``_parse_plain_entries`` checked: what a
    restore of every tensor needs without building a TensorInfo per tensor."""

    rows: dict[str, int]
    keys: list[str]
    dtypes: list[np.dtype]
    dims: list[int]  # every shape, back to back: row r's is dims[bounds[r]:bounds[r + 1]]
    bounds: list[int]
    offsets: tuple[int, ...]
    crcs: tuple[int, ...]


_DTYPE_NAMES: dict[np.dtype, str] = {}


def _dtype_name(dtype: np.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtypes.dtype_name(dtype)
    return name


def _header_len(n: int) -> int:
    """The length of _bin_header(n)."""
    return 2 if n < 1 << 8 else 3 if n < 1 << 16 else 5


def _parse_entries(tensors: dict[Any, Any], path: str, start: int, data_end: int, compressed: Mapping[Any, Any],
                   ) -> tuple[Mapping[str, TensorInfo], int, _Columns | None]:
    """Validate every index entry against the file before any data is read; return them, the
    number of msgpack objects the file holds (header, payloads, padding, index, footer) and,
    for an index as ckpt writes it, its columns.

    An index as ckpt writes it is checked on all entries at once; anything else entry by entry
    (so are indexes with compressed tensors, whose stored sizes ``_parse_planes`` checks).
    """
    plain = None if compressed else _parse_plain_entries(tensors, start, data_end)
    if plain is not None:
        return plain
    return (*_check_entries(tensors, path, start, data_end, compressed), None)


def _compressed_table(index: dict[str, Any], path: str) -> dict[Any, Any]:
    """The "compressed" map of a version 4 index ({} when it compresses nothing)."""
    codec, table = index.get("compression"), index.get("compressed", {})
    if codec is None and not table:
        return {}
    if codec != CODEC:
        raise UnsupportedCheckpointError(f"{path}: compressed with {codec!r}; this ckpt reads {CODEC!r}")
    if type(table) is not dict:
        raise CorruptCheckpointError(f"{path}: the index's \"compressed\" field is not a map")
    return table


def _parse_planes(table: Mapping[Any, Any], tensors: Mapping[str, TensorInfo], block_bytes: int,
                  path: str) -> dict[str, np.ndarray]:
    """The stored size of each byte plane of each chunk of the compressed tensors, as a
    (chunks, itemsize) array per key, checked against the tensors' sizes and extents."""
    out: dict[str, np.ndarray] = {}
    for key, raw in table.items():
        info = tensors.get(key)
        if info is None or info.dtype.kind == "O" or not info.nbytes or block_bytes % info.dtype.itemsize:
            raise CorruptCheckpointError(f"{path}: plane sizes for {key!r}, which is not a compressible tensor "
                                         "in the index")
        itemsize, extents = info.dtype.itemsize, info.extra.extents
        chunks = -(-info.nbytes // block_bytes)
        if type(raw) is not bytes or len(raw) != 4 * chunks * itemsize or len(extents) != chunks:
            raise CorruptCheckpointError(f"{path}: tensor {key!r}: its compressed layout should be {chunks} "
                                         f"chunks of {itemsize} planes")
        sizes = np.frombuffer(raw, "<u4").reshape(chunks, itemsize)
        lengths = np.minimum(block_bytes, info.nbytes - np.arange(chunks) * block_bytes) // itemsize
        stored = np.array([n for _, n in extents])
        if (sizes > lengths[:, None]).any() or (sizes == 0).any() or (sizes.sum(axis=1) != stored).any():
            raise CorruptCheckpointError(f"{path}: tensor {key!r}: its plane sizes do not match its chunks' "
                                         "stored bytes: the index is damaged")
        out[key] = sizes
    return out


def _check_entries(tensors: dict[Any, Any], path: str, start: int, data_end: int,
                   compressed: Mapping[Any, Any]) -> tuple[dict[str, TensorInfo], int]:
    """``_parse_entries`` one entry at a time, naming the first problem found."""
    out: dict[str, TensorInfo] = {}
    last_end = start
    ordered = True
    objects = 3
    for key, entry in tensors.items():
        dtype, shape, extents, crc = index_entry(key, entry, path)
        if type(crc) is not int or not 0 <= crc < 2 ** 32 or type(extents) is not list or not extents:
            raise CorruptCheckpointError(f"{path}: tensor {key!r}: malformed extents or checksum")
        nbytes = 0
        is_string = dtype.kind == "O"
        for extent in extents:
            if type(extent) is not list or len(extent) != 2:
                raise CorruptCheckpointError(f"{path}: tensor {key!r}: malformed extents or checksum")
            offset, n = extent
            if type(offset) is not int or type(n) is not int or offset < start or n < 0 or offset + n > data_end:
                raise CorruptCheckpointError(f"{path}: tensor {key!r}: data at {offset!r} (+{n!r} bytes) lies "
                                             f"outside the payload area [{start}, {data_end})")
            ordered = ordered and offset >= last_end
            # a gap wider than the extent's bin header holds a padding object (strings have none)
            objects += 1 + (offset - last_end > (0 if is_string else _header_len(n)))
            last_end = offset + n
            nbytes += n
        if dtype.kind == "O":
            if len(extents) != 1:
                raise CorruptCheckpointError(f"{path}: tensor {key!r}: a string tensor has one extent")
            if _io.expected_nbytes(_BYTE, shape) > nbytes:  # every item takes at least one byte
                raise CorruptCheckpointError(f"{path}: tensor {key!r}: {list(shape)} strings cannot fit in "
                                             f"{nbytes} bytes")
        elif key in compressed:  # the stored bytes are checked by _parse_planes
            nbytes = _io.expected_nbytes(dtype, shape)
        elif nbytes != _io.expected_nbytes(dtype, shape):
            raise CorruptCheckpointError(
                f"{path}: tensor {key!r}: {_dtype_name(dtype)} {list(shape)} needs "
                f"{_io.expected_nbytes(dtype, shape)} bytes, the index gives {nbytes}")
        out[key] = TensorInfo(key, dtype, shape, nbytes, MsgpackLocation(extents, crc))
    if not ordered:  # ckpt writes tensors in index order; anything else must not overlap
        objects = _check_disjoint([(o, n, k, 0 if info.dtype.kind == "O" else _header_len(n))
                                   for k, info in out.items() for o, n in info.extra.extents], path, start)
    return out, objects


_BYTE = np.dtype(np.uint8)


def _parse_plain_entries(tensors: dict[Any, Any], start: int,
                         data_end: int) -> tuple[Mapping[str, TensorInfo], int, _Columns] | None:
    """``_parse_entries`` for an index as ckpt writes it, checked on all entries at once.

    Covers numeric tensors of one extent, no zero dimension, in file order: every check of
    the per-entry loop, done with C string searches and numpy over whole columns (about a
    tenth of its time). Returns None for anything else, or anything wrong: the loop then
    names the problem. The entries come back as a LazyIndex over columns of ints (what the
    loop's dict holds, built per key when asked for): nothing per entry outlives the parse.
    """
    keys = list(tensors)
    entries = list(tensors.values())
    if not entries or not keys_plainly_valid(keys) or not all_lists(entries, 4):
        return None
    names, shapes, extent_lists, crcs = zip(*entries)
    if not all_exactly(names, str):
        return None
    # not ``None in found``: that compares with ==, and np.dtype("float64") == None is True
    if not _FILE_DTYPES.keys() >= set(names) or not all_lists(extent_lists, 1):
        return None
    found = list(map(_FILE_DTYPES.__getitem__, names))
    extents = [x[0] for x in extent_lists]
    if not all_lists(extents, 2):
        return None
    offsets, sizes = zip(*extents)
    columns = plain_extents(shapes, offsets, sizes, crcs, found, start, data_end)
    if columns is None:
        return None
    offset, ends = columns
    n = ends - offset
    headers = np.where(n < 1 << 8, 2, np.where(n < 1 << 16, 3, 5))  # _header_len, vectorized
    gaps = offset - np.concatenate(([start], ends[:-1]))
    objects = 3 + len(n) + int(np.count_nonzero(gaps > headers))
    dims = list(itertools.chain.from_iterable(shapes))  # every shape, back to back
    bounds = list(itertools.accumulate(map(len, shapes), initial=0))
    new = tuple.__new__  # NamedTuples built without their Python-level __new__

    def build(key: str, row: int) -> TensorInfo:
        nbytes = sizes[row]
        location = new(MsgpackLocation, ([[offsets[row], nbytes]], crcs[row]))
        return new(TensorInfo, (key, found[row], tuple(dims[bounds[row]:bounds[row + 1]]), nbytes, location))

    def build_all() -> dict[str, TensorInfo]:
        shaped = (tuple(dims[a:b]) for a, b in itertools.pairwise(bounds))
        locations = map(new, itertools.repeat(MsgpackLocation), zip(([[o, n]] for o, n in zip(offsets, sizes)), crcs))
        return dict(zip(keys, map(new, itertools.repeat(TensorInfo), zip(keys, found, shaped, sizes, locations))))

    rows = dict(zip(keys, range(len(keys))))
    return LazyIndex(rows, build, build_all), objects, _Columns(rows, keys, found, dims, bounds, offsets, crcs)


def _check_disjoint(spans: list[tuple[int, int, str, int]], path: str, start: int) -> int:
    """Refuse overlapping extents (offset, length, key, bin header length); return the object
    count as _parse_entries counts it."""
    spans.sort()
    for (a_off, a_n, a_key, _), (b_off, _, b_key, _) in itertools.pairwise(spans):
        if a_off + a_n > b_off:
            raise CorruptCheckpointError(f"{path}: tensors {a_key!r} and {b_key!r} overlap in the file")
    ends = [start] + [offset + n for offset, n, _, _ in spans]
    return 3 + sum(1 + (offset - end > header) for (offset, _, _, header), end in zip(spans, ends))
