"""Incremental saves: write only the chunks a directory's chunk store lacks, then a small index.

A whole incremental save (chunk writes, the index's commit, retention and chunk collection) runs
under the directory's state lock, so a collection never deletes a pack that a save running
beside it has found holding a chunk it is about to reference. The chunks a save writes go into
one pack (``ckpt.saving.packs``: a temporary file, fsynced, hard-linked to its id's name) and the
chunk folder is fsynced before the index is committed: a committed index never references a
chunk that is not on disk. Collection deletes only packs and chunk files no checkpoint file in the
directory references, after retention removed the dropped files; a crash anywhere leaves at most
unreferenced packs or temporaries, collected by the next save.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckpt import dtypes
from ckpt.errors import CheckpointError, CheckpointWriteError, UnsupportedCheckpointError
from ckpt.formats.base import SNIFF_BYTES, ChunkedFormat, Format, format_for_path, get_format
from ckpt.formats.incremental import MAX_CHAIN as MAX_CHAIN  # the default of Saver(max_chain=)
from ckpt.storage.urls import is_url
from ckpt.storage.atomic import fsync_directory, replace_atomically, require_directory
from ckpt.storage.local import LocalStore, fill_file
from ckpt.storage import StateChange
from ckpt.storage.state import CheckpointState, state_lock
from ckpt.formats._packs import Location
from ckpt.saving.packs import TMP_PREFIX, PackStore, stored_chunks
from ckpt.saving.unchanged import Reuse

#: Default chunk size, chosen by `python -m benchmarks --cases incremental-chunks` (docs/benchmarks.md):
#: with a frozen backbone every size writes the same bytes, and 1 MiB saves fastest with the
#: fewest files (1.5-1.8x a plain save's time on tmpfs, against 2.9-3.0x and 64x the files at 16 KiB); with 1% of
#: an embedding table's rows changing, no size from 16 KiB up writes less than 48%, so smaller
#: chunks buy little there for their cost.
CHUNK_BYTES = 1 << 20
#: the registered format whose checkpoints incremental saves write
FORMAT = "ckpt-incremental"


def chunked_format() -> ChunkedFormat:
    """The incremental format, from the registry (a plugin may replace it with its own ChunkedFormat)."""
    fmt = get_format(FORMAT)
    if not isinstance(fmt, ChunkedFormat):
        raise UnsupportedCheckpointError(f"the registered {FORMAT!r} format ({type(fmt).__name__}) is not a "
                                         "ChunkedFormat: incremental saves need one")
    return fmt


def refuse_unsupported(path: str, fmt: Format, *, sharded: bool = False) -> None:
    """Refuse, before anything is written, what incremental saves do not support yet: formats
    other than msgpack, and object-store URLs for sharded saves."""
    refused = "the sharded saves (comm=) of an object-store URL" if sharded and is_url(path) else \
        f"the {fmt.name} format" if fmt.name != "msgpack" else None
    if refused is not None:
        raise UnsupportedCheckpointError(f"{path}: incremental saves are not supported with {refused} yet; "
                                         "save to a .msgpack path" + (" in a local directory" if sharded else ""),
                                         path=path)


@dataclass
class IncrementalStats:
    """What one incremental save wrote."""

    chunks_written: int = 0
    bytes_written: int = 0
    chunks_reused: int = 0
    chunks_collected: int = 0
    #: tensors whose previous entry was reused without hashing (Variables not written since)
    tensors_reused: int = 0
    #: the index entries the save wrote (key -> entry)
    entries: dict[str, list[Any]] = field(default_factory=dict, repr=False, compare=False)
    #: the format's notes on the chunks the save wrote (the next save's ``encoding.recall``): the
    #: bytes of chunks that changed, as the next delta's base (at most the bytes that changed)
    notes: dict[bytes, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass
class Encoding:
    """How an incremental save encodes its chunks: whole chunks compressed or not, changed
    chunks as deltas against ``previous`` (key -> the entry of the Saver's previous save) up to
    ``max_chain`` deep; the keys in ``unchanged`` (Variables not written since that save) reuse
    their previous entry unhashed when its crc32c and chunks check out (``ckpt.saving.unchanged``)."""

    compression: str | None = None
    max_chain: int = 0
    previous: Mapping[str, list[Any]] = field(default_factory=dict)
    #: the previous save's ``stats.notes`` (taken from as they are used)
    recall: dict[bytes, Any] = field(default_factory=dict)
    #: keys whose Variable was not written since the previous save (entries reused, if still sound)
    unchanged: frozenset[str] = frozenset()
    #: the Saver's count of saves: the clock by which delta chains restart whole in turn (``turn``)
    save: int = 0

    def turn(self, key: str) -> int:
        """Where ``key``'s chunks stand in the chains' restart cycle: the save count plus a number
        drawn from the key (crc32: the same in every process), so that one-chunk tensors restart
        in turn too, not all in one save."""
        return self.save + zlib.crc32(key.encode())


@dataclass
class ChunkStore:
    """What an incremental save asks of its chunk store, by chunk file name (a digest, or two):
    ``put(name, stored bytes)`` stores it unless the store holds it (False: it was there already),
    ``exists(name)`` and ``get(name, limit)`` (its stored bytes, at most ``limit``; a longer file
    is damage: CorruptCheckpointError) look into it. A local directory's
    (``ckpt.saving.packs.PackStore``) or an object store's (``ckpt.saving.incremental_remote``)."""

    put: Callable[[bytes, bytes | memoryview], bool]
    exists: Callable[[bytes], bool]
    get: Callable[[bytes, int], bytes]


def encoded_entries(fmt: ChunkedFormat, chunks: ChunkStore, tensors: Iterable[tuple[str, Any]], chunk_bytes: int,
                    stats: IncrementalStats, encoding: Encoding) -> dict[str, list[Any]]:
    """Write the missing chunks of every tensor; return the index entries. A tensor may be a lazy
    source (an asynchronous save's staged or live tensor): each is materialized once, in order."""
    lock, claimed = threading.Lock(), set()

    def put(chunk: bytes, data: bytes | memoryview) -> None:  # called from the I/O threads
        with lock:
            if chunk in claimed:  # the same bytes twice in one save: one writer is enough
                return
            claimed.add(chunk)
        if chunks.put(chunk, data):
            with lock:
                stats.chunks_written += 1
                stats.bytes_written += len(data)

    entries, refs = {}, 0
    for key, arr in tensors:
        value = np.asarray(arr)
        entries[key] = fmt.tensor_entry(value, chunk_bytes, put, previous=encoding.previous.get(key),
                                        exists=chunks.exists, get=chunks.get, compression=encoding.compression,
                                        max_chain=encoding.max_chain, recall=encoding.recall, note=stats.notes,
                                        turn=encoding.turn(key))
        refs += 0 if dtypes.is_string(value.dtype) else -(-value.nbytes // chunk_bytes)
    stats.chunks_reused = refs - stats.chunks_written
    return entries


def entries_reusing(fmt: ChunkedFormat, chunks: ChunkStore, tensors: Iterable[tuple[str, Any]], chunk_bytes: int,
                    stats: IncrementalStats, encoding: Encoding) -> dict[str, list[Any]]:
    """``encoded_entries`` of the tensors the pre-pass does not reuse as they are (the caller
    holds the store, so a reused entry's chunks, found present, stay until it is committed)."""
    reuse = Reuse(fmt, encoding.previous, encoding.unchanged, chunk_bytes, chunks.exists)
    entries = encoded_entries(fmt, chunks, reuse.rest(tensors), chunk_bytes, stats, encoding)
    stats.tensors_reused, stats.chunks_reused = len(reuse.reused), stats.chunks_reused + reuse.chunks
    return reuse.join(entries)


def write_chunks(fmt: ChunkedFormat, directory: str, tensors: Iterable[tuple[str, Any]], chunk_bytes: int,
                 stats: IncrementalStats, path: str,
                 encoding: Encoding) -> tuple[dict[str, list[Any]], dict[bytes, Location]]:
    """Write the chunks of ``tensors`` that the chunk store of ``directory`` lacks into one pack,
    durably (the pack fsynced, then the folder); return the index entries and where their chunks
    stored in packs are (``pack_index``'s ``packs``). The caller holds the directory's lock, so no
    collection deletes a chunk found present before it is referenced.

    Raises:
        CheckpointWriteError: naming ``path`` (the checkpoint), when the store cannot be written.
    """
    folder = os.path.join(directory, fmt.chunk_dir)
    try:
        require_directory(os.path.join(folder, "-"))  # durably, as the chunks' entries are
        store = PackStore(folder, *stored_chunks(fmt, index_paths(fmt, directory), folder))
        try:
            entries = entries_reusing(fmt, ChunkStore(store.put, store.exists, store.get), tensors, chunk_bytes,
                                      stats, encoding)
            store.finish()
        finally:
            store.abandon()  # a failed save's unfinished pack (nothing once finished)
        fsync_directory(folder)
    except OSError as exc:
        raise CheckpointWriteError(f"{path}: not saved, cannot write to the chunk store {folder}: "
                                   f"{exc.strerror or exc}; the previous checkpoint is still the latest",
                                   path=path) from exc
    return entries, store.located()


def commit_incremental(store: LocalStore, name: str, tensors: Sequence[tuple[str, Any]],
                       metadata: Mapping[str, Any], chunk_bytes: int, change: StateChange, step: int | None,
                       metrics: Mapping[str, float] | None,
                       encoding: Encoding | None = None) -> tuple[CheckpointState, IncrementalStats]:
    """Save ``tensors`` as the incremental checkpoint ``name`` of ``store``'s directory and record
    it; ``stats.entries`` holds its index entries (the next save's ``encoding.previous``)."""
    fmt = chunked_format()
    path = store.join(name)
    stats = IncrementalStats()
    require_directory(path)  # as every save does; the lock file lives there
    with state_lock(store.location):
        entries, packs = write_chunks(fmt, store.location, tensors, chunk_bytes, stats, path,
                                      encoding or Encoding())
        data = fmt.pack_index(dict(metadata), chunk_bytes, entries, packs=packs)
        read: list[CheckpointState] = []
        with replace_atomically(path, before_rename=lambda: read.append(store.intend(name, step, tmp, metrics))) \
                as tmp:
            fill_file(tmp, lambda blob: blob.write_at(data, 0))
        state = store.record(name, change, state=read[0])
        stats.chunks_collected = collect_chunks(store, fmt)
        stats.entries = entries
    return state, stats


def index_paths(fmt: ChunkedFormat, directory: str) -> list[str]:
    """The index files of ``directory``'s checkpoints: its files that are indexes and the shard
    files that are indexes in its sharded checkpoints' directories (committed or not: a save
    still running or killed keeps its chunks until its files are gone)."""
    found = []
    for name in LocalStore(directory).list_names():
        try:
            found += _indexes_at(fmt, os.path.join(directory, name))
        except OSError:
            continue  # removed meanwhile, or unreadable: its chunks are merely not known
    return found


def _indexes_at(fmt: ChunkedFormat, path: str) -> list[str]:
    """The index files of the checkpoint ``path``: itself, or its shard files (a sharded checkpoint)."""
    if os.path.isdir(path):
        if format_for_path(path) is None:  # not a checkpoint's name: not ours to read
            return []
        inner = (os.path.join(path, name) for name in sorted(os.listdir(path)) if not name.startswith("."))
        return [p for p in inner if os.path.isfile(p) and _is_index(fmt, p)]
    return [path] if os.path.isfile(path) and _is_index(fmt, path) else []


def references_at(fmt: ChunkedFormat, path: str) -> set[bytes] | None:
    """The files of the chunk store (packs and chunk files) the checkpoint ``path`` references:
    an index file, or a sharded checkpoint's directory (every shard file in it that is an index);
    None when it references none.

    Raises:
        OSError, CheckpointError: a file that may be an index cannot be read.
    """
    indexes = _indexes_at(fmt, path)
    return set().union(*(fmt.references(p) for p in indexes)) if indexes else None


def _is_index(fmt: ChunkedFormat, path: str) -> bool:
    with open(path, "rb") as f:
        return bool(fmt.sniff(f.read(SNIFF_BYTES)))


def referenced(store: LocalStore, fmt: ChunkedFormat) -> set[bytes] | None:
    """Every chunk a checkpoint of the directory references (its index files and the shard files of
    its sharded checkpoints); None when a file that may be an index cannot be read (nothing may be
    collected then)."""
    found: set[bytes] = set()
    for name in store.list_names():
        try:
            found |= references_at(fmt, store.join(name)) or set()
        except FileNotFoundError:
            continue  # removed meanwhile (not by a saver: they hold the lock)
        except (OSError, CheckpointError):
            return None
    return found


def collect_chunks(store: LocalStore, fmt: ChunkedFormat | None = None) -> int:
    """Delete the chunks (and chunk temporaries) no checkpoint file references; the caller holds
    the directory's lock. Returns how many chunks were deleted."""
    fmt = chunked_format() if fmt is None else fmt
    folder = os.path.join(store.location, fmt.chunk_dir)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return 0
    keep = referenced(store, fmt)
    if keep is None:
        return 0
    wanted = {c.hex() for c in keep}
    deleted = 0
    for name in names:
        if name in wanted:
            continue
        try:
            os.unlink(os.path.join(folder, name))
            deleted += not name.startswith(TMP_PREFIX)
        except FileNotFoundError:
            pass
    return deleted


def chunk_usage(directory: str, names: list[str]) -> dict[str, tuple[int, int]]:
    """For each incremental checkpoint of ``names`` (files in ``directory``): the bytes of the chunks
    only it references (owned) and those other listed checkpoints reference too (shared)."""
    fmt = chunked_format()
    refs: dict[str, set[bytes]] = {}
    for name in names:
        try:
            found = references_at(fmt, os.path.join(directory, name))
        except (OSError, CheckpointError):
            continue
        if found is not None:
            refs[name] = found
    counts: dict[bytes, int] = {}
    for chunks in refs.values():
        for c in chunks:
            counts[c] = counts.get(c, 0) + 1
    out = {}
    for name, chunks in refs.items():
        owned = shared = 0
        for c in chunks:
            try:
                size = os.path.getsize(os.path.join(directory, fmt.chunk_dir, c.hex()))
            except OSError:
                continue
            if counts[c] == 1:
                owned += size
            else:
                shared += size
        out[name] = (owned, shared)
    return out
