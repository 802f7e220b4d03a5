"""Reading ckpt's HDF5 checkpoint format (.h5, .hdf5), and a guarded reader for other HDF5 files
(``formats/_h5write.py`` writes the format).

A ckpt HDF5 file is a standard HDF5 file (plain h5py shows every value):

* one contiguous, uncompressed dataset per tensor at the path of its key
  ("encoder/dense/kernel" -> groups encoder/dense, dataset kernel);
* bfloat16 as an HDF5 16-bit float type with bfloat16's bit layout, byte strings as
  fixed-width NUL-padded strings; both also carry a ``ckpt_dtype`` attribute;
* root attributes ``ckpt_format``, ``ckpt_version`` and ``ckpt_metadata`` (JSON);
* an HDF5 *user block* (bytes HDF5 skips) that starts with ckpt's header and index: each
  tensor's dtype, shape, byte offset, size and crc32c (and, above 1 MiB, a crc32c per MiB,
  so ``read_slice`` verifies just the blocks it reads), the file size, and one crc32c over
  every byte that is not tensor data.

ckpt reads its own files through that index with positioned reads straight into the
caller's buffers, so damaged bytes never reach libhdf5; every open checks that the HDF5
structure is still the one ckpt wrote. HDF5 files without the index (written by other tools)
are read by ``formats.h5plain``, ckpt files an HDF5 tool rewrote by ``formats._h5edited``.
docs/formats.md specifies the layout byte for byte.

Example:
    >>> import numpy as np, tempfile, os
    >>> from ckpt.formats.builtin import Hdf5Format
    >>> path = os.path.join(tempfile.mkdtemp(), "t.h5")
    >>> Hdf5Format().write(path, [("enc/w", np.ones((2, 2), np.float32))], {"step": 3})
    >>> with Hdf5Format().open(path) as r:
    ...     r.read("enc/w").sum(), r.metadata
    (np.float32(4.0), {'step': 3})
"""

from __future__ import annotations

import itertools
import operator
from contextlib import closing
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ckpt import dtypes
from ckpt.errors import (CorruptCheckpointError, UnsupportedCheckpointError,
                         checksum_error, checksum_message)
from ckpt.storage import ReadableBlob

from . import _h5edited, _io, h5plain
from ._h5head import FORMAT_NAME, MAGIC
from ._h5head import HEADER as _HEADER
from ._blocks import BlockSlicing, parse_table, table_problems
from ._codec import HDF5_VERSION, decode_strings, unpack
from ._validation import _FILE_DTYPES
from .base import Reader, open_blob
from .base import (BaseReader, FileReader, TensorInfo, all_exactly, all_lists, plain_extents,
                   check_metadata, check_shape, check_version, dtype_or_raise, key_problem, keys_plainly_valid)

VERSION = HDF5_VERSION
_MAX_U32 = 2 ** 32 - 1


def open_hdf5(path: str, blob: ReadableBlob | None = None, declined: Reader | None = None) -> BaseReader:
    """The reader of an HDF5 file: ckpt's own (read through ``blob``), one an HDF5 tool rewrote,
    or a foreign one (through h5py; ``declined`` is the H5pyReader keras opened, if it did)."""
    source = open_blob(path) if blob is None else blob
    try:
        return Hdf5Reader(path, source)  # ckpt's own files: the reader reads ``source``, checks the magic
    except _NotCkptFile:
        pass
    except _Rewritten as rewrite:
        source.close()  # libhdf5 reads the file through its own handle
        if not rewrite.local:  # libhdf5 reads local files only
            raise UnsupportedCheckpointError(f"{rewrite}; download it to read it through h5py") from None
        return _h5edited.RewrittenReader(path, rewrite.tensors, rewrite.metadata)
    except BaseException:
        source.close()
        raise
    with closing(source):  # libhdf5 reads the file through its own handle
        return h5plain.open_foreign(path, source, declined)


_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


def metadata_crc(source: ReadableBlob, start: int, size: int, extents: Sequence[tuple[Any, ...]]) -> int:
    """crc32c over every byte in [start, size) that is not tensor data, in file order.

    ``extents``: ``(offset, nbytes, ...)`` of every tensor with data, disjoint. Every open checks
    it, so the gaps between them are found with numpy (small tensors lie back to back: few gaps).
    """
    crc, pos = 0, start
    if extents:
        offsets = np.fromiter(map(_FIRST, extents), np.int64, len(extents))
        ends = offsets + np.fromiter(map(_SECOND, extents), np.int64, len(extents))
        if (offsets[1:] < offsets[:-1]).any():  # the readers' extents are in file order already
            order = np.argsort(offsets, kind="stable")
            offsets, ends = offsets[order], ends[order]
        starts = np.concatenate((np.array([start], dtype=np.int64), ends[:-1]))
        gaps = np.flatnonzero(offsets > starts)
        for a, b in zip(starts[gaps].tolist(), offsets[gaps].tolist()):
            crc = _io.checksum_range(source, a, b - a, "HDF5 metadata", crc)
        pos = int(ends[-1])
    return _io.checksum_range(source, pos, size - pos, "HDF5 metadata", crc)


class _NotCkptFile(CorruptCheckpointError):
    """Raised by Hdf5Reader for a file without ckpt's magic: open_hdf5 looks further."""

    def __init__(self, path: str, head: bytes) -> None:
        super().__init__(f"{path}: not a ckpt HDF5 file (its user block holds no ckpt header)")
        self.head = head


class _Rewritten(CorruptCheckpointError):
    """Raised by Hdf5Reader for a file an HDF5 tool rewrote: open_hdf5 reads it through h5py,
    checking it against the index (``_h5edited``)."""

    def __init__(self, path: str, tensors: dict[str, TensorInfo], metadata: dict[str, Any], local: bool) -> None:
        super().__init__(f"{path}: an HDF5 tool rewrote this file after ckpt saved it (h5repack, or an h5py "
                         "edit that grew it), so ckpt's index no longer says where its tensors are")
        self.tensors, self.metadata, self.local = tensors, metadata, local


class Hdf5Location(NamedTuple):
    """Where a tensor's bytes are in a ckpt HDF5 file (TensorInfo.extra of Hdf5Reader)."""

    offset: int
    crc32c: int
    #: Width of a string tensor's fixed-width items (None for numbers).
    itemsize: int | None
    #: Exact lengths of string items when NUL padding would hide trailing NULs.
    lengths: list[int] | None


_EXTRA, _OFFSET, _CRC, _ITEMSIZE = (operator.attrgetter(name) for name in ("extra", "offset", "crc32c", "itemsize"))


class Hdf5Reader(BlockSlicing, FileReader):
    """Reads a ckpt HDF5 file through its user-block index, without libhdf5 (whole tensors, or
    blocks of them: ``read_slice``)."""

    format_name = "hdf5"
    _checks_shapes = True  # every entry's shape is bounded while the index is parsed

    def _open(self) -> None:
        path, source = self.path, self._source
        size = source.size
        head = _io.pread(source, 0, min(size, _HEADER.size), "the header")
        if not head.startswith(MAGIC):
            raise _NotCkptFile(path, head)
        if size < _HEADER.size:
            raise CorruptCheckpointError(f"{path}: {size} bytes is too short for a ckpt HDF5 file: "
                                         "it is truncated")
        _, version, userblock, index_len, index_crc, head_crc = _HEADER.unpack(head)
        if _io.crc32c(head[:-4]) != head_crc:
            raise CorruptCheckpointError(f"{path}: the ckpt header in the HDF5 user block is damaged")
        check_version(version, VERSION, "HDF5", path)
        if userblock < 512 or userblock & (userblock - 1) or _HEADER.size + index_len > userblock \
                or userblock > size:
            raise CorruptCheckpointError(f"{path}: the header describes a {userblock}-byte user block "
                                         f"with a {index_len}-byte index in a {size}-byte file: it is "
                                         "truncated or damaged")
        raw = _io.pread(source, _HEADER.size, index_len, "the index")
        if _io.crc32c(raw) != index_crc:
            raise checksum_error(path, "the index")
        index = _unpack_index(raw, path)
        if index.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError(f"{path}: the user block does not hold a ckpt HDF5 index")
        check_version(index.get("version"), VERSION, "HDF5", path)
        if index["version"] != version:
            raise CorruptCheckpointError(f"{path}: the header says layout version {version}, the index "
                                         f"{index['version']}")
        file_size, metadata = index.get("file_size"), index.get("metadata")
        self._meta_crc = index.get("metadata_crc32c")
        entries = index.get("tensors")
        if not isinstance(metadata, dict) or not isinstance(entries, list) or \
                not isinstance(file_size, int) or not isinstance(self._meta_crc, int):
            raise CorruptCheckpointError(f"{path}: the index lacks its metadata, tensors or sizes")
        data_start = self._userblock = userblock
        self._metadata = check_metadata(metadata, path)
        # checked against the file ckpt wrote; the file at hand is compared with it next
        self._tensors, self._extents = _parse_entries(entries, path, data_start, file_size)
        self._blocks, self._block_bytes = parse_table(index, self._tensors, path) if version >= 2 else ({}, 0)
        if file_size != size:
            # (a file whose structure still matches has a damaged size field, not a rewrite)
            if _h5edited.rewritten(source, userblock, size) and not self._structure_intact(size):
                raise _Rewritten(path, self._tensors, self._metadata, isinstance(source, _io.LocalFile))
            raise CorruptCheckpointError(
                f"{path}: the file is {size} bytes but was written as {file_size} bytes: it was "
                "truncated or modified after ckpt saved it")
        # the HDF5 structure is what h5py reads: an edit in place (h5py) must not leave the index answering
        if not self._structure_intact(size):
            raise CorruptCheckpointError(
                f"{path}: the HDF5 structure (groups, dataset headers, attributes) changed after ckpt saved the "
                "file: it was edited in place (e.g. with h5py) or damaged, so ckpt's index no longer describes it "
                "and nothing is read. To keep an edit, rewrite the file into a new one (h5repack IN OUT): ckpt "
                "reads a rewritten file through h5py and checks every tensor against the checksum it saved")

    def _structure_intact(self, size: int) -> bool:
        """Whether the first ``size`` bytes hold, besides tensor data, exactly the bytes ckpt wrote."""
        if self._extents and max(offset + n for offset, n, _ in self._extents) > size:
            return False
        return metadata_crc(self._source, self._userblock, size, self._extents) == self._meta_crc

    def data_extents(self, key: str) -> list[tuple[int, int]] | None:
        info = self.info(key)
        return None if dtypes.is_string(info.dtype) else [(info.extra.offset, info.nbytes)]

    def block_checksums(self, key: str) -> tuple[np.ndarray, int] | None:
        crcs = self._blocks.get(key)
        return None if crcs is None else (crcs, self._block_bytes)

    def read_matched(self, handles: Sequence[Any], buffers: Sequence[np.ndarray]) -> None:
        extras = list(map(_EXTRA, handles))
        if not isinstance(self._source, _io.LocalFile) or list(map(_ITEMSIZE, extras)).count(None) != len(extras):
            super().read_matched(handles, buffers)  # byte strings, or not a local file
            return
        # numbers from a local file: preadv into the arrays themselves (no byte view per tensor)
        crcs = self._source.read_buffers(list(map(_OFFSET, extras)), buffers,
                                         lambda i: f"tensor {handles[i].key!r}", _io.byte_view)
        expected = list(map(_CRC, extras))
        if crcs != expected:  # one list comparison for all; the first tensor that differs is named
            i = next(i for i, (got, crc) in enumerate(zip(crcs, expected)) if got != crc)
            raise checksum_error(self.path, f"tensor {handles[i].key!r}", crcs[i], expected[i], key=handles[i].key)

    def _read_many(self, pairs: list[tuple[TensorInfo, np.ndarray]]) -> None:
        spans: list[tuple[int, memoryview]] = []
        strings: dict[int, np.ndarray] = {}  # span index -> the fixed-width bytes read for it
        byte_view = _io.byte_view
        for info, out in pairs:
            offset, itemsize = info.extra.offset, info.extra.itemsize
            if itemsize is None:  # numeric: straight into the caller's buffer
                spans.append((offset, byte_view(out)))
            else:
                raw = strings[len(spans)] = np.empty(info.shape, dtype=f"S{itemsize}")
                spans.append((offset, byte_view(raw)))
        crcs = self._source.read_spans(spans, lambda i: f"tensor {pairs[i][0].key!r}")
        for (info, _), crc in zip(pairs, crcs):
            if crc != info.extra.crc32c:
                raise checksum_error(self.path, f"tensor {info.key!r}", crc, info.extra.crc32c, key=info.key)
        for i, raw in strings.items():
            info, out = pairs[i]
            flat = out.reshape(-1)
            for j, item in enumerate(decode_strings(raw, info.extra.lengths)):
                flat[j] = item

    def verify(self, progress: Callable[[int], None] | None = None) -> list[str]:
        problems = []
        for key, info in self._tensors.items():
            offset, expected = info.extra.offset, info.extra.crc32c
            got = _io.checksum_range(self._source, offset, info.nbytes, f"tensor {key!r}")
            if got != expected:
                problems.append(checksum_message(self.path, f"tensor {key!r}", got, expected))
            if progress is not None:
                progress(info.nbytes)
        if metadata_crc(self._source, self._userblock, self._source.size, self._extents) != self._meta_crc:
            problems.append(checksum_message(self.path, "the HDF5 structure (groups, dataset headers, attributes)"))
        return problems + table_problems(self.path, self._blocks, self._tensors, self._block_bytes)


def _unpack_index(raw: bytes, path: str) -> dict[str, Any]:
    index = unpack(raw, path, "the index")
    if not isinstance(index, dict):
        raise CorruptCheckpointError(f"{path}: the index is not a map")
    return index


def _parse_entries(entries: list[Any], path: str, data_start: int,
                   size: int) -> tuple[dict[str, TensorInfo], list[tuple[int, int, str]]]:
    """Validate every index entry; return them by key, and their data extents in file order.

    An index as ckpt writes it is checked on all entries at once (``_parse_plain_entries``);
    anything else entry by entry (``_check_entries``).
    """
    return _parse_plain_entries(entries, data_start, size) or _check_entries(entries, path, data_start, size)


def _check_entries(entries: list[Any], path: str, data_start: int,
                   size: int) -> tuple[dict[str, TensorInfo], list[tuple[int, int, str]]]:
    """``_parse_entries`` one entry at a time: numeric entries that are plainly valid take the
    inline path; anything else goes through ``_parse_entry``, which names the problem."""
    tensors: dict[str, TensorInfo] = {}
    extents: list[tuple[int, int, str]] = []
    last_end, ordered, limit = 0, True, _MAX_U32
    for entry in entries:
        info = None
        if type(entry) is list and len(entry) == 6:
            key, name, shape, offset, nbytes, crc = entry
            dtype = _FILE_DTYPES.get(name) if type(name) is str else None
            if dtype is not None and dtype.kind != "O" and type(shape) is list and len(shape) <= 64 and \
                    type(offset) is int and type(nbytes) is int and type(crc) is int and 0 <= crc <= limit \
                    and not key_problem(key):
                n = dtype.itemsize
                for d in shape:
                    if type(d) is not int or d < 1:  # zero or odd dimensions: the full check
                        n = -1
                        break
                    n *= d
                if n == nbytes and data_start <= offset and offset + nbytes <= size:
                    info = TensorInfo(key, dtype, tuple(shape), nbytes, Hdf5Location(offset, crc, None, None))
        if info is None:
            info = _parse_entry(entry, path, data_start, size)
        key = info.key
        if key in tensors:
            raise CorruptCheckpointError(f"{path}: tensor {key!r} appears twice in the index")
        tensors[key] = info
        if info.nbytes:
            offset = info.extra.offset
            ordered = ordered and offset >= last_end
            last_end = offset + info.nbytes
            extents.append((offset, info.nbytes, key))
    if not ordered:  # ckpt writes data in index order; any other order must not overlap
        extents.sort()
        for (a_off, a_n, a_key), (b_off, _, b_key) in itertools.pairwise(extents):
            if a_off + a_n > b_off:
                raise CorruptCheckpointError(f"{path}: tensors {a_key!r} and {b_key!r} overlap in the file")
    return tensors, extents


def _parse_plain_entries(entries: list[Any], data_start: int,
                         size: int) -> tuple[dict[str, TensorInfo], list[tuple[int, int, str]]] | None:
    """``_parse_entries`` for an index as ckpt writes it, checked on all entries at once.

    Covers numeric tensors without a zero dimension, in file order: every check of the
    per-entry loop, done with C string searches and numpy over whole columns. Returns None
    for anything else, or anything wrong: the loop then names the problem.
    """
    if not entries or not all_lists(entries, 6):
        return None
    keys, names, shapes, offsets, sizes, crcs = zip(*entries)
    if not keys_plainly_valid(keys) or not all_exactly(names, str):
        return None
    # not ``None in found``: that compares with ==, and np.dtype("float64") == None is True
    if not _FILE_DTYPES.keys() >= set(names):
        return None
    found = list(map(_FILE_DTYPES.__getitem__, names))
    if plain_extents(shapes, offsets, sizes, crcs, found, data_start, size) is None:
        return None
    new = tuple.__new__  # NamedTuples built without their Python-level __new__
    locations = map(new, itertools.repeat(Hdf5Location), zip(offsets, crcs, _NONES, _NONES))
    tensors = dict(zip(keys, map(new, itertools.repeat(TensorInfo),
                                 zip(keys, found, map(tuple, shapes), sizes, locations))))
    if len(tensors) != len(entries):  # a key given twice: the loop names it
        return None
    return tensors, list(zip(offsets, sizes, keys))


_NONES = itertools.repeat(None)


def _parse_entry(entry: Any, path: str, data_start: int, size: int) -> TensorInfo:
    if not isinstance(entry, list) or len(entry) not in (6, 8):
        raise CorruptCheckpointError(f"{path}: malformed index entry {str(entry)[:80]}")
    key = entry[0]
    problem = key_problem(key)
    if problem:
        raise CorruptCheckpointError(f"{path}: invalid tensor key {key!r} in the index: {problem}")
    dtype = dtype_or_raise(entry[1], path, key)
    shape = check_shape(entry[2], path, key)
    offset, nbytes, crc = entry[3:6]
    if not all(isinstance(x, int) and x >= 0 for x in (offset, nbytes, crc)) or crc > _MAX_U32:
        raise CorruptCheckpointError(f"{path}: tensor {key!r}: malformed offset, size or checksum")
    itemsize, lengths = None, None
    if dtypes.is_string(dtype):
        if len(entry) != 8:
            raise CorruptCheckpointError(f"{path}: tensor {key!r}: a string entry needs a width")
        itemsize, lengths = entry[6], entry[7]
        count = _io.expected_nbytes(np.dtype(np.uint8), shape)
        if not isinstance(itemsize, int) or itemsize < 1 or nbytes != itemsize * count or (
                lengths is not None and (not isinstance(lengths, list) or len(lengths) != count or not all(
                    isinstance(n, int) and 0 <= n <= itemsize for n in lengths))):
            raise CorruptCheckpointError(f"{path}: tensor {key!r}: malformed string layout")
    elif nbytes != _io.expected_nbytes(dtype, shape):
        raise CorruptCheckpointError(
            f"{path}: tensor {key!r}: {dtypes.dtype_name(dtype)} {list(shape)} needs "
            f"{_io.expected_nbytes(dtype, shape)} bytes, the index gives {nbytes}")
    if nbytes and (offset < data_start or offset + nbytes > size):
        raise CorruptCheckpointError(f"{path}: tensor {key!r}: data at {offset} (+{nbytes} bytes) lies "
                                     f"outside the file's data area [{data_start}, {size})")
    return TensorInfo(key, dtype, shape, nbytes, Hdf5Location(offset, crc, itemsize, lengths))
