"""ckpt's sharded checkpoints: a directory of per-rank files and the commit record that makes it one.

(Other frameworks' sharded saves, indexed by JSON, are read by formats/sharded.py.)

A sharded checkpoint ``run/model-100.msgpack/`` is a directory holding one file per writing
rank (an ordinary ckpt msgpack or HDF5 checkpoint of that rank's blocks) and ``COMMIT``,
written last and atomically, which lists the files, every tensor's global dtype and shape,
and where each block lives, with a crc32c per ``block_bytes`` of each block's bytes so part
of a block can be read and verified alone. Without ``COMMIT`` the directory is not a
checkpoint. docs/formats.md specifies the bytes.

    COMMIT  one msgpack array of three elements (version 2; version 1 was the three as a stream):
            header  {"format": "ckpt-commit", "version": 2}
            record  {"format", "version", "step", "metadata", "block_bytes", "ranks",  (CommitRecord)
                     "files": [[name, size], ...],
                     "tensors": {key: [dtype, global shape, files, offsets, shapes, nbytes, crcs]}}
            footer  [b"ckpt-cmt", record offset (uint64), record length (uint64), crc32c (uint32)]

Example:
    >>> import numpy as np, ckpt, os, tempfile
    >>> from ckpt import distributed
    >>> v = ckpt.Variable(np.arange(6.0).reshape(3, 2), name="w", shard=ckpt.Shard((3, 2), (0, 0)))
    >>> path = ckpt.Saver([v], comm=distributed.local()).save(os.path.join(tempfile.mkdtemp(), "m.msgpack"))
    >>> with ShardedReader(path) as r:
    ...     r.read_slice("w", np.s_[1:3]).tolist(), r.files[0][0].endswith(".00000-of-00001.msgpack")
    ([[2.0, 3.0], [4.0, 5.0]], True)
"""

from __future__ import annotations

import os
import re
from contextlib import closing
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ckpt import boxes, dtypes
from ckpt.storage.local import LocalStore
from ckpt.storage.atomic import replace_atomically
from ckpt.storage.commits import SHARDED_COMMIT
from ckpt.storage.urls import is_url
from ckpt.errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                         UnsupportedCheckpointError)

from . import _io
from ._blocks import BLOCK_BYTES, block_crcs, read_part
from .base import (SNIFF_BYTES, BaseReader, LazySource, TensorInfo, WritableFormat, check_metadata, check_shape,
                   dtype_or_raise, format_for_path, get_format, open_blob, key_problem, normalize_metadata,
                   validate_keys, write_with)
from ._commitrecord import HEADER, CommitRecord, TensorEntry
from ._mpindex import _dtype_name

if TYPE_CHECKING:
    from ckpt.storage.remote import RemoteDirectory
    from ckpt.storage import ReadableBlob, Store, WritableBlob

__all__ = ["COMMIT", "ShardedReader", "is_sharded", "is_shard_file", "shard_file_name",
           "stored_crcs", "LazyBlock", "CommitRecord", "TensorEntry", "write_commit", "write_single_process",
           "write_shards", "referenced_files", "read_commit", "BLOCK_BYTES", "HEADER"]

#: The commit record's file name inside a sharded checkpoint directory (the stores' name for it).
COMMIT = SHARDED_COMMIT
#: The registered format of shard files that are indexes over a chunk store.
INCREMENTAL = "ckpt-incremental"
_SHARD_FILE = re.compile(r"^[0-9a-f]{16}\.[0-9]{5}-of-[0-9]{5}\.[A-Za-z0-9]+$")


def is_sharded(path: str) -> bool:
    """True for a directory holding a commit record (a committed sharded checkpoint)."""
    return os.path.isfile(os.path.join(path, COMMIT))


def shard_file_name(save_id: str, rank: int, size: int, ext: str) -> str:
    """The name rank ``rank`` of ``size`` gives its file in save ``save_id`` ("<id>.00001-of-00004.h5")."""
    return f"{save_id}.{rank:05d}-of-{size:05d}{ext}"


def is_shard_file(name: str) -> bool:
    """True for a name ``shard_file_name`` makes."""
    return bool(_SHARD_FILE.match(name))


def stored_crcs(reader: Any, key: str) -> list[int] | None:
    """The crc32c of each ``BLOCK_BYTES`` of a block a shard file holds, as that file stores them
    (its block checksums, or the tensor's own crc32c when it fills one block); None for strings.

    The shard file's writer computed them from the bytes it wrote: nothing is read or checksummed
    again, except for a format that stores one checksum per tensor (safetensors) and a block over
    ``BLOCK_BYTES``: its bytes are read back (checked against that checksum) and checksummed.
    """
    info = reader.tensors[key]
    if dtypes.is_string(info.dtype) or not info.nbytes:
        return None if dtypes.is_string(info.dtype) else []
    table = reader.block_checksums(key)
    if table is None:
        crc = reader.stored_crc32c(key)
        if crc is not None and info.nbytes <= BLOCK_BYTES:
            return [int(crc)]
        return block_crcs(_io.byte_view(reader.read(key)))
    crcs, block_bytes = table
    if block_bytes != BLOCK_BYTES:
        raise CorruptCheckpointError(f"{reader.path}: {block_bytes}-byte checksum blocks; the commit record "
                                     f"uses {BLOCK_BYTES}")
    return [int(c) for c in crcs]


def write_commit(directory: str, record: CommitRecord,
                 before_rename: Callable[[str], object] | None = None) -> None:
    """Write ``COMMIT`` atomically (temporary file, fsync, rename, fsync the directory);
    ``before_rename(temporary file)`` runs once it is complete, just before the rename (a
    sharded save writes the state file's pending entry there)."""
    written: list[str] = []  # the temporary file, for the hook

    def hook() -> None:
        if before_rename is not None:
            before_rename(written[0])

    with replace_atomically(os.path.join(directory, COMMIT), before_rename=hook) as tmp:
        written.append(tmp)
        with open(tmp, "wb") as f:
            f.write(record.to_bytes())


class LazyBlock(LazySource):
    """A block of a tensor handed to a format writer: ``read(key, offset, shape)`` is called
    when the writer writes it (once)."""

    def __init__(self, read: Callable[[str, tuple[int, ...], tuple[int, ...]], np.ndarray], key: str,
                 dtype: np.dtype, offset: tuple[int, ...], shape: tuple[int, ...]) -> None:
        self.key, self.dtype, self.offset, self.shape, self._read = key, dtype, offset, shape, read

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return _io.c_contiguous(np.asarray(self._read(self.key, self.offset, self.shape)))


def write_single_process(directory: str, specs: Sequence[tuple[str, np.dtype, tuple[int, ...]]],
                         read: Callable[[str, tuple[int, ...], tuple[int, ...]], np.ndarray],
                         metadata: Mapping[str, Any], parts: int, step: int | None = None,
                         ext: str = ".msgpack", save_id: str | None = None, compression: str | None = None) -> None:
    """Write a sharded checkpoint from one process: each tensor ``(key, dtype, shape)`` split
    along axis 0 into ``parts`` blocks, block i into file i (``ckpt convert --shards``), each file
    written with ``compression`` (None, or one its format offers).

    ``read(key, offset, shape)`` returns a block; it is called when that block is written, so
    memory holds one block at a time. ``directory`` must not exist yet. ``save_id`` (16 hex
    digits in the file names) is random unless given.

    Example:
        >>> import numpy as np, os, tempfile
        >>> w = np.arange(6.0).reshape(3, 2)
        >>> d = os.path.join(tempfile.mkdtemp(), "m.msgpack")
        >>> write_single_process(d, [("w", w.dtype, w.shape)], lambda k, o, s: w[o[0]:o[0] + s[0]], {}, parts=2)
        >>> with ShardedReader(d) as r:
        ...     r.read_slice("w", np.s_[1:3]).tolist(), len(r.files)
        ([[2.0, 3.0], [4.0, 5.0]], 2)
    """
    validate_keys((key for key, _, _ in specs), directory)
    metadata = normalize_metadata(metadata, directory)
    if format_for_path("x" + ext) is None or parts < 1:
        raise ValueError(f"cannot write shards with extension {ext!r} in {parts} parts")
    os.mkdir(directory)
    write_commit(directory, write_shards(LocalStore(directory), specs, read, metadata, parts, step, ext, save_id,
                                         compression))


def write_shards(files: Store, specs: Sequence[tuple[str, np.dtype, tuple[int, ...]]],
                 read: Callable[[str, tuple[int, ...], tuple[int, ...]], np.ndarray],
                 metadata: Mapping[str, Any], parts: int, step: int | None = None,
                 ext: str = ".msgpack", save_id: str | None = None, compression: str | None = None) -> CommitRecord:
    """Write the shard files of ``write_single_process`` into the Store ``files`` (a local
    directory, an object-store data prefix), each read back for its stored checksums; return
    the commit record naming them (the caller commits it: ``write_commit``, or an object
    store's create-only commit)."""
    fmt = format_for_path("x" + ext)
    if not isinstance(fmt, WritableFormat) or parts < 1:
        raise ValueError(f"cannot write shards with extension {ext!r} in {parts} parts")
    validate_keys((key for key, _, _ in specs), files.location)
    metadata = normalize_metadata(metadata, files.location)
    save_id = save_id or os.urandom(8).hex()
    per_file: list[list[LazyBlock]] = [[] for _ in range(parts)]
    entries: dict[str, TensorEntry] = {}
    for key, dtype, shape in specs:
        entries[key] = TensorEntry(_dtype_name(dtype), list(shape), crcs=None if dtypes.is_string(dtype) else [])
        if not shape:
            per_file[0].append(LazyBlock(read, key, dtype, (), ()))
            continue
        for i, rows in enumerate(np.array_split(np.arange(shape[0]), parts)):
            block = (len(rows),) + tuple(shape[1:])
            if boxes.volume(block):
                per_file[i].append(LazyBlock(read, key, dtype, (int(rows[0]),) + (0,) * (len(shape) - 1), block))
    written: list[list[Any]] = []
    for i, items in enumerate(per_file):
        if not items:
            continue
        name = shard_file_name(save_id, i, parts, ext)

        def check(data: ReadableBlob, items: list[LazyBlock] = items) -> None:  # the stored sizes and checksums
            with closing(fmt.open(data.name, data)) as reader:
                for b in items:
                    entry = entries[b.key]
                    entry.add(len(written), b.offset, b.shape, reader.tensors[b.key].nbytes,
                              None if entry.crcs is None else stored_crcs(reader, b.key))

        def write(blob: WritableBlob, items: list[LazyBlock] = items) -> None:
            write_with(fmt, blob, [(b.key, b) for b in items], {}, compression)

        size = files.write_file(name, write, check)
        written.append([name, size])
    return CommitRecord(step, metadata, BLOCK_BYTES, parts, written, entries)


def _read_commit(directory: str, blob: ReadableBlob | None = None) -> tuple[bytes, str | RemoteDirectory]:
    """The bytes of a sharded checkpoint's ``COMMIT`` and where its shard files are: the
    directory, or for a URL the data prefix its (object store) commit record names, as a
    ``RemoteDirectory`` over the store that read the record (shard files open later, with the
    same storage options). ``blob``: an object-store record already opened (the registry sniffed
    it: it knows its store), read and closed here; a local one is read from the directory."""
    path = os.path.join(directory, COMMIT)
    try:
        if is_url(directory):
            return _read_remote_commit(open_blob(directory) if blob is None else blob)
        if blob is not None:
            blob.close()
        with open(path, "rb") as f:
            return f.read(), directory
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{directory}: no commit record ({COMMIT}): not a checkpoint, or a "
                                      "sharded save that did not finish") from None
    except OSError as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CorruptCheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except MemoryError:  # a damaged or hostile record of many GiB: no size bounds a real one
        raise CorruptCheckpointError(f"{path}: the commit record is too large to read into memory "
                                     "(damaged, or not a checkpoint's)", path=directory) from None


def _read_remote_commit(blob: ReadableBlob) -> tuple[bytes, RemoteDirectory]:
    """``_read_commit`` of an object-store checkpoint whose commit record ``blob`` is."""
    from ckpt.storage.remote import RemoteFile  # lazy: object-store code loads only for URLs

    with closing(blob):
        assert isinstance(blob, RemoteFile)
        raw = _io.pread(blob, 0, blob.size, "the sharded commit record")
        prefix = blob.data_url.rpartition("/")[0]
        return raw, type(blob.directory)(prefix, store=blob.directory.store)


def read_commit(directory: str) -> bytes:
    """The bytes of a local sharded checkpoint's ``COMMIT``, as ``ShardedReader(directory, commit=)``
    takes them (a collective restore: rank 0 reads them, every rank opens that version)."""
    if is_url(directory):
        raise ValueError(f"{directory}: read_commit reads local checkpoints")
    return _read_commit(directory)[0]


def _read_record(directory: str) -> CommitRecord:
    return CommitRecord.from_bytes(_read_commit(directory)[0], os.path.join(directory, COMMIT))


def referenced_files(directory: str) -> set[str]:
    """The shard files a committed checkpoint's record lists (without checking the tensors)."""
    files = _read_record(directory).files
    return {f[0] for f in files if isinstance(f, list) and f and isinstance(f[0], str)}


def _bad(path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{os.path.join(path, COMMIT)}: {what}")


class Blocks:
    """The saved blocks of one tensor, as arrays: ``files[i]`` holds block i, at ``offsets[i]``
    of shape ``shapes[i]``, taking ``nbytes[i]`` bytes; ``crcs`` is (all checksum values, where
    block i's start) or None for strings. ``block(i)`` and iteration give ``(file, offset,
    shape, nbytes, checksums)`` tuples."""

    __slots__ = ("crcs", "files", "nbytes", "offsets", "shapes")

    def __init__(self, files: np.ndarray, offsets: np.ndarray, shapes: np.ndarray, nbytes: np.ndarray,
                 crcs: tuple[np.ndarray, np.ndarray] | None) -> None:
        self.files, self.offsets, self.shapes, self.nbytes, self.crcs = files, offsets, shapes, nbytes, crcs

    def __len__(self) -> int:
        return len(self.files)

    def block(self, i: int) -> tuple[int, tuple[int, ...], tuple[int, ...], int, np.ndarray | None]:
        return (int(self.files[i]), tuple(self.offsets[i].tolist()), tuple(self.shapes[i].tolist()),
                int(self.nbytes[i]), None if self.crcs is None else
                self.crcs[0][int(self.crcs[1][i]):int(self.crcs[1][i + 1])])

    def __iter__(self) -> Any:
        return (self.block(i) for i in range(len(self)))

    def touching(self, offset: Sequence[int], shape: Sequence[int]) -> np.ndarray:
        """Indices of the blocks sharing an element with ``[offset, offset + shape)``."""
        lo, hi = np.asarray(offset, np.int64), np.asarray(offset, np.int64) + np.asarray(shape, np.int64)
        return np.flatnonzero(((self.offsets < hi) & (self.offsets + self.shapes > lo)).all(axis=1)
                              & (self.shapes.prod(axis=1) > 0) & (hi > lo).all())


def _ints(values: Any, path: str, key: str, what: str) -> np.ndarray:
    """A flat list of non-negative ints from the record as an int64 array (CorruptCheckpointError if not)."""
    if not isinstance(values, list):
        raise _bad(path, f"tensor {key!r}: malformed {what}")
    if not values:
        return np.zeros(0, np.int64)
    try:
        out = np.asarray(values)
    except (ValueError, OverflowError):
        raise _bad(path, f"tensor {key!r}: malformed {what}") from None
    if out.dtype.kind not in "iu" or out.ndim != 1 or out.min() < 0 or out.max() >= 2 ** 63:
        raise _bad(path, f"tensor {key!r}: malformed {what}")
    return out.astype(np.int64, copy=False)


def _parse(record: CommitRecord, path: str) -> tuple[list[tuple[str, int]], dict[str, TensorInfo], int]:
    """Validate the record's values: files, entries, checksum counts, and that blocks tile every tensor."""
    block_bytes = record.block_bytes
    parsed_files = []
    for entry in record.files:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and
                is_shard_file(entry[0]) and type(entry[1]) is int and entry[1] >= 0):
            raise _bad(path, f"malformed file entry {str(entry)[:80]}")
        parsed_files.append((entry[0], entry[1]))
    owners = [name for name, _ in parsed_files]
    out: dict[str, TensorInfo] = {}
    cache: dict[bytes, str | None] = {}
    for key, entry in record.tensors.items():
        problem = key_problem(key)
        if problem:
            raise _bad(path, f"invalid tensor key {key!r}: {problem}")
        dtype = dtype_or_raise(entry.dtype, path, key)
        shape = check_shape(entry.shape, path, key)
        ndim = len(shape)
        where = _ints(entry.files, path, key, "file indices")
        count = len(where)
        offsets = _ints(entry.offsets, path, key, "offsets")
        shapes = _ints(entry.shapes, path, key, "shapes")
        nbytes = _ints(entry.nbytes, path, key, "sizes")
        crcs = entry.crcs
        if len(offsets) != count * ndim or len(shapes) != count * ndim or len(nbytes) != count or \
                (count and where.max() >= len(parsed_files)):
            raise _bad(path, f"tensor {key!r}: its block arrays do not match")
        offsets, shapes = offsets.reshape(count, ndim), shapes.reshape(count, ndim)
        if dtypes.is_string(dtype):
            if crcs is not None:
                raise _bad(path, f"tensor {key!r}: string blocks carry no block checksums")
        else:
            expected = shapes.prod(axis=1) * dtype.itemsize if count else nbytes
            if (nbytes != expected).any():
                raise _bad(path, f"tensor {key!r}: a block's size does not match its shape")
            crcs = _ints(crcs, path, key, "checksums")
            counts = -(-nbytes // block_bytes)
            if len(crcs) != counts.sum() or (len(crcs) and crcs.max() >= 2 ** 32):
                raise _bad(path, f"tensor {key!r}: the block checksums do not match the blocks' sizes")
            crcs = (crcs, np.concatenate(([0], np.cumsum(counts))))  # flat values, block i's start
        signature = np.asarray(shape, np.int64).tobytes() + offsets.tobytes() + shapes.tobytes() + where.tobytes()
        if signature not in cache:
            cache[signature] = boxes.tiling_problem_arrays(shape, offsets, shapes, [owners[i] for i in where])
        if cache[signature]:
            raise _bad(path, f"tensor {key!r}: {cache[signature]}")
        out[key] = TensorInfo(key, dtype, shape, int(nbytes.sum()), Blocks(where, offsets, shapes, nbytes, crcs))
    return parsed_files, out, block_bytes


def _open_shard(target: str, where: str | RemoteDirectory, size: int) -> ReadableBlob:
    """A shard file's blob: in the checkpoint's directory, or under its data prefix in an object
    store, where it is ``size`` bytes (the record says so): its head and tail come in one round trip."""
    if isinstance(where, str):
        return open_blob(target)
    from ckpt.storage.remote import RemoteFile  # lazy: object-store code loads only for URLs

    return RemoteFile(target, where, size)


def _shard_format(named: Any, blob: ReadableBlob) -> Any:
    """The format that opens a shard file: the one its name says, or the registered incremental
    format for an index over the shared chunk store (``Saver(comm=, incremental=True)``)."""
    chunked = get_format(INCREMENTAL)
    head = _io.pread(blob, 0, min(blob.size, SNIFF_BYTES), "the first bytes")
    return chunked if chunked.sniff(head) else named


def _parts(reader: Any, key: str, crcs: Any) -> tuple[list[tuple[int, int]] | None, Any]:
    """How a block of ``key`` in a shard file can be read in parts: its bytes' file extents, or a
    reader's ``byte_reader`` (chunks of an incremental shard); (None, None): only whole (strings,
    formats without either)."""
    if crcs is None:
        return None, None
    extents = reader.data_extents(key)
    return extents, reader.byte_reader(key) if extents is None else None


class ShardedReader(BaseReader):
    """A sharded checkpoint seen as global tensors; each shard file is opened when first needed.

    ``commit``: the bytes of its ``COMMIT`` read before (``read_commit``): the reader opens that
    version, whatever the directory's record says now (the files of another version are not read).

    ``bytes_read`` counts the tensor bytes read from shard files so far.
    """

    format_name = "ckpt-sharded"
    partial_reads = True  # read_box_into reads only the checksum blocks a box overlaps

    def __init__(self, path: str, commit: bytes | None = None, blob: ReadableBlob | None = None) -> None:
        if not is_url(path) and os.path.basename(path) == COMMIT and os.path.isfile(path):
            path = os.path.dirname(path)  # the commit record itself, opened by its content
        self.path = path
        if commit is not None and is_url(path):
            raise ValueError(f"{path}: a commit record is given only for local checkpoints (read_commit)")
        raw, self._where = (commit, path) if commit is not None else _read_commit(path, blob)
        record = CommitRecord.from_bytes(raw, os.path.join(path, COMMIT))
        self._metadata = check_metadata(record.metadata, os.path.join(path, COMMIT))
        step = record.step
        if step is not None and type(step) is not int:
            raise _bad(path, f"invalid step {step!r}")
        self.step: int | None = step
        self.files, self._tensors, self.block_bytes = _parse(record, path)
        self.ranks = record.ranks
        self._open: dict[int, Any] = {}
        self.bytes_read = 0

    def _shard(self, index: int) -> Any:
        reader = self._open.get(index)
        if reader is None:
            name, size = self.files[index]
            target = os.path.join(self._where, name) if isinstance(self._where, str) else self._where.join(name)
            fmt = format_for_path(name)
            if fmt is None or not fmt.can_write:
                raise UnsupportedCheckpointError(f"{target}: shard files are ckpt msgpack or HDF5 files")
            try:
                blob = _open_shard(target, self._where, size)
            except (FileNotFoundError, CheckpointNotFoundError):
                raise CorruptCheckpointError(f"{target}: a shard file named by the commit record is missing"
                                             ) from None
            except OSError as exc:
                if isinstance(exc, CheckpointError):
                    raise
                raise CorruptCheckpointError(f"{target}: cannot read: {exc.strerror or exc}") from exc
            try:
                if blob.size != size:
                    raise CorruptCheckpointError(f"{target}: {blob.size} bytes, the commit record says {size}: the "
                                                 "file was truncated or replaced")
                fmt = _shard_format(fmt, blob)
                reader = self._open[index] = fmt.open(target, blob)  # the shard's reader reads through it
            except BaseException:
                blob.close()
                raise
        return reader

    def _shard_info(self, index: int, key: str, dtype: np.dtype, shape: tuple[int, ...]) -> tuple[Any, TensorInfo]:
        reader = self._shard(index)
        info = reader.tensors.get(key)
        if info is None or info.dtype != dtype or info.shape != shape:
            found = "nothing" if info is None else f"{_dtype_name(info.dtype)} {list(info.shape)}"
            raise CorruptCheckpointError(f"{reader.path}: tensor {key!r} should be a {_dtype_name(dtype)} "
                                         f"{list(shape)} block, the file holds {found}")
        return reader, info

    def _read_many(self, pairs: list[tuple[TensorInfo, np.ndarray]]) -> None:
        for info, out in pairs:
            self._read_box(info, (0,) * len(info.shape), out)

    def read_box_into(self, key: str, offset: Sequence[int], out: np.ndarray) -> None:
        """Read the block ``[offset, offset + out.shape)`` of tensor ``key`` into ``out``."""
        self._read_box(self.info(key), tuple(offset), out)

    def _read_box(self, info: TensorInfo, offset: tuple[int, ...], out: np.ndarray) -> None:
        blocks: Blocks = info.extra
        for i in blocks.touching(offset, out.shape).tolist():
            file_index, b_off, b_shape, _, crcs = blocks.block(i)
            both = boxes.intersect(offset, out.shape, b_off, b_shape)
            if both is None:
                continue
            i_off, i_shape = both
            dst = out[tuple(slice(o - w, o - w + n) for o, w, n in zip(i_off, offset, i_shape)) + (Ellipsis,)]
            src = tuple(o - b for o, b in zip(i_off, b_off))
            reader, sinfo = self._shard_info(file_index, info.key, info.dtype, b_shape)
            extents, fetch = _parts(reader, info.key, crcs)
            if i_shape == b_shape or (extents is None and fetch is None):
                whole = dst if i_shape == b_shape and dst.flags.c_contiguous else np.empty(b_shape, info.dtype)
                reader.read_into(info.key, whole)
                self.bytes_read += sinfo.nbytes
                if whole is not dst:
                    dst[...] = whole[tuple(slice(s, s + n) for s, n in zip(src, i_shape))]
                continue
            self.bytes_read += read_part(reader, extents or [], info.key, info.dtype, b_shape, crcs, self.block_bytes,
                                         src, i_shape, dst, fetch)

    def verify(self, progress: Callable[[int], None] | None = None) -> list[str]:
        problems: list[str] = []
        for index in range(len(self.files)):
            try:
                problems.extend(self._shard(index).verify())
            except CorruptCheckpointError as exc:
                problems.append(str(exc))
        for key, info in self._tensors.items():
            for file_index, _, b_shape, nbytes, crcs in info.extra:
                try:
                    reader, _ = self._shard_info(file_index, key, info.dtype, b_shape)
                    extents, fetch = _parts(reader, key, crcs)
                    if (extents is not None or fetch is not None) and nbytes:
                        out = np.empty(b_shape, info.dtype)
                        read_part(reader, extents or [], key, info.dtype, b_shape, crcs, self.block_bytes,
                                  (0,) * len(b_shape), b_shape, out, fetch)
                except CorruptCheckpointError as exc:
                    problems.append(str(exc))
            if progress is not None:
                progress(info.nbytes)
        return list(dict.fromkeys(problems))

    def close(self) -> None:
        for reader in self._open.values():
            reader.close()
        self._open.clear()


