"""ckpt's HDF5 checkpoint format (.h5, .hdf5), and a guarded reader for other HDF5 files.

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
import json
import operator
import struct
from contextlib import closing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ckpt import dtypes
from ckpt.buffers import ALIGN_MIN_BYTES, PAGE
from ckpt.errors import (CheckpointWriteError, CorruptCheckpointError, UnsupportedCheckpointError,
                         checksum_error, checksum_message)
from ckpt.storage import ReadableBlob, WritableBlob

from . import _blocks, _h5edited, _h5struct, _io, h5plain
from ._h5head import FORMAT_NAME, MAGIC
from ._h5head import HEADER as _HEADER
from ._blocks import BlockSlicing, checksums, parse_table, table_problems
from ._codec import HDF5_VERSION, decode_strings, encode_strings, packb, unpack
from ._validation import _FILE_DTYPES
from .base import Reader, open_blob, stage
from .base import (BaseReader, FileReader, TensorInfo, all_exactly, all_lists, plain_extents,
                   check_metadata, check_shape, check_version, dtype_or_raise, key_problem, keys_plainly_valid,
                   materialize, normalize_metadata, source_chunks, validate_keys)

VERSION = HDF5_VERSION
_MAX_U64, _MAX_U32 = 2 ** 64 - 1, 2 ** 32 - 1
#: HDF5 feature level: checksummed metadata, readable by HDF5 >= 1.10.
LIBVER = ("v110", "v110")


def _h5_type(dtype: np.dtype) -> Any:
    """The HDF5 file type for a tensor dtype (little-endian; bfloat16 as a custom float)."""
    from h5py import h5t

    if dtype == dtypes.bfloat16:
        tid = h5t.IEEE_F32LE.copy()
        tid.set_fields(15, 7, 8, 0, 7)  # sign bit, exponent at bit 7 (8 bits), mantissa (7 bits)
        tid.set_size(2)
        tid.set_precision(16)
        tid.set_ebias(127)
        return tid
    return h5t.py_create(dtype.newbyteorder("<") if dtype.kind not in "bS" else dtype, logical=True)


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


def write_hdf5(blob: WritableBlob, tensors: Sequence[tuple[str, Any]],
               metadata: Mapping[str, Any]) -> None:
    """Lay out the HDF5 structure (``_h5struct``), then write it, the tensor bytes and the index
    into ``blob`` (the index, in the user block at the start, last).

    Tensors may be lazy sources (see ``base.materialize``): each is read when its bytes
    are written, so memory stays bounded by the largest tensor.
    """
    path = blob.name
    validate_keys((key for key, _ in tensors), path)
    metadata = normalize_metadata(metadata, path)
    plans: list[_Plan] = []
    new = tuple.__new__  # 10,000s of small tensors: no Python-level NamedTuple __new__ each
    for key, source in tensors:
        if type(source) is np.ndarray and source.dtype.kind != "O":  # the common case, in few calls
            dtype = source.dtype
            plans.append(new(_Plan, (key, dtype, source.shape, dtype, source.nbytes, source, None)))
            continue
        dtype, shape = np.dtype(source.dtype), tuple(source.shape)
        if dtypes.is_string(dtype):
            fixed, lengths = encode_strings(materialize(source))  # small: encoded up front
            plans.append(_Plan(key, dtype, shape, fixed.dtype, fixed.nbytes, fixed, lengths))
        else:
            plans.append(_Plan(key, dtype, shape, dtype, _io.expected_nbytes(dtype, shape), source, None))
    entries = [_entry(plan, _MAX_U64, _MAX_U32) for plan in plans]  # the largest values first: a size bound
    block_bytes = _blocks.BLOCK_BYTES  # (looked up now: the golden files use small blocks)
    blocks = {plan.key: bytes(4 * -(-plan.nbytes // block_bytes)) for plan in plans
              if plan.nbytes > block_bytes and plan.file_dtype.kind != "S"}
    bound = _HEADER.size + len(_index_bytes(entries, metadata, _MAX_U64, _MAX_U32, blocks, block_bytes))
    userblock = max(512, 1 << (bound - 1).bit_length())
    if any(plan.nbytes >= ALIGN_MIN_BYTES for plan in plans):
        userblock = max(userblock, PAGE)  # so that aligned HDF5 addresses are aligned file offsets
    structure = _structure(plans, metadata, userblock)
    if structure is None:  # an attribute too big for the structures ckpt writes: libhdf5 lays out a local file
        stage(lambda local, _t, _m: _write_local(local, plans, metadata, userblock, entries, blocks,
                                                      block_bytes), blob, tensors, metadata)
        return
    # front to back (the WritableBlob contract): the structure's head, the data, the metadata
    # after it, and last the user block before the head
    blob.write_at(structure.head, userblock)
    extents = _write_data(blob, plans, structure.offsets, entries, blocks, block_bytes)
    blob.write_pieces(structure.metadata, structure.metadata_offset)
    size = blob.size
    known = [(userblock, structure.head), (structure.metadata_offset, b"".join(structure.metadata))]
    meta_crc = _nondata_crc(userblock, size, extents, known)
    _write_index(blob, entries, metadata, size, meta_crc, blocks, block_bytes, userblock)


def _write_local(path: str, plans: list[_Plan], metadata: dict[str, Any], userblock: int,
                 entries: list[Any], blocks: dict[str, bytes], block_bytes: int) -> None:
    """Write the file at ``path`` with libhdf5 laying out its structure; the metadata checksum
    is read back from the file (libhdf5 wrote those bytes)."""
    offsets = _write_structure(path, plans, metadata, userblock)
    with _io.LocalSink(path, create=False) as blob:
        extents = _write_data(blob, plans, offsets, entries, blocks, block_bytes)
        size = blob.size
        try:
            with _io.LocalFile(path) as written:
                meta_crc = _metadata_crc(written, userblock, size, extents)
        except CorruptCheckpointError as exc:  # an I/O error reading back what was just written
            raise CheckpointWriteError(f"{path}: writing failed: {exc}") from exc
        _write_index(blob, entries, metadata, size, meta_crc, blocks, block_bytes, userblock)


def _write_structure(path: str, plans: list[Any], metadata: dict[str, Any],
                     userblock: int) -> list[int | None]:
    """Create the file's groups and datasets with libhdf5 (space allocated, no data); return
    data offsets. Only for files whose attributes _h5struct cannot hold (lengths of more than
    ~8,000 strings); version 2 object headers store them densely."""
    import h5py
    from h5py import h5d, h5p, h5s

    lcpl = h5p.create(h5p.LINK_CREATE)
    lcpl.set_create_intermediate_group(True)
    offsets = []
    try:
        # large datasets start page-aligned (HDF5 counts from the user block's end, a multiple of PAGE)
        aligned = {"alignment_threshold": ALIGN_MIN_BYTES, "alignment_interval": PAGE} \
            if userblock >= PAGE else {}
        with h5py.File(path, "w", libver=LIBVER, userblock_size=userblock, locking=False, **aligned) as f:
            f.attrs["ckpt_format"] = FORMAT_NAME
            f.attrs["ckpt_version"] = VERSION
            f.attrs["ckpt_metadata"] = json.dumps(metadata)
            for key, dt, shape, file_dtype, nbytes, _, lengths in plans:
                dcpl = h5p.create(h5p.DATASET_CREATE)
                dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)  # fixed offsets before data is written
                dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
                dcpl.set_obj_track_times(False)  # no timestamps: same tensors, same bytes
                space = h5s.create_simple(shape) if shape else h5s.create(h5s.SCALAR)
                dsid = h5d.create(f.id, key.encode("utf-8"), _h5_type(file_dtype), space,
                                  dcpl=dcpl, lcpl=lcpl)
                if dtypes.is_string(dt) or dt == dtypes.bfloat16:
                    attrs = h5py.Dataset(dsid).attrs
                    attrs["ckpt_dtype"] = dtypes.dtype_name(dt)
                    if lengths is not None:
                        attrs["ckpt_lengths"] = np.asarray(lengths, dtype=np.uint64)
                offsets.append(dsid.get_offset() if nbytes else None)
    except OSError:
        raise
    except Exception as exc:  # h5py reports some failures as RuntimeError/ValueError
        raise CheckpointWriteError(f"{path}: HDF5 could not write the file: {exc}") from exc
    return offsets


_TYPE_MESSAGES: dict[np.dtype, bytes] = {}


def _structure(plans: list[_Plan], metadata: dict[str, Any], userblock: int) -> _h5struct.Layout | None:
    """The file's HDF5 structure as ckpt writes it, or None when it needs libhdf5's dense attributes."""
    datasets = []
    new, none = tuple.__new__, ()  # 10,000s of small tensors: no Python-level NamedTuple __new__ each
    for plan in plans:
        message = _TYPE_MESSAGES.get(plan.file_dtype)
        if message is None:
            message = _TYPE_MESSAGES[plan.file_dtype] = _h5struct.dtype_message(_h5_type(plan.file_dtype))
        attrs: Sequence[tuple[str, Any]] = none
        if plan.file_dtype.kind in "SV":  # fixed-width bytes of a string tensor, or bfloat16
            attrs = [("ckpt_dtype", dtypes.dtype_name(plan.dtype))]
            if plan.lengths is not None:
                attrs.append(("ckpt_lengths", np.asarray(plan.lengths, dtype=np.uint64)))
        datasets.append(new(_h5struct.Dataset, (plan.key, message, plan.shape, plan.nbytes, attrs)))
    root = [("ckpt_format", FORMAT_NAME), ("ckpt_version", VERSION), ("ckpt_metadata", json.dumps(metadata))]
    try:
        return _h5struct.layout(datasets, root, userblock, ALIGN_MIN_BYTES if userblock >= PAGE else 1 << 62, PAGE)
    except ValueError:
        return None


class _Plan(NamedTuple):
    """One tensor to write: its file dtype (fixed-width bytes for strings) and data source."""

    key: str
    dtype: np.dtype
    shape: tuple[int, ...]
    file_dtype: np.dtype
    nbytes: int
    source: Any
    lengths: list[int] | None


_DTYPE_NAMES: dict[np.dtype, str] = {}


def _entry(plan: _Plan, offset: int, crc: int) -> list[Any]:
    name = _DTYPE_NAMES.get(plan.dtype)
    if name is None:
        name = _DTYPE_NAMES[plan.dtype] = dtypes.dtype_name(plan.dtype)
    entry = [plan.key, name, list(plan.shape), offset, plan.nbytes, crc]
    if plan.dtype.kind == "O":  # byte strings: their fixed width and exact lengths
        entry += [plan.file_dtype.itemsize, plan.lengths]
    return entry


def _index_bytes(entries: list[Any], metadata: dict[str, Any], size: int, meta_crc: int,
                 blocks: dict[str, bytes], block_bytes: int) -> bytes:
    return packb({"format": FORMAT_NAME, "version": VERSION, "file_size": size, "metadata_crc32c": meta_crc,
                  "metadata": metadata, "tensors": entries, "block_bytes": block_bytes, "block_crcs": blocks})


_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


def _metadata_crc(source: ReadableBlob, start: int, size: int, extents: Sequence[tuple[Any, ...]]) -> int:
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


def _write_data(blob: WritableBlob, plans: list[_Plan], offsets: list[int | None], entries: list[Any],
                blocks: dict[str, bytes], block_bytes: int) -> list[tuple[int, int]]:
    """Write every tensor's bytes at its offset, front to back; fill in each entry's offset and
    crc32c (and ``blocks``); return the data extents ``(offset, nbytes)``."""
    path = blob.name
    extents = []
    runs = _io.Runs(blob)  # small tensors back to back in the file: written by one pwritev
    byte_view, crc32c = _io.byte_view, _io.crc32c
    for plan, offset, entry in zip(plans, offsets, entries):
        data = plan.source
        if type(data) is not np.ndarray:
            runs.flush()  # a lazy source's predecessors are written before it is read
            stream = source_chunks(data)
            if stream is not None:  # a streaming source: its bytes pass through in chunks (bounded memory)
                entry[5], packed = _write_chunks(blob, stream, offset, plan, block_bytes, path)
                entry[3] = offset or 0
                if plan.nbytes:
                    extents.append((offset or 0, plan.nbytes))
                if packed is not None:
                    blocks[plan.key] = packed
                continue
            data = materialize(data)
        if not data.flags.c_contiguous:
            data = _io.c_contiguous(data)
        if data.dtype != plan.file_dtype or data.shape != plan.shape:
            raise ValueError(f"{path}: tensor {plan.key!r} gave {data.dtype} {data.shape}, it "
                             f"declared {plan.file_dtype} {plan.shape}")
        view = byte_view(data)
        n = len(view)
        if n <= block_bytes or plan.file_dtype.kind == "S":  # one block, or strings: no block table
            pending, crc = None, crc32c(view)
        else:  # a numeric tensor's crc32c and block checksums overlap with its write
            pending, crc = checksums(view, block_bytes), 0
        if n:
            assert offset is not None  # every tensor with data has a place
            # the caller's own array (not a copy, not encoded strings) is lent to the blob
            runs.write(view, offset, data is plan.source and plan.lengths is None)
            extents.append((offset, n))
        if pending is not None:
            crc, packed = pending()
            if packed is not None:
                blocks[plan.key] = packed
        entry[3], entry[5] = offset or 0, crc  # the real ones
    runs.flush()
    return extents


def _write_chunks(blob: WritableBlob, stream: Iterator[memoryview], offset: int | None, plan: _Plan,
                  block_bytes: int, path: str) -> tuple[int, bytes | None]:
    """Write a streamed numeric tensor's chunks at its offset, each at once (chunks come from
    reused buffers); return its crc32c and packed block checksums (None for one block)."""
    running = _blocks.RunningChecksums(block_bytes)
    for view in stream:
        if not len(view):
            continue
        if running.nbytes + len(view) > plan.nbytes:
            raise ValueError(f"{path}: tensor {plan.key!r} gave more than the {plan.nbytes} bytes its dtype and "
                             "shape hold")
        assert offset is not None  # every tensor with data has a place
        blob.write_at(view, offset + running.nbytes)
        running.update(view)
    if running.nbytes != plan.nbytes:
        raise ValueError(f"{path}: tensor {plan.key!r} gave {running.nbytes} bytes; its dtype and shape hold "
                         f"{plan.nbytes}")
    return running.result()


def _write_index(blob: WritableBlob, entries: list[Any], metadata: dict[str, Any], size: int, meta_crc: int,
                 blocks: dict[str, bytes], block_bytes: int, userblock: int) -> None:
    """Write the user block (ckpt's header and index) at the start: the blob's head, written last."""
    index = _index_bytes(entries, metadata, size, meta_crc, blocks, block_bytes)
    head = _HEADER.pack(MAGIC, VERSION, userblock, len(index), _io.crc32c(index), 0)
    head = head[:-4] + struct.pack("<I", _io.crc32c(head[:-4]))
    blob.write_at(head + index, 0)


def _nondata_crc(start: int, size: int, extents: list[tuple[int, int]], known: list[tuple[int, bytes]]) -> int:
    """``_metadata_crc`` of a file not read back: its non-data bytes are the ``known`` writes
    ``(offset, bytes)`` and zeros (bytes never written)."""
    crc, pos = 0, start
    known = sorted(known)

    def add(a: int, b: int) -> None:  # the crc32c of [a, b), which holds no tensor data
        nonlocal crc
        for offset, data in known:
            lo, hi = max(a, offset), min(b, offset + len(data))
            if lo >= hi:
                continue
            if lo > a:
                crc = _io.crc32c(bytes(lo - a), crc)
            crc = _io.crc32c(memoryview(data)[lo - offset:hi - offset], crc)
            a = hi
        if b > a:
            crc = _io.crc32c(bytes(b - a), crc)

    for offset, n in sorted(extents):
        if offset > pos:
            add(pos, offset)
        pos = offset + n
    add(pos, size)
    return crc


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
        return _metadata_crc(self._source, self._userblock, size, self._extents) == self._meta_crc

    def data_extents(self, key: str) -> list[tuple[int, int]] | None:
        info = self.info(key)
        return None if dtypes.is_string(info.dtype) else [(info.extra.offset, info.nbytes)]

    def block_checksums(self, key: str) -> tuple[np.ndarray, int] | None:
        crcs = self._blocks.get(key)
        return None if crcs is None else (crcs, self._block_bytes)

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
        if _metadata_crc(self._source, self._userblock, self._source.size, self._extents) != self._meta_crc:
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
