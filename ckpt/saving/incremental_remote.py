"""Incremental saves to object-store URLs (``s3://``, ``gs://``, ``memory://``): chunks uploaded
create-only under ``<dir>/.ckpt-chunks/<sha256>``, the index committed as any object-store
checkpoint, and collection that never deletes a chunk a kept or in-flight checkpoint references.

There is no lock in an object store, so the chunk store is guarded by leases
(``ckpt.storage.leases``): a save holds the store from before it lists which chunks exist until
its index is committed (renewed just before the commit record is written); a collection runs only
under the collect lease, granted while no save holds the store. docs/incremental.md gives the
argument that no kept checkpoint ever references a deleted chunk.

What a save costs beyond the chunks it uploads: one LIST of the chunk folder per 1,000 chunks
(a chunk listed is reused with no request; one not listed is a create-only PUT, and a PUT refused
because another save just wrote it counts as reused), and four compare-and-swap writes of the
lease object (hold, renew, release, end of collection).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any


from ckpt.errors import (CheckpointError, CheckpointNotFoundError, CheckpointWriteError, CorruptCheckpointError,
                         UnsupportedCheckpointError)
from ckpt.formats.base import SNIFF_BYTES, ChunkedFormat
from ckpt.saving.incremental import ChunkStore, Encoding, IncrementalStats, chunked_format, entries_reusing
from ckpt.storage import StateChange
from ckpt.storage.blobio import pread
from ckpt.storage.commits import unique_token
from ckpt.storage.leases import ChunkLeases
from ckpt.storage.objfolder import RemoteFolder
from ckpt.storage.remote import RemoteDirectory
from ckpt.storage.state import CheckpointState

__all__ = ["commit_incremental_remote", "collect_remote", "remote_chunk_usage"]

#: How long a save waits for a running collection to end before it saves self-contained instead.
HOLD_WAIT_S = 30.0
_DELETE_BATCH = 100
_END_ATTEMPTS = 3


def _is_chunk(name: str) -> bool:
    """A chunk file's name: a digest (a whole chunk) or two (a delta: the chunk's, then its base's)."""
    return len(name) in (64, 128) and all(c in "0123456789abcdef" for c in name)


def _take_hold(leases: ChunkLeases, token: str) -> bool:
    deadline = time.monotonic() + min(HOLD_WAIT_S, leases.grace / 4)
    pause = 0.05
    while not leases.hold(token):
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 2.0)
    return True


def commit_incremental_remote(store: RemoteDirectory, name: str, tensors: Sequence[tuple[str, Any]],
                              metadata: Mapping[str, Any], chunk_bytes: int, change: StateChange,
                              step: int | None, metrics: Mapping[str, float] | None,
                              encoding: Encoding | None = None) -> tuple[CheckpointState, IncrementalStats] | None:
    """Save ``tensors`` as the incremental checkpoint ``name`` of ``store`` and record it, then
    collect unreferenced chunks; None (nothing written) when a collection held the chunk store
    for all of ``HOLD_WAIT_S``: the caller saves a self-contained checkpoint instead."""
    path = store.join(name)
    if not store.store.atomic_swap:
        raise UnsupportedCheckpointError(f"{path}: incremental saves need a store with compare-and-swap writes "
                                         "(S3, GCS, memory://); this one has none", path=path)
    fmt = chunked_format()
    folder = RemoteFolder(store.store, store.join(fmt.chunk_dir))
    leases = ChunkLeases(store.store, folder.location)
    token = unique_token()
    since = time.time()  # before the hold is granted: its age is never underestimated
    if not _take_hold(leases, token):
        return None
    stats = IncrementalStats()
    try:
        present = {n for n in folder.sizes() if _is_chunk(n)}  # listed under the hold: no collection runs

        def renewed() -> None:
            nonlocal since
            now = time.time()
            if not leases.fresh(since) or not leases.renew(token):
                raise CheckpointWriteError(f"{path}: not saved: its hold on the chunk store {folder.location} "
                                           f"expired (a save paused for over {leases.grace / 2:g} s, storage option "
                                           "ckpt_grace); the previous checkpoint is still the latest", path=path)
            since = now

        renewing = threading.Lock()  # puts come from several I/O threads: one renewal at a time

        def put(chunk: bytes, data: bytes | memoryview) -> bool:
            with renewing:
                if time.time() - since > leases.grace / 4:
                    renewed()
                present.add(chunk.hex())
            return _put_chunk(store, folder.where(chunk.hex()), data)

        def get(chunk: bytes, limit: int) -> bytes:
            data = folder.read_whole([chunk.hex()], limit)[0]
            if isinstance(data, str):  # listed under the hold, so never collected since: damage, not a race
                raise CorruptCheckpointError(f"{folder.where(chunk.hex())} {data}")  # the chunk is written whole
            return data

        chunks = ChunkStore(put, lambda chunk: chunk.hex() in present, get)
        entries = entries_reusing(fmt, chunks, tensors, chunk_bytes, stats, encoding or Encoding())
        data = fmt.pack_index(dict(metadata), chunk_bytes, entries)
        state = store.commit(name, lambda blob: blob.write_at(data, 0), change, step, metrics, ready=renewed)
    except BaseException:
        try:
            leases.release(token, collect=False)
        except CheckpointError:
            pass  # it expires after the grace
        raise
    stats.chunks_collected = collect_remote(store, fmt, leases, token)
    stats.entries = entries
    return state, stats


def _put_chunk(store: RemoteDirectory, url: str, data: bytes | memoryview) -> bool:
    """Upload a chunk create-only; False when it exists already (another save wrote it)."""
    try:
        store.store.put(url, bytes(data), create_only=True)
    except CheckpointWriteError as exc:
        if isinstance(exc.__cause__, FileExistsError) or "PreconditionFailed" in str(exc):
            return False
        raise
    return True


def collect_remote(store: RemoteDirectory, fmt: ChunkedFormat | None = None, leases: ChunkLeases | None = None,
                   token: str | None = None) -> int:
    """Delete the chunks no checkpoint of the directory references, under the collect lease
    (taken here, releasing the hold of ``token`` if given; nothing is collected while a save holds
    the store). Returns how many chunks were deleted; a fault is a warning (the save committed)."""
    fmt = chunked_format() if fmt is None else fmt
    folder = RemoteFolder(store.store, store.join(fmt.chunk_dir))
    leases = ChunkLeases(store.store, folder.location) if leases is None else leases
    token = unique_token() if token is None else token
    since = time.time()
    try:
        if not leases.release(token, collect=True):
            return 0
    except CheckpointError as exc:
        warnings.warn(f"{folder.location}: no chunk collection this time: {exc}", stacklevel=3)
        return 0
    deleted = 0
    try:
        keep = remote_references(store, fmt)
        if keep is None:
            return 0
        doomed = [n for n in folder.sizes() if _is_chunk(n) and n not in keep]
        for first in range(0, len(doomed), _DELETE_BATCH):
            if not leases.fresh(since):
                break  # the lease may expire: the rest waits for the next collection
            batch = doomed[first:first + _DELETE_BATCH]
            store.store.delete([folder.where(n) for n in batch])
            deleted += len(batch)
    except CheckpointError as exc:
        warnings.warn(f"{folder.location}: chunk collection stopped: {exc}", stacklevel=3)
    finally:
        _end_collection(leases, token)
    return deleted


def _end_collection(leases: ChunkLeases, token: str) -> None:
    """Give up the collect lease, retrying a failed request: a lease left behind would make every
    save of the directory wait ``HOLD_WAIT_S``, then save self-contained, until it expires."""
    for attempt in range(_END_ATTEMPTS):
        try:
            leases.end_collection(token)
            return
        except CheckpointError:
            if attempt == _END_ATTEMPTS - 1:
                return  # it expires after the grace


def _refs(store: RemoteDirectory, fmt: ChunkedFormat, name: str) -> set[str] | None:
    """The chunks (hex) checkpoint ``name`` references; None for a checkpoint that is not incremental."""
    blob = store.open(name)
    try:
        incremental = fmt.sniff(pread(blob, 0, min(SNIFF_BYTES, blob.size), "the head"))
    except BaseException:
        blob.close()
        raise
    if not incremental:
        blob.close()
        return None
    return {c.hex() for c in fmt.references(store.join(name), blob)}


def remote_references(store: RemoteDirectory, fmt: ChunkedFormat) -> set[str] | None:
    """Every chunk (hex) a checkpoint of the directory references; None when one cannot be read
    (nothing may be collected then)."""
    found: set[str] = set()
    for name in store.list_names():
        try:
            found |= _refs(store, fmt, name) or set()
        except CheckpointNotFoundError:
            continue  # deleted meanwhile (retention), or not a checkpoint
        except CheckpointError:
            return None
    return found


def remote_chunk_usage(store: RemoteDirectory, names: list[str]) -> dict[str, tuple[int, int]]:
    """``chunk_usage`` of an object-store directory: (owned, shared) chunk bytes per incremental
    checkpoint of ``names`` (one LIST of the chunk folder for the sizes)."""
    fmt = chunked_format()
    refs: dict[str, set[str]] = {}
    for name in names:
        try:
            found = _refs(store, fmt, name)
        except CheckpointError:
            continue
        if found is not None:
            refs[name] = found
    if not refs:
        return {}
    sizes = RemoteFolder(store.store, store.join(fmt.chunk_dir)).sizes()
    counts: dict[str, int] = {}
    for chunks in refs.values():
        for c in chunks:
            counts[c] = counts.get(c, 0) + 1
    return {name: (sum(sizes.get(c, 0) for c in chunks if counts[c] == 1),
                   sum(sizes.get(c, 0) for c in chunks if counts[c] > 1)) for name, chunks in refs.items()}
