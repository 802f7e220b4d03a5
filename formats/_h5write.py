"""Writing ckpt's HDF5 checkpoint format (``formats/hdf5.py`` reads it; docs/formats.md specifies it).

The writer lays out the HDF5 structure itself (``_h5struct``: one contiguous dataset per tensor,
groups from the keys, the root attributes), streams each tensor's bytes into the blob front to
back with its checksums, and writes last the index in the user block at the start. Only an
attribute too big for the structures ckpt lays out makes libhdf5 write the file (a staged local
file, ``_write_local``).

Example:
    >>> import numpy as np, tempfile, os
    >>> from ckpt.formats import _io, hdf5
    >>> path = os.path.join(tempfile.mkdtemp(), "t.h5")
    >>> with _io.LocalSink(path) as blob:
    ...     write_hdf5(blob, [("w", np.arange(3.0))], {})
    >>> with hdf5.open_hdf5(path) as r:
    ...     r.read("w").tolist()
    [0.0, 1.0, 2.0]
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ckpt import dtypes
from ckpt.buffers import ALIGN_MIN_BYTES, PAGE
from ckpt.errors import CheckpointWriteError, CorruptCheckpointError
from ckpt.storage import WritableBlob

from . import _blocks, _h5struct, _io
from ._h5head import FORMAT_NAME, MAGIC, SCOPE_TENSOR
from ._h5head import HEADER as _HEADER
from ._blocks import checksums
from ._codec import HDF5_VERSION, encode_strings, packb
from ._validation import tensor_scopes
from ._writing import checked_checksums
from .base import materialize, source_chunks, stage

VERSION = HDF5_VERSION
_MAX_U64, _MAX_U32 = 2 ** 64 - 1, 2 ** 32 - 1
#: HDF5 feature level: checksummed metadata, readable by HDF5 >= 1.10.
LIBVER = ("v110", "v110")



def _h5_type(dtype: np.dtype) -> Any:
    """The HDF5 file type for a tensor dtype (little-endian; bfloat16 as a custom float)."""
    from h5py import h5t  # lazy: only the libhdf5 path below needs h5py

    if dtype == dtypes.bfloat16:
        tid = h5t.IEEE_F32LE.copy()
        tid.set_fields(15, 7, 8, 0, 7)  # sign bit, exponent at bit 7 (8 bits), mantissa (7 bits)
        tid.set_size(2)
        tid.set_precision(16)
        tid.set_ebias(127)
        return tid
    return h5t.py_create(dtype.newbyteorder("<") if dtype.kind not in "bS" else dtype, logical=True)


def write_hdf5(blob: WritableBlob, tensors: Sequence[tuple[str, Any]], metadata: Mapping[str, Any],
               block_bytes: int = _blocks.BLOCK_BYTES) -> None:
    """Lay out the HDF5 structure (``_h5struct``), then write it, the tensor bytes and the index
    into ``blob`` (the index, in the user block at the start, last). Keys and metadata come
    validated (``WritableFormat.write_blob``); tensors over ``block_bytes`` get a checksum per block.

    Tensors may be lazy sources (see ``base.materialize``): each is read when its bytes
    are written, so memory stays bounded by the largest tensor.
    """
    metadata = dict(metadata)
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
    paths = dataset_paths([plan.key for plan in plans], blob.name)
    entries = [_entry(plan, _MAX_U64, _MAX_U32) for plan in plans]  # the largest values first: a size bound
    blocks = {plan.key: bytes(4 * -(-plan.nbytes // block_bytes)) for plan in plans
              if plan.nbytes > block_bytes and plan.file_dtype.kind != "S"}
    bound = _HEADER.size + len(_index_bytes(entries, metadata, _MAX_U64, _MAX_U32, blocks, block_bytes))
    userblock = max(512, 1 << (bound - 1).bit_length())
    if any(plan.nbytes >= ALIGN_MIN_BYTES for plan in plans):
        userblock = max(userblock, PAGE)  # so that aligned HDF5 addresses are aligned file offsets
    structure = _structure(plans, paths, metadata, userblock)
    if structure is None:  # an attribute too big for the structures ckpt writes: libhdf5 lays out a local file
        stage(lambda local, _t, _m: _write_local(local, plans, paths, metadata, userblock, entries, blocks,
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


def dataset_paths(keys: list[str], where: str) -> list[str]:
    """Each key's HDF5 dataset path: the key itself, or ``key/SCOPE_TENSOR`` for a key that is also
    a scope (HDF5 has no node that is both a group and a dataset).

    Raises ValueError for a key whose last part is ``SCOPE_TENSOR``: plain h5py readers would take
    it for the tensor of its scope.
    """
    reserved = "/" + SCOPE_TENSOR
    for key in keys:
        if key == SCOPE_TENSOR or key.endswith(reserved):
            raise ValueError(f"{where}: key {key!r} ends in {SCOPE_TENSOR!r}, the name an HDF5 checkpoint gives "
                             "the tensor of a key that is also a scope; save it as .msgpack or .safetensors")
    scoped = tensor_scopes(keys)
    if not scoped:
        return keys
    return [f"{key}/{SCOPE_TENSOR}" if key in scoped else key for key in keys]


def _write_local(path: str, plans: list[_Plan], paths: list[str], metadata: dict[str, Any], userblock: int,
                 entries: list[Any], blocks: dict[str, bytes], block_bytes: int) -> None:
    """Write the file at ``path`` with libhdf5 laying out its structure; the metadata checksum
    is read back from the file (libhdf5 wrote those bytes)."""
    from . import hdf5  # the reader's check of the metadata bytes, on this rare path only

    offsets = _write_structure(path, plans, paths, metadata, userblock)
    with _io.LocalSink(path, create=False) as blob:
        extents = _write_data(blob, plans, offsets, entries, blocks, block_bytes)
        size = blob.size
        try:
            with _io.LocalFile(path) as written:
                meta_crc = hdf5.metadata_crc(written, userblock, size, extents)
        except CorruptCheckpointError as exc:  # an I/O error reading back what was just written
            raise CheckpointWriteError(f"{path}: writing failed: {exc}") from exc
        _write_index(blob, entries, metadata, size, meta_crc, blocks, block_bytes, userblock)


def _write_structure(path: str, plans: list[Any], paths: list[str], metadata: dict[str, Any],
                     userblock: int) -> list[int | None]:
    """Create the file's groups and datasets with libhdf5 (space allocated, no data); return
    data offsets. Only for files whose attributes _h5struct cannot hold (lengths of more than
    ~8,000 strings); version 2 object headers store them densely."""
    import h5py  # lazy: h5py loads only for the files that need libhdf5
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
            for (_, dt, shape, file_dtype, nbytes, _, lengths), name in zip(plans, paths):
                dcpl = h5p.create(h5p.DATASET_CREATE)
                dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)  # fixed offsets before data is written
                dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
                dcpl.set_obj_track_times(False)  # no timestamps: same tensors, same bytes
                space = h5s.create_simple(shape) if shape else h5s.create(h5s.SCALAR)
                dsid = h5d.create(f.id, name.encode("utf-8"), _h5_type(file_dtype), space,
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


#: The datatype messages of the usual dtypes, as libhdf5 encodes them (a test compares each with
#: h5py's): writing these needs no h5py, whose import costs a process 30-40 ms. Other dtypes are
#: encoded by libhdf5 on first use (``_h5_type``) and kept here.
_TYPE_MESSAGES: dict[np.dtype, bytes] = {np.dtype(name): bytes.fromhex(message) for name, message in {
    "<f2": "11200f0002000000000010000a05000a0f000000",
    "<f4": "11201f000400000000002000170800177f000000",
    "<f8": "11203f000800000000004000340b0034ff030000",
    "<i1": "100800000100000000000800", "<i2": "100800000200000000001000",
    "<i4": "100800000400000000002000", "<i8": "100800000800000000004000",
    "<u1": "100000000100000000000800", "<u2": "100000000200000000001000",
    "<u4": "100000000400000000002000", "<u8": "100000000800000000004000",
    "|b1": "180200000100000010080000010000000000080046414c534500000054525545000000000001",
}.items()}


def _structure(plans: list[_Plan], paths: list[str], metadata: dict[str, Any],
               userblock: int) -> _h5struct.Layout | None:
    """The file's HDF5 structure as ckpt writes it, or None when it needs libhdf5's dense attributes."""
    datasets = []
    new, none = tuple.__new__, ()  # 10,000s of small tensors: no Python-level NamedTuple __new__ each
    for plan, name in zip(plans, paths):
        message = _TYPE_MESSAGES.get(plan.file_dtype)
        if message is None:
            message = _TYPE_MESSAGES[plan.file_dtype] = _h5struct.dtype_message(_h5_type(plan.file_dtype))
        attrs: Sequence[tuple[str, Any]] = none
        if plan.file_dtype.kind in "SV":  # fixed-width bytes of a string tensor, or bfloat16
            attrs = [("ckpt_dtype", dtypes.dtype_name(plan.dtype))]
            if plan.lengths is not None:
                attrs.append(("ckpt_lengths", np.asarray(plan.lengths, dtype=np.uint64)))
        datasets.append(new(_h5struct.Dataset, (name, message, plan.shape, plan.nbytes, attrs)))
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
    reused buffers); return its crc32c and packed block checksums (None for one block): the
    source's own where it checked its bytes against them as they streamed (a conversion)."""
    running = _blocks.RunningChecksums(block_bytes)
    known = checked_checksums(plan.source, block_bytes)
    done = 0
    for view in stream:
        if not len(view):
            continue
        if done + len(view) > plan.nbytes:
            raise ValueError(f"{path}: tensor {plan.key!r} gave more than the {plan.nbytes} bytes its dtype and "
                             "shape hold")
        assert offset is not None  # every tensor with data has a place
        if known is None:
            _io.write_checked(blob, view, offset + done, running.update)
        else:
            blob.write_at(view, offset + done)
        done += len(view)
    if done != plan.nbytes:
        raise ValueError(f"{path}: tensor {plan.key!r} gave {done} bytes; its dtype and shape hold "
                         f"{plan.nbytes}")
    return running.result() if known is None else known


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

