"""Converting a checkpoint to another format, a subset of its keys, or renamed: ``convert``.

What ``ckpt convert`` does. Everything is checked before anything is written (keys, dtypes,
metadata); the new file is written to a temporary file, read back and checked against the
source, and only then renamed to the destination, so a failure never leaves a half-written
destination. Object-store destinations are checked locally, then uploaded and committed
create-only (docs/formats.md, object stores). Sharded destinations are written as a new
directory the same way.

Example:
    >>> import ckpt, numpy as np, tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> src = os.path.join(d, "m.h5")
    >>> with ckpt.name_scope("enc"):
    ...     w = ckpt.Variable([1.0, 2.0], name="w")
    >>> _ = ckpt.Saver([w, ckpt.Variable(3, name="step")]).save(src)
    >>> result = ckpt.convert(src, os.path.join(d, "enc.msgpack"), "^enc/", renames={"enc": "encoder"})
    >>> result.format, result.keys
    ('msgpack', {'enc/w': 'encoder/w'})
    >>> ckpt.list_variables(result.path)
    [('encoder/w', [2])]
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckpt import dtypes
from ckpt.tools.chunks import paired_chunks, reusing_buffers, stored_crc32c, tensor_chunks
from ckpt.tools.sources import Checkpoint, Keys, opened, select_keys
from ckpt.storage.urls import StorageOptions, is_url
from ckpt.saving.stores import store_of
from ckpt.storage.atomic import fsync_directory, require_directory
from ckpt.formats.base import (
    check_compression,
    format_for_path,
    formats,
    get_format,
    normalize_metadata,
    validate_keys,
    write_with,
)
from ckpt.lazy import LazySource
from ckpt.formats._blocks import combine, pack_crcs
from ckpt.saving.reader import CheckpointReader
from ckpt.storage import ReadableBlob, WritableBlob
from ckpt.errors import (
    CheckpointError,
    CheckpointWriteError,
    KeyNotFoundError,
    UnsupportedCheckpointError,
    closest_hint,
)

__all__ = ["Conversion", "convert", "writable_format", "scope_renames"]

Progress = Callable[[int], None]


@dataclass(frozen=True)
class Conversion:
    """What :func:`convert` wrote: ``path`` in ``format`` (``shards`` files, or None for one
    file), from ``source`` in ``source_format``; ``keys`` maps each source key to its new key."""

    path: str
    format: str
    source: str
    source_format: str
    keys: dict[str, str]
    shards: int | None = None

    @property
    def renamed(self) -> int:
        """How many keys got a new name."""
        return sum(old != new for old, new in self.keys.items())


def writable_format(path: str | os.PathLike[str], format: str | None = None) -> Any:
    """The registered format that writes ``path``: the one named ``format``, else the one its
    extension names.

    Raises:
        UnsupportedCheckpointError: no format has that name or extension, or it cannot write.

    Example:
        >>> writable_format("model.msgpack").name
        'msgpack'
    """
    path = os.fspath(path)
    writable = ", ".join(f"{'/'.join(f.extensions)} ({f.name})" for f in formats() if f.can_write)
    if format is not None:
        try:
            fmt = get_format(format)
        except (KeyError, ValueError) as exc:
            raise UnsupportedCheckpointError(f"no checkpoint format is called {format!r}; write one of "
                                             f"{writable}") from exc
    else:
        found = format_for_path(path)
        if found is None:
            raise UnsupportedCheckpointError(f"cannot tell a checkpoint format from the extension of {path!r}; "
                                             f"use one of {writable}")
        fmt = found
    if not fmt.can_write:
        raise UnsupportedCheckpointError(f"the {fmt.name} format can be read but not written; write one of "
                                         f"{writable}")
    return fmt


def _renamed(key: str, renames: Mapping[str, str]) -> tuple[str, str | None]:
    """Apply the longest scope rename that covers ``key``; return (new key, the OLD used)."""
    for old in sorted(renames, key=len, reverse=True):
        if key == old or key.startswith(old + "/"):
            rest = key[len(old):]
            return (renames[old] + rest if renames[old] else rest.lstrip("/")), old
    return key, None


def scope_renames(keys: list[str], renames: Mapping[str, str], path: str = "checkpoint") -> dict[str, str]:
    """Map each key to its new name: the longest OLD scope covering it renamed to NEW.

    A scope covers the key itself and the keys under "OLD/"; a trailing "/" is ignored and an
    empty NEW drops the scope.

    Raises:
        KeyNotFoundError: an OLD scope covers no key (naming the closest scopes).
        ValueError: two keys would get the same new key.

    Example:
        >>> scope_renames(["enc/w", "enc/b", "head/w"], {"enc/": "encoder", "head": ""})
        {'enc/w': 'encoder/w', 'enc/b': 'encoder/b', 'head/w': 'w'}
    """
    renames = {old.rstrip("/"): new.rstrip("/") for old, new in renames.items()}
    plan: dict[str, str] = {}
    used: set[str | None] = set()
    source: dict[str, str] = {}
    for key in keys:
        new, old = _renamed(key, renames)
        if new in source:
            raise ValueError(f"{source[new]!r} and {key!r} would both become {new!r}")
        plan[key] = new
        used.add(old)
        source[new] = key
    for old in renames:
        if old not in used:
            raise KeyNotFoundError(f"{path}: rename {old}=...: no tensor key is {old!r} or under "
                                   f"{old + '/'!r}{closest_hint(old, {k.split('/')[0] for k in keys})}")
    return plan


class _Source(LazySource):
    """A tensor of SRC that the writer reads only when it writes it (bounded memory).

    Numeric tensors are read into one buffer shared by all sources (``scratch``): a writer is
    done with a source once it asks for the next (the Format contract), and memory touched
    before costs no page faults.
    """

    def __init__(self, reader: CheckpointReader, info: Any, progress: Progress | None,
                 scratch: list[np.ndarray], chunk_bytes: int | None = None) -> None:
        self.dtype, self.shape = info.dtype, info.shape
        self._reader, self._info, self._progress, self._scratch = reader, info, progress, scratch
        self._chunk_bytes = chunk_bytes

    def chunks(self) -> Iterator[np.ndarray]:
        """The tensor's bytes in bounded chunks, each checked as it streams (writers that stream)."""
        for chunk in tensor_chunks(self._reader, self._info.key, chunk_bytes=self._chunk_bytes):
            yield chunk.view(np.uint8)
            if self._progress is not None:
                self._progress(chunk.nbytes)

    def checked_crc32c(self, block_bytes: int) -> tuple[int, bytes | None] | None:
        """SRC's stored crc32c of the tensor, which ``chunks()`` checks the bytes against as they
        stream, and its stored block crc32c values where SRC keeps them in blocks of ``block_bytes``
        that combine to it; None otherwise. The new file is read back and verified against them."""
        raw = self._reader._reader  # the format reader: raw bytes at file offsets, and their checksums
        key, nbytes = self._info.key, self._info.nbytes
        crc = stored_crc32c(self._reader, key)
        if crc is None or raw.data_extents(key) is None:
            return None
        if nbytes <= block_bytes:
            return crc, None
        table = raw.block_checksums(key)
        if table is None or table[1] != block_bytes or len(table[0]) != -(-nbytes // block_bytes):
            return None
        crcs = [int(c) for c in table[0]]
        if combine(crcs, nbytes, block_bytes) != crc:  # a block table that disagrees with the checked crc32c
            return None
        return crc, pack_crcs(crcs)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        info = self._info
        if dtypes.is_string(info.dtype) or not info.nbytes:
            value: np.ndarray = self._reader.get_tensor(info.key)
        else:
            if self._scratch[0].size < info.nbytes:
                self._scratch[0] = np.empty(info.nbytes, dtype=np.uint8)
            value = self._scratch[0][:info.nbytes].view(info.dtype).reshape(info.shape)
            self._reader.read_into(info.key, value)
        if self._progress is not None:
            self._progress(info.nbytes)
        return value


def _same_tensor(source: CheckpointReader, old: str, written: CheckpointReader, new: str,
                 chunk_bytes: int | None = None) -> bool:
    """Whether tensor ``new`` of the written checkpoint holds ``old``'s exact bytes.

    The written file was verified against its own checksums just before; where both files
    store a crc32c of the same C-order bytes, equal checksums are the check (no second read).
    Otherwise both tensors stream through in chunks and are compared bit for bit.
    """
    a, b = source.tensors[old], written.tensors[new]
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not dtypes.is_string(a.dtype):
        crc_a, crc_b = stored_crc32c(source, old), stored_crc32c(written, new)
        if crc_a is not None and crc_b is not None:
            return crc_a == crc_b
    if dtypes.is_string(a.dtype):
        return bool(source.get_tensor(old).reshape(-1).tolist() == written.get_tensor(new).reshape(-1).tolist())
    pairs = paired_chunks(source, written, old, new, chunk_bytes=chunk_bytes)
    return all(np.array_equal(ca.view(np.uint8), cb.view(np.uint8)) for ca, cb in pairs)


def _check_written(fmt: Any, tmp: ReadableBlob, dst: str, source: CheckpointReader, plan: dict[str, str],
                   metadata: dict[str, Any], progress: Progress | None, chunk_bytes: int | None = None) -> None:
    """Read the new file back; raise CheckpointWriteError unless it holds exactly SRC's tensors."""

    def fail(what: str) -> CheckpointWriteError:
        return CheckpointWriteError(f"{dst}: the converted file does not read back as written ({what}); "
                                    "DST was not replaced")

    with CheckpointReader(fmt.open(tmp.name, tmp)) as written, reusing_buffers():
        if sorted(written.tensors) != sorted(plan.values()):
            raise fail("its keys differ")
        if written.metadata != metadata:
            raise fail("its metadata differs")
        problems = written.verify(progress)  # every byte read back, against the new file's checksums
        if problems:
            raise fail(problems[0])
        for old, new in plan.items():
            if not _same_tensor(source, old, written, new, chunk_bytes):
                raise fail(f"tensor {new!r} differs")


def _check_sharded(written: Any, reader: Any, plan: dict[str, str], metadata: dict[str, Any], dst: str,
                   chunk_bytes: int | None = None) -> None:
    """Raise CheckpointWriteError unless the sharded checkpoint ``written`` holds exactly SRC's tensors."""
    problems = written.verify()
    if problems or written.metadata != metadata or sorted(written.tensors) != sorted(plan.values()):
        raise CheckpointWriteError(f"{dst}: the converted checkpoint does not read back as written "
                                   f"({problems[0] if problems else 'keys or metadata differ'})")
    checked = CheckpointReader(written)
    for old, new in plan.items():
        if not _same_tensor(reader, old, checked, new, chunk_bytes):
            raise CheckpointWriteError(f"{dst}: tensor {new!r} does not read back as written")


def _block_reader(reader: Any, plan: dict[str, str]) -> tuple[list[Any], Callable[..., np.ndarray]]:
    """The ``(key, dtype, shape)`` specs of the planned tensors and a ``read(key, offset, shape)`` of SRC's blocks."""
    old_of = {new: old for old, new in plan.items()}
    specs = [(new, reader.tensors[old].dtype, reader.tensors[old].shape) for old, new in plan.items()]

    def read(key: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
        return np.asarray(reader.get_slice(old_of[key], tuple(slice(o, o + n) for o, n in zip(offset, shape))))

    return specs, read


def _write_sharded_remote(reader: Any, plan: dict[str, str], metadata: dict[str, Any], dst: str, shards: int,
                          fmt: Any, storage_options: StorageOptions | None, chunk_bytes: int | None = None,
                          compression: str | None = None) -> None:
    """Write a sharded checkpoint into an object store as a sharded save does: the shard files
    create-only under a fresh data prefix, its COMMIT there, everything read back and compared,
    then the checkpoint's create-only commit record (docs/formats.md, "Object stores")."""
    from ckpt.storage.remote import RemoteDirectory  # object-store support is imported only for URLs
    from ckpt.formats import ckpt_sharded as sharded

    store = store_of(dst, storage_options)
    assert isinstance(store, RemoteDirectory)
    name = os.path.basename(dst)
    store.clean_orphans()
    if store.exists(name):
        raise CheckpointWriteError(f"{dst} exists; object-store checkpoints are written once (create-only)")
    data = store.new_data(name)
    commit = f"{data}/{sharded.COMMIT}"
    specs, read = _block_reader(reader, plan)
    try:
        record = sharded.write_shards(store.under(data), specs, read, metadata, shards, ext=fmt.extensions[0],
                                      compression=compression)
        raw = record.to_bytes()
        store.store.put(store.join(commit), raw, create_only=True)
        # read back through this store (its options): the reader opens the shard files with it too
        with sharded.ShardedReader(store.join(commit), blob=store.under(data).open(sharded.COMMIT)) as written:
            _check_sharded(written, reader, plan, metadata, dst, chunk_bytes)
    except BaseException:
        store._delete_data(store.join(commit), quietly=True)  # the whole prefix
        raise
    store.publish_bytes(name, commit, raw)


def _write_sharded(reader: Any, plan: dict[str, str], metadata: dict[str, Any], dst: str, shards: int,
                   fmt: Any, chunk_bytes: int | None = None, compression: str | None = None) -> None:
    """Write SRC's planned tensors as a sharded checkpoint: into a temporary directory, read back
    and compared, then renamed to DST (which must not exist)."""
    # lazy: a format module, loaded only for a sharded conversion (format modules load on use, via the registry)
    from ckpt.formats import ckpt_sharded as sharded

    if os.path.lexists(dst):
        raise CheckpointWriteError(f"{dst} exists; a sharded conversion writes a new directory and never "
                                   "replaces a checkpoint (remove it or pick another name)")
    parent = os.path.dirname(os.path.abspath(dst))
    require_directory(dst)  # missing directories are created, as for a single file
    specs, read = _block_reader(reader, plan)
    tmp = os.path.join(parent, f".{os.path.basename(dst)}.ckpt-tmp-{os.urandom(6).hex()}")
    try:
        sharded.write_single_process(tmp, specs, read, metadata, shards, ext=fmt.extensions[0],
                                     compression=compression)
        with sharded.ShardedReader(tmp) as written:
            _check_sharded(written, reader, plan, metadata, dst, chunk_bytes)
        os.rename(tmp, dst)
        fsync_directory(parent)
    except OSError as exc:
        _remove_tree(tmp)
        if isinstance(exc, CheckpointError):
            raise type(exc)(str(exc).replace(tmp, dst)) from exc  # never name the temporary directory
        raise CheckpointWriteError(f"{dst}: writing failed: {exc.strerror or exc}") from exc
    except BaseException:
        _remove_tree(tmp)
        raise


def _remove_tree(path: str) -> None:
    import shutil  # lazy: only a failed sharded conversion needs it (with bz2 and lzma, ~3 ms of a process)

    shutil.rmtree(path, ignore_errors=True)


def convert(src: Checkpoint, dst: str | os.PathLike[str], keys: Keys = None, *,
            renames: Mapping[str, str] | None = None, format: str | None = None, shards: int | None = None,
            overwrite: bool = False, progress: Progress | None = None,
            storage_options: StorageOptions | None = None, chunk_bytes: int | None = None,
            compression: str | None = None) -> Conversion:
    """Write a checkpoint's tensors and metadata to ``dst`` in another format, a subset, renamed.

    ``dst`` is written to a temporary file, read back and checked against ``src`` (keys,
    metadata, every tensor and checksum), and only then renamed into place: on any failure
    ``dst`` is left as it was. Missing directories are created.

    Args:
        src: a checkpoint file, a directory (its latest checkpoint), a URL, or an open
            ``CheckpointReader``.
        dst: the new checkpoint: a path, or an object-store URL (written once, create-only).
        keys: None for every tensor, a regular expression (``re.search``), or a list of keys.
        renames: scope renames, OLD -> NEW: keys equal to OLD or under "OLD/" get NEW instead
            (the longest OLD wins; an empty NEW drops the scope).
        format: the format's registered name; by default ``dst``'s extension names it.
        shards: write a sharded checkpoint (a new directory): each tensor split along its
            first axis into this many files.
        overwrite: replace an existing ``dst`` (never with ``shards`` or for a URL).
        progress: called with numbers of bytes as they are written and checked (twice the
            tensors' bytes in all).
        storage_options: for URLs, options for the store's fsspec filesystem.
        chunk_bytes: about this many bytes of a tensor are read at a time (None: 8 MiB).
        compression: "zstd" writes a .msgpack ``dst`` (or its shards) with compressed numeric
            tensors, as ``save_file(..., compression="zstd")``; None writes it uncompressed,
            whatever ``src`` is.

    Returns:
        A Conversion: where, in which format, which keys became which.

    Raises:
        UnsupportedCheckpointError: ``dst``'s format is unknown or read-only, cannot store a
            dtype or the metadata of ``src``, or does not offer ``compression`` (.h5, .safetensors).
        KeyNotFoundError: ``keys`` or a rename scope matches no key of ``src``.
        CheckpointWriteError: ``dst`` exists (without ``overwrite``), or writing or checking it failed.
        CorruptCheckpointError: ``src`` is damaged.
        ValueError: ``renames`` give two keys one name or make invalid keys; ``overwrite`` with a URL.
    """
    dst = os.fspath(dst)
    fmt = writable_format(dst, format)
    check_compression(fmt, compression, dst)
    remote = is_url(dst)
    if remote and overwrite:
        raise ValueError("an object-store destination is written once (create-only): no overwrite")
    if shards is not None and shards < 1:
        raise ValueError(f"shards must be at least 1, not {shards}")
    if not remote and shards is None and os.path.lexists(dst) and not overwrite:
        raise CheckpointWriteError(f"{dst} exists; pass overwrite=True to replace it")
    with opened(src, storage_options) as reader:
        plan = scope_renames(select_keys(reader.tensors, keys, reader.path), renames or {}, reader.path)
        try:
            validate_keys(plan.values(), dst)
        except ValueError as exc:
            if renames:
                raise
            raise UnsupportedCheckpointError(f"cannot convert {reader.path}: {exc}") from exc
        for key in plan:
            try:
                dtypes.dtype_name(reader.tensors[key].dtype)
            except TypeError:
                raise UnsupportedCheckpointError(f"{reader.path}: tensor {key!r} is {reader.tensors[key].dtype}, "
                                                 f"which the {fmt.name} format cannot store") from None
        try:
            metadata = normalize_metadata(reader.metadata, dst)
        except ValueError as exc:
            raise UnsupportedCheckpointError(f"cannot convert {reader.path}: {exc}") from exc
        done = Conversion(dst, fmt.name, reader.path, reader.format, plan, shards)
        if shards is not None:
            if remote:
                _write_sharded_remote(reader, plan, metadata, dst, shards, fmt, storage_options, chunk_bytes,
                                      compression)
            else:
                _write_sharded(reader, plan, metadata, dst, shards, fmt, chunk_bytes, compression)
            return done

        def write(blob: WritableBlob) -> None:
            scratch = [np.empty(0, dtype=np.uint8)]
            with reusing_buffers():
                write_with(fmt, blob, [(new, _Source(reader, reader.tensors[old], progress, scratch, chunk_bytes))
                                       for old, new in plan.items()], metadata, compression)

        def check(written: ReadableBlob) -> None:
            _check_written(fmt, written, dst, reader, plan, metadata, progress, chunk_bytes)

        try:  # atomic (docs/storage.md): written into the store's blob, read back and checked, then committed
            store_of(dst, storage_options).write_checkpoint(os.path.basename(dst), write, check)
        except (ValueError, TypeError) as exc:  # a writer refusing a dtype or value it cannot store
            if isinstance(exc, CheckpointError):
                raise
            raise UnsupportedCheckpointError(str(exc)) from exc
        return done
