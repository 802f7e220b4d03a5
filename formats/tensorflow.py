"""TensorFlow checkpoints (tensor bundles), read without TensorFlow.

A checkpoint is a prefix ("run/model.ckpt-7") naming two kinds of files:

* ``<prefix>.index``: an SSTable mapping each key to a BundleEntryProto (dtype, shape,
  shard, offset, size, masked crc32c); the empty key holds a BundleHeaderProto (shard
  count, endianness, version);
* ``<prefix>.data-00000-of-00001`` (one per shard): the tensors' raw bytes.

Open the prefix, the .index or a .data file, or the directory (its "checkpoint" state file
names the latest prefix). Keys are TensorFlow's as they are: "encoder/dense/kernel" for
TF1 Savers, "model/w/.ATTRIBUTES/VARIABLE_VALUE" for TF2's object-based checkpoints. The
index blocks' and every tensor's crc32c are verified. Variables saved in slices (TF1
partitioners, TF2's MaxShardSizePolicy) are reassembled under their full name, and
``read_slice`` reads a block from just the slices it overlaps. Entries that are not tensors
(the TF2 object graph, resource or variant values) are listed in the metadata's
"non_tensors" and explained when asked for.

Example:
    >>> import ckpt
    >>> ckpt.list_variables("tf1_saver")  # doctest: +SKIP
    [('dbl', [3]), ('encoder/dense/bias', [3]), ('encoder/dense/kernel', [4, 3]), ...]
"""

from __future__ import annotations

import bisect
import os
import re
from typing import Any
from collections.abc import Sequence

import numpy as np

from ckpt import dtypes
from ckpt.errors import (CheckpointNotFoundError, CorruptCheckpointError, KeyNotFoundError,
                         UnsupportedCheckpointError, checksum_error)
from ckpt.storage import ReadableBlob

from . import _io
from ._foreign import NUMPY_DTYPES, check_key
from ._sstable import TABLE_MAGIC, SSTableError, fields, int64, mask, table_entries, unmask, varint
from ._slicing import check_box
from .base import BaseReader, TensorInfo, check_tensors

#: TensorFlow's DataType enum -> numpy, for the types ckpt reads.
_DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.float32), 2: np.dtype(np.float64), 3: np.dtype(np.int32), 4: np.dtype(np.uint8),
    5: np.dtype(np.int16), 6: np.dtype(np.int8), 7: dtypes.string, 8: np.dtype(np.complex64),
    9: np.dtype(np.int64), 10: np.dtype(np.bool_), 14: dtypes.bfloat16, 17: np.dtype(np.uint16),
    18: np.dtype(np.complex128), 19: np.dtype(np.float16), 22: np.dtype(np.uint32),
    23: np.dtype(np.uint64), 24: NUMPY_DTYPES["float8_e5m2"], 25: NUMPY_DTYPES["float8_e4m3fn"],
    26: NUMPY_DTYPES["float8_e4m3fnuz"], 27: NUMPY_DTYPES["float8_e4m3b11fnuz"],
    28: NUMPY_DTYPES["float8_e5m2fnuz"],
}
_DTYPE_CODES = {dtype: code for code, dtype in _DTYPES.items()}
_OTHER_DTYPES = {11: "qint8", 12: "quint8", 13: "qint32", 15: "qint16", 16: "quint16",
                 20: "resource", 21: "variant", 29: "int4", 30: "uint4"}
#: The TF2 checkpoint's serialized TrackableObjectGraph: a string, not a variable.
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
_DATA_FILE = re.compile(r"\.data-(\d{5})-of-(\d{5})$")
#: Newest bundle format this reader understands (TensorFlow's kTensorBundleVersion).
_BUNDLE_VERSION = 1


def prefix_of(path: str) -> str | None:
    """The checkpoint prefix ``path`` names (the prefix, its .index or a .data file), or None."""
    if path.endswith(".index") and os.path.isfile(path):
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() < len(TABLE_MAGIC):
                return None
            f.seek(-len(TABLE_MAGIC), os.SEEK_END)
            return path[:-len(".index")] if f.read() == TABLE_MAGIC else None
    match = _DATA_FILE.search(path)
    if match and os.path.isfile(path) and os.path.isfile(path[:match.start()] + ".index"):
        return path[:match.start()]
    if not os.path.exists(path) and os.path.isfile(path + ".index"):
        return path
    return None


def open_tensorflow(path: str) -> TensorFlowReader:
    prefix = prefix_of(path)
    if prefix is None:
        raise CheckpointNotFoundError(f"{path}: no TensorFlow checkpoint ({path}.index does not exist)")
    return TensorFlowReader(prefix)


class TensorFlowReader(BaseReader):
    """Reads the index on open; tensors on request from the data shards."""

    format_name = "tensorflow"
    _tensors: dict[str, TensorInfo]  # filled entry by entry while the file is parsed
    partial_reads = True  # read_box_into reads only the slices a block overlaps (sliced variables)

    def __init__(self, prefix: str) -> None:
        self.path = prefix
        self._shards: dict[int, ReadableBlob] = {}
        self._index = prefix + ".index"
        try:
            with _io.LocalFile(self._index) as index:
                self._read_index(index)
        except SSTableError as exc:
            self.close()
            raise CorruptCheckpointError(f"{self._index}: {exc}") from exc
        except BaseException:
            self.close()
            raise

    def _read_index(self, index: ReadableBlob) -> None:
        self._tensors = {}
        self._entries: dict[str, tuple[int, int, int, int]] = {}  # shard, offset, size, masked crc32c
        #: sliced variables: name -> [(box: (start, length) per dimension, entry)], and the slices read
        #: from the index before their variable (TensorFlow sorts them first)
        self._pieces: dict[str, list[tuple[tuple[tuple[int, int], ...], tuple[int, int, int, int]]]] = {}
        self._slices: dict[str, dict[tuple[tuple[int, int], ...], dict[str, Any]]] = {}
        self._notes: dict[str, str] = {}
        header = None
        seen: set[bytes] = set()
        for raw_key, value in table_entries(index):
            if raw_key in seen:
                raise SSTableError(f"key {raw_key!r} appears twice")
            seen.add(raw_key)
            if raw_key == b"":
                header = _parse_header(value, self._index)
            elif raw_key.startswith(b"\x00"):  # one slice of a sliced variable (sorted before all names)
                self._add_slice(raw_key, value)
            else:
                self._add(raw_key, value)
        if header is None:
            raise CorruptCheckpointError(f"{self._index}: the index has no header entry")
        orphans = set(self._slices) - set(self._pieces) - set(self._notes)
        if orphans:
            raise CorruptCheckpointError(f"{self._index}: slices of {sorted(orphans)[0]!r}, a variable the "
                                         "index does not list")
        self._num_shards = header
        check_tensors(self._tensors, self._index)
        self._check_extents()
        self._metadata = {"non_tensors": dict(self._notes)} if self._notes else {}

    def _check_extents(self) -> None:
        """Every tensor must lie inside its shard's data file (checked before anything is allocated)."""
        sizes: dict[int, int] = {}
        entries = [*self._entries.items(), *((key, entry) for key, pieces in self._pieces.items()
                                             for _, entry in pieces)]
        for key, (shard, offset, size, _) in entries:
            if shard >= self._num_shards:
                raise CorruptCheckpointError(f"{self._index}: tensor {key!r} is in shard {shard} of "
                                             f"{self._num_shards}")
            if shard not in sizes:
                sizes[shard] = self._shard(shard).size
            if offset + size > sizes[shard]:
                raise CorruptCheckpointError(
                    f"{self._data_name(shard)}: tensor {key!r} needs bytes {offset}..{offset + size} of a "
                    f"{sizes[shard]}-byte file: it is truncated")

    def _data_name(self, shard: int) -> str:
        return f"{self.path}.data-{shard:05d}-of-{self._num_shards:05d}"

    def _add(self, raw_key: bytes, value: bytes) -> None:
        try:
            key = raw_key.decode("utf-8")
        except UnicodeDecodeError:
            raise UnsupportedCheckpointError(f"{self._index}: key {raw_key!r} is not UTF-8") from None
        entry = _parse_entry(value, self._index, key)
        code, shape, slices = entry["dtype"], entry["shape"], entry["slices"]
        dtype = _DTYPES.get(code)
        if slices and (dtype is None or dtypes.is_string(dtype)):
            what = "string" if dtype is not None else _OTHER_DTYPES.get(code, f"type-{code}")
            self._notes[key] = f"a {what} variable in {len(slices)} slices, not a tensor ckpt reads"
        elif slices and dtype is not None:
            self._add_sliced(check_key(key, self._index), dtype, shape, slices)
        elif key == OBJECT_GRAPH_KEY:
            self._notes[key] = f"TensorFlow's object graph (a serialized proto of {entry['size']} bytes)"
        elif dtype is None:
            self._notes[key] = f"a {_OTHER_DTYPES.get(code, f'type-{code}')} value, not a tensor ckpt reads"
        else:
            check_key(key, self._index)
            nbytes = entry["size"]
            count = _io.expected_nbytes(np.dtype(np.uint8), shape)
            if dtypes.is_string(dtype) and count > nbytes:  # each string needs at least its length byte
                raise CorruptCheckpointError(f"{self._index}: tensor {key!r}: {count} strings cannot fit in "
                                             f"{nbytes} bytes")
            if not dtypes.is_string(dtype) and nbytes != _io.expected_nbytes(dtype, shape):
                raise CorruptCheckpointError(
                    f"{self._index}: tensor {key!r}: {dtypes.dt_name_or_none(dtype) or dtype} {list(shape)} "
                    f"needs {_io.expected_nbytes(dtype, shape)} bytes, the index gives {nbytes}")
            self._tensors[key] = TensorInfo(key, dtype, shape, nbytes)
            self._entries[key] = (entry["shard"], entry["offset"], nbytes, entry["crc32c"])

    def _add_slice(self, raw_key: bytes, value: bytes) -> None:
        """Keep one slice's entry until its variable's own entry (which lists the slices) is read."""
        try:
            name, extents = decode_slice_key(raw_key)
        except SSTableError as exc:
            raise CorruptCheckpointError(f"{self._index}: {exc}") from exc
        found = self._slices.setdefault(name, {})
        if extents in found:
            raise CorruptCheckpointError(f"{self._index}: the slice {extents} of {name!r} appears twice")
        found[extents] = _parse_entry(value, self._index, f"{name} slice {extents}")

    def _add_sliced(self, key: str, dtype: np.dtype, shape: tuple[int, ...], slices: list[bytes]) -> None:
        """A variable saved in slices (TF1 partitioners, TF2's MaxShardSizePolicy): check that its
        slices are all there, of its dtype, and tile its shape exactly; it reads as one tensor."""
        found = self._slices.get(key, {})
        pieces = []
        try:
            for raw in slices:
                extents = _parse_slice(raw, len(shape))
                entry = found.get(extents)
                if entry is None:
                    raise SSTableError(f"its slice {extents} is missing from the index")
                region = tuple((s, d if n == -1 else n) for (s, n), d in zip(extents, shape))
                lengths = tuple(n for _, n in region)
                if entry["dtype"] != _DTYPE_CODES[dtype] or entry["shape"] != lengths or \
                        entry["size"] != _io.expected_nbytes(dtype, lengths):
                    raise SSTableError(f"its slice {extents} holds {entry['size']} bytes of type {entry['dtype']} "
                                       f"{list(entry['shape'])}, not {dtype} {list(lengths)}")
                pieces.append((region, (entry["shard"], entry["offset"], entry["size"], entry["crc32c"])))
            if len(found) != len(pieces):
                raise SSTableError(f"the index holds {len(found)} slices of it, its entry lists {len(pieces)}")
            check_tiling([region for region, _ in pieces], shape, "it")
        except SSTableError as exc:
            raise CorruptCheckpointError(f"{self._index}: variable {key!r} ({dtype} {list(shape)}): {exc}") from None
        self._pieces[key] = pieces
        self._tensors[key] = TensorInfo(key, dtype, shape, _io.expected_nbytes(dtype, shape))

    def read_box_into(self, key: str, offset: Sequence[int], out: np.ndarray) -> None:
        """Read the block ``[offset, offset + out.shape)`` of tensor ``key`` into ``out`` (what
        a sharded restore asks for)."""
        info = self.info(key)
        self._read_box(info, check_box(info, offset, out.shape, self.path), out)

    def _read_box(self, info: TensorInfo, bounds: list[tuple[int, int]], out: np.ndarray) -> None:
        pieces = self._pieces.get(info.key)
        if pieces is None:
            out[...] = self.read(info.key)[tuple(slice(a, b) for a, b in bounds)]
            return
        for region, entry in pieces:
            overlap = [(max(a, s), min(b, s + n)) for (a, b), (s, n) in zip(bounds, region)]
            if all(lo < hi for lo, hi in overlap):
                piece = np.empty([n for _, n in region], info.dtype)
                self._read_entry(entry, piece, f"tensor {info.key!r} slice {region}")
                out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(overlap, bounds))] = \
                    piece[tuple(slice(lo - s, hi - s) for (lo, hi), (s, _) in zip(overlap, region))]

    def info(self, key: str) -> TensorInfo:
        if key in self._notes:
            raise KeyNotFoundError(f"{self.path}: {key!r} is not a tensor ckpt can read: {self._notes[key]}",
                                   path=self.path, key=key)
        return super().info(key)

    def _shard(self, shard: int) -> ReadableBlob:
        """The open data file of a shard (opened on first use, kept until close)."""
        if shard not in self._shards:
            name = self._data_name(shard)
            try:
                self._shards[shard] = _io.LocalFile(name)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{name}: the data file of {self.path} is missing") from None
        return self._shards[shard]

    def _read_into(self, info: TensorInfo, out: np.ndarray) -> None:
        pieces = self._pieces.get(info.key)
        if pieces is None:
            self._read_entry(self._entries[info.key], out, f"tensor {info.key!r}")
            return
        for region, entry in pieces:  # one slice at a time: memory for the largest slice only
            piece = np.empty([n for _, n in region], info.dtype)
            self._read_entry(entry, piece, f"tensor {info.key!r} slice {region}")
            out[tuple(slice(s, s + n) for s, n in region)] = piece

    def _read_entry(self, entry: tuple[int, int, int, int], out: np.ndarray, what: str) -> None:
        shard, offset, size, stored_crc = entry
        source = self._shard(shard)
        name = self._data_name(shard)
        if offset + size > source.size:
            raise CorruptCheckpointError(f"{name}: {what} needs bytes {offset}..{offset + size} of a "
                                         f"{source.size}-byte file: it is truncated")
        if dtypes.is_string(out.dtype):
            crc = _read_strings(_io.pread(source, offset, size, what), out, name, what)
        else:
            view = _io.byte_view(out)
            source.read_into(view, offset, what)
            crc = _io.crc32c(view)
        if crc != unmask(stored_crc):
            raise checksum_error(name, what, crc, unmask(stored_crc))

    def close(self) -> None:
        for f in self._shards.values():
            f.close()
        self._shards.clear()


def _parse_header(value: bytes, path: str) -> int:
    """Check the BundleHeaderProto; return the number of shards."""
    shards, endianness, min_consumer = 1, 0, 0
    try:
        for number, wire, field in fields(value):
            if number == 1 and wire == 0:
                shards = int64(field)  # type: ignore[arg-type]
            elif number == 2 and wire == 0:
                endianness = field  # type: ignore[assignment]
            elif number == 3 and wire == 2:
                for sub, sub_wire, x in fields(field):  # type: ignore[arg-type]
                    if sub == 2 and sub_wire == 0:
                        min_consumer = x  # type: ignore[assignment]
    except SSTableError as exc:
        raise CorruptCheckpointError(f"{path}: the header entry is damaged: {exc}") from exc
    if endianness != 0:
        raise UnsupportedCheckpointError(f"{path}: written on a big-endian machine; ckpt reads "
                                         "little-endian checkpoints")
    if min_consumer > _BUNDLE_VERSION:
        raise UnsupportedCheckpointError(f"{path}: needs a reader of bundle version {min_consumer}; ckpt "
                                         f"reads version {_BUNDLE_VERSION}")
    if not 1 <= shards <= 99999:
        raise CorruptCheckpointError(f"{path}: the header gives {shards} data shards")
    return shards


def _parse_entry(value: bytes, path: str, key: str) -> dict[str, Any]:
    """Decode a BundleEntryProto into dtype, shape, shard, offset, size, crc32c, slices."""
    entry: dict[str, Any] = {"dtype": 0, "shape": (), "shard": 0, "offset": 0, "size": 0, "crc32c": 0,
                             "slices": []}
    try:
        for number, wire, field in fields(value):
            if number == 1 and wire == 0:
                entry["dtype"] = field
            elif number == 2 and wire == 2:
                entry["shape"] = _parse_shape(field)  # type: ignore[arg-type]
            elif number in (3, 4, 5) and wire == 0:
                entry[{3: "shard", 4: "offset", 5: "size"}[number]] = int64(field)  # type: ignore[arg-type]
            elif number == 6 and wire == 5:
                entry["crc32c"] = field
            elif number == 7 and wire == 2:
                entry["slices"].append(field)
    except SSTableError as exc:
        raise CorruptCheckpointError(f"{path}: the entry of {key!r} is damaged: {exc}") from exc
    if min(entry["shard"], entry["offset"], entry["size"]) < 0:
        raise CorruptCheckpointError(f"{path}: the entry of {key!r} has a negative shard, offset or size")
    return entry


def _parse_shape(value: bytes) -> tuple[int, ...]:
    dims = []
    for number, wire, field in fields(value):
        if number == 2 and wire == 2:
            size = 0
            for sub, sub_wire, x in fields(field):  # type: ignore[arg-type]
                if sub == 1 and sub_wire == 0:
                    size = int64(x)  # type: ignore[arg-type]
            if size < 0:
                raise SSTableError(f"dimension of unknown size {size}")
            dims.append(size)
        elif number == 3 and wire == 0 and field:
            raise SSTableError("a shape of unknown rank")
    if len(dims) > 64:
        raise SSTableError(f"{len(dims)} dimensions")
    return tuple(dims)


def _read_strings(raw: bytes, out: np.ndarray, name: str, what: str) -> int:
    """Decode a string tensor: varint lengths, a masked crc32c of them, then the bytes.

    Returns the crc32c TensorFlow computes over it (lengths as uint32, or uint64 when larger).
    """
    count, pos, crc, lengths = out.size, 0, 0, []
    try:
        for _ in range(count):
            n, pos = varint(raw, pos)
            lengths.append(n)
            crc = _io.crc32c(n.to_bytes(4 if n < 1 << 32 else 8, "little"), crc)
    except SSTableError as exc:
        raise CorruptCheckpointError(f"{name}: {what}: {exc}") from exc
    stored = raw[pos:pos + 4]
    if len(stored) != 4 or int.from_bytes(stored, "little") != mask(crc) or \
            pos + 4 + sum(lengths) != len(raw):
        raise CorruptCheckpointError(f"{name}: {what}: the string lengths are damaged")
    crc = _io.crc32c(stored, crc)
    pos += 4
    crc = _io.crc32c(raw[pos:], crc)
    flat = out.reshape(-1)
    for i, n in enumerate(lengths):
        flat[i] = raw[pos:pos + n]
        pos += n
    return crc


def _parse_slice(raw: bytes, rank: int) -> tuple[tuple[int, int], ...]:
    """A TensorSliceProto: one Extent (start, optional length; no length = the whole dimension)."""
    extents = []
    for number, wire, field in fields(raw):
        if number == 1 and wire == 2:
            start, length = 0, -1
            for sub, sub_wire, x in fields(field):  # type: ignore[arg-type]
                if sub == 1 and sub_wire == 0:
                    start = int64(x)  # type: ignore[arg-type]
                elif sub == 2 and sub_wire == 0:
                    length = int64(x)  # type: ignore[arg-type]
            extents.append((start, length))
    if len(extents) != rank:
        raise SSTableError(f"a slice of {len(extents)} dimensions for a tensor of {rank}")
    return tuple(extents)

# --- partitioned variables and sliced tensors -----------------------------------------------------

def decode_slice_key(raw: bytes) -> tuple[str, tuple[tuple[int, int], ...]]:
    """The variable name and (start, length) per dimension an index key of one slice encodes.

    TensorFlow writes it with its OrderedCode: the number 0, the name (0x00 escaped as 00 ff,
    0xff as ff 00, ended by 00 01), the number of dimensions, then each dimension's start and
    length as signed numbers (a length of -1 means the whole dimension).
    """
    if not raw.startswith(b"\x00"):
        raise SSTableError(f"slice key {raw[:40]!r} does not start with 0")
    pos, name = 1, bytearray()
    while True:
        if pos + 1 >= len(raw):
            raise SSTableError(f"slice key {raw[:40]!r}: the name has no end")
        b = raw[pos]
        if b == 0x00 and raw[pos + 1] == 0x01:
            pos += 2
            break
        if b in (0x00, 0xff):
            if raw[pos + 1] != (0xff if b == 0x00 else 0x00):
                raise SSTableError(f"slice key {raw[:40]!r}: a bad escape in the name")
            pos += 1
        name.append(b)
        pos += 1
    dims, pos = _ordered_unsigned(raw, pos)
    if dims > 64:
        raise SSTableError(f"slice key {raw[:40]!r}: {dims} dimensions")
    extents = []
    for _ in range(dims):
        start, pos = _ordered_signed(raw, pos)
        length, pos = _ordered_signed(raw, pos)
        extents.append((start, length))
    if pos != len(raw):
        raise SSTableError(f"slice key {raw[:40]!r}: bytes after the last dimension")
    try:
        return name.decode("utf-8"), tuple(extents)
    except UnicodeDecodeError:
        raise SSTableError(f"slice key {raw[:40]!r}: the name is not UTF-8") from None


def _ordered_unsigned(raw: bytes, pos: int) -> tuple[int, int]:
    """OrderedCode's increasing unsigned number: a length byte, then that many big-endian bytes."""
    if pos >= len(raw) or raw[pos] > 8 or pos + 1 + raw[pos] > len(raw):
        raise SSTableError("a truncated number in a slice key")
    n = raw[pos]
    return int.from_bytes(raw[pos + 1:pos + 1 + n], "big"), pos + 1 + n


def _ordered_signed(raw: bytes, pos: int) -> tuple[int, int]:
    """OrderedCode's increasing signed number: the count of leading bits equal to the first (sign)
    bit gives the length in bytes; XOR-ing those bits away leaves a big-endian two's complement."""
    if pos >= len(raw):
        raise SSTableError("a truncated number in a slice key")
    head = int.from_bytes(raw[pos:pos + 2].ljust(2, b"\x00" if raw[pos] & 0x80 else b"\xff"), "big")
    negative = not head & 0x8000
    bits = head ^ 0xFFFF if negative else head
    length = 0
    while length < 16 and bits & (0x8000 >> length):
        length += 1
    if not 1 <= length <= 10 or pos + length > len(raw):
        raise SSTableError("a bad number in a slice key")
    value = int.from_bytes(raw[pos:pos + length], "big") ^ (((1 << length) - 1) << (7 * length))
    nbits = 8 * length
    if value >> (nbits - 1):
        value -= 1 << nbits
    return value, pos + length


def check_tiling(regions: list[tuple[tuple[int, int], ...]], shape: tuple[int, ...], what: str) -> None:
    """Raise SSTableError unless the boxes ((start, length) per dimension) tile ``shape`` exactly.

    Coordinates are compressed to the boxes' own boundaries, so a grid of slices costs one cell each.
    """
    cuts = [sorted({0, dim} | {s for r in regions for s in (r[d][0], r[d][0] + r[d][1])})
            for d, dim in enumerate(shape)]
    cells = 1
    for c in cuts:
        cells *= max(len(c) - 1, 1)
    if cells > 1 << 24:
        raise SSTableError(f"{what}: {len(regions)} slices cut it into more than {1 << 24} pieces")
    count = np.zeros([max(len(c) - 1, 1) for c in cuts] or [1], np.int32)
    for region in regions:
        for (start, length), dim in zip(region, shape):
            if start < 0 or length < 0 or start + length > dim:
                raise SSTableError(f"{what}: a slice {region} reaches outside its shape {list(shape)}")
        index = tuple(slice(bisect.bisect_left(c, s), bisect.bisect_left(c, s + n)) for c, (s, n) in zip(cuts, region))
        count[index or (slice(None),)] += 1
    if any(dim == 0 for dim in shape):
        return
    if count.min() != 1 or count.max() != 1:
        raise SSTableError(f"{what}: its slices " + ("overlap" if count.max() > 1 else "leave holes"))
