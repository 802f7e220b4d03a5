"""The collective save: plan, agree, write per-rank files, commit.

1. Every rank sends its plan (allgather). Rank 0 checks that the ranks agree (same path,
   step and keys; same dtypes and global shapes; blocks that tile each tensor), prepares the
   checkpoint directory (removing what killed saves left behind) and broadcasts a verdict:
   an error every rank raises, or the save's id. Nothing is written before this point.
2. Every rank writes its blocks (and the replicated tensors it was given) to its own file,
   atomically, and reports the file and each block's checksums (allgather).
3. Rank 0 writes the state file with the checkpoint pending, the commit record (atomically,
   last), then records the checkpoint in the state file (retention included) and broadcasts the
   outcome.

At an object-store URL there is no directory: rank 0 picks a unique data prefix instead
(``_prepare_remote``), and the commit is the sharded COMMIT object, then the checkpoint's
create-only commit record (``_commit_remote``; ckpt/storage/remote.py). Each rank writes its file the
same way in both cases: ``Store.write_file`` of the directory's ``LocalStore`` (temporary file,
rename) or of the data prefix's ``RemoteDirectory`` (a create-only upload streamed as the
format writes it), then reads its index back.

Each collective is bounded by the Saver's timeout: a rank that dies or never arrives makes
the others raise CheckpointWriteError. Until the commit record exists the new checkpoint is
invisible; the previous one stays the latest.

Example:
    >>> import numpy as np, ckpt, tempfile, os
    >>> from ckpt import distributed
    >>> v = ckpt.Variable(np.arange(4.0), name="v")
    >>> path = ckpt.Saver([v], comm=distributed.local()).save(os.path.join(tempfile.mkdtemp(), "m.h5"))
    >>> sorted(n for n in os.listdir(path) if not n.endswith(".h5"))
    ['COMMIT']
"""

from __future__ import annotations

import fcntl
import os
import shutil
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from collections.abc import Mapping

import numpy as np

from .. import boxes, dtypes
from ckpt.storage.local import LocalStore
from ckpt.saving.stores import REGISTRY, store_of
from ckpt.storage.urls import is_url
from ckpt.storage.atomic import clean_stale_temporaries, fsync_directory, is_temporary, require_directory
from ..errors import (CheckpointError, CheckpointNotFoundError, CheckpointWriteError, MismatchError,
                      UninitializedVariableError)
from ..formats import ckpt_sharded as sharded
from ..formats.base import format_for_path, write_with  # the registry: importing it registers the built-ins
from ..formats.ckpt_sharded import BLOCK_BYTES, COMMIT, CommitRecord, TensorEntry
from ..formats._mpindex import _dtype_name
from ..gcpause import gc_paused
from ckpt.saving.retention import Retention, kept_paths, read_local_owner, read_owner
from ckpt.saving.staging import peek
from ckpt.storage.state import state_lock
from . import plan as planning
from .incremental import IncrementalJob, collect, write_index_shard
from .comm import CollectiveTimeoutError, Communicator, OutcomeUnknownError, decode, encode

if TYPE_CHECKING:
    from ckpt.storage.remote import RemoteDirectory
    from ckpt.runtime.variables import Variable
    from ..storage import ReadableBlob, Store, WritableBlob

__all__ = ["Job", "save_sharded", "remove_leftovers", "build_record"]

_ERRORS: dict[str, type[CheckpointError]] = {"mismatch": MismatchError, "write": CheckpointWriteError,
                                             "notfound": CheckpointNotFoundError}


@dataclass(frozen=True)
class Job:
    """What a sharded save needs from its Saver: the variables by key, the retention policy, the
    object store's options, the save's metrics (rank 0's are recorded)."""

    variables: Mapping[str, Variable]
    retention: Retention
    storage_options: Mapping[str, Any] | None = None
    metrics: Mapping[str, float] | None = None
    #: the shard files' compression (``Saver(compression=)``), checked against the format by the Saver
    compression: str | None = None
    #: an incremental save (``Saver(incremental=True)``): shard files index the shared chunk store
    incremental: IncrementalJob | None = None


def _local_plan(job: Job, path: str, step: int | None, values: Mapping[str, Any] | None,
                ) -> tuple[dict[str, Any], list[tuple[str, Any, Any]]]:
    """This rank's plan message, and its (key, variable, value) items; ``values`` (key -> a
    snapshot or None for an uninitialized variable) replaces reading the variables. The plan
    carries the digest of every replicated value: rank 0 refuses values that differ by rank."""
    specs, items, error = [], [], None
    digests: dict[str, int] = {}
    for key, var in job.variables.items():
        try:
            if values is None:
                value = var._read()
            elif values.get(key) is None:
                raise UninitializedVariableError(f"variable {var.name!r} is uninitialized")
            else:
                value = values[key]
        except UninitializedVariableError as exc:
            error = f"cannot save {path}: {exc}"
            break
        shard = var.shard
        specs.append((key, _dtype_name(var.dtype), shard.global_shape if shard else var.shape,
                      shard.offset if shard else None, var.shape))
        items.append((key, var, value))
        if shard is None:
            digests[key] = planning.digest(peek(value))  # peek: an unstaged value's one read stays the writer's
    return planning.local_plan(path, step, error, specs, digests), items


def _raise(message: dict[str, Any]) -> None:
    if message.get("error"):
        raise _ERRORS.get(message.get("kind", ""), CheckpointWriteError)(message["error"])


def save_sharded(job: Job, comm: Communicator, timeout: float, path: str, fmt: Any, step: int | None,
                 metadata: dict[str, Any], values: Mapping[str, Any] | None = None,
                 failure: str | None = None) -> list[str]:
    """Run the collective save of ``path`` (the checkpoint directory) on every rank; return the
    checkpoints the directory keeps, oldest first (as rank 0 recorded them).

    ``values`` (key -> snapshot, for an asynchronous save) replaces reading the variables;
    then the save runs in a background thread and leaves the garbage collector alone.
    ``failure`` (this rank's save failed before it started): the rank still takes part in the
    plan's exchange with it, so every rank raises at once, naming this one, instead of the
    others waiting out the timeout.
    """
    try:
        with ExitStack() as held:  # rank 0 of an incremental save: the directory's lock
            return _save(job, comm, timeout, path, fmt, step, metadata, values, failure, held)
    except CollectiveTimeoutError as exc:
        raise CheckpointWriteError(f"{path}: the sharded save failed on rank {comm.rank} of {comm.size}: {exc}; "
                                   "the previous checkpoint is still the latest") from exc


def _save(job: Job, comm: Communicator, timeout: float, path: str, fmt: Any, step: int | None,
          metadata: dict[str, Any], values: Mapping[str, Any] | None, failure: str | None,
          held: ExitStack) -> list[str]:
    rank, size = comm.rank, comm.size
    if failure is None:
        try:
            mine, items = _local_plan(job, path, step, values)
        except Exception as exc:  # told to the others in the plan, not raised here alone
            failure = f"{type(exc).__name__}: {exc}"
    if failure is not None:
        mine, items = {**planning.local_plan(path, step, failure, []), "failed": True}, []
    plans = [decode(raw, path) for raw in comm.allgather(encode(mine), timeout)]
    lock_fd, listed_before = None, False
    if rank == 0:
        verdict: dict[str, Any]
        failed = [f"rank {r}: {p['error']}" for r, p in enumerate(plans) if p.get("failed")]
        problem = None if failed else planning.problems(plans)
        if failed:
            verdict = {"kind": "write", "error": f"{path}: the sharded save failed on " + "; ".join(failed) +
                                                 "; nothing was written"}
        elif problem:
            verdict = {"kind": "mismatch", "error": f"cannot save {path}: the ranks disagree; nothing was "
                                                    f"written:\n  " + problem.replace("\n", "\n  ")}
        else:
            try:
                save_id, data = os.urandom(8).hex(), None
                if is_url(path):
                    listed_before, data = _prepare_remote(job, path)
                else:
                    if job.incremental is not None:  # held until the chunks are collected (incremental.py)
                        require_directory(path)  # the lock file lives in the parent
                        held.enter_context(state_lock(os.path.dirname(os.path.abspath(path))))
                    lock_fd, listed_before = _prepare(path, save_id)
                verdict = {"save_id": save_id, "data": data}
            except Exception as exc:
                kind = "notfound" if isinstance(exc, CheckpointNotFoundError) else "write"
                verdict = {"kind": kind, "error": str(exc) if isinstance(exc, CheckpointError) else
                           f"{path}: rank 0 could not prepare the save: {type(exc).__name__}: {exc}"}
        verdict = decode(comm.broadcast(encode(verdict), 0, timeout), path)
    else:
        verdict = decode(comm.broadcast(None, 0, timeout), path)
    _raise(verdict)
    save_id, data = verdict["save_id"], verdict.get("data")
    try:
        lay = planning.layout(plans)
        writers = planning.replicated_writers(lay)
        report: dict[str, Any]
        try:
            files: Store = LocalStore(path) if data is None else _remote_store(job, path).under(data)
        except Exception as exc:  # reported, so every rank fails now rather than at the timeout
            report = {"error": f"rank {rank}: {type(exc).__name__}: {exc}", "file": None, "blocks": []}
        else:
            report = _write_mine(files, fmt, save_id, rank, size, items, writers, sharded,
                                 background=values is not None, compression=job.compression,
                                 incremental=job.incremental)
        try:
            reports = [decode(raw, path) for raw in comm.allgather(encode(report), timeout)]
        except CollectiveTimeoutError as exc:  # rank 0 may have got every report, this one included
            if rank != 0 and report["error"] is None:
                raise _unknown(path, rank, size, exc) from exc
            raise
        if rank == 0:
            try:
                if data is None:
                    outcome = _commit(job, path, save_id, lay, reports, step, metadata, listed_before, sharded,
                                      locked=job.incremental is not None)
                else:
                    outcome = _commit_remote(job, path, data, build_record(lay, reports, step, metadata), reports)
            except Exception as exc:
                outcome = {"kind": "write", "error": f"{path}: rank 0 could not commit: {type(exc).__name__}: {exc}"}
            try:
                outcome = decode(comm.broadcast(encode(outcome), 0, timeout), path)
            except CollectiveTimeoutError:
                pass  # the others gave up waiting (and say they cannot know); rank 0 knows its own outcome
        else:
            try:
                outcome = decode(comm.broadcast(None, 0, timeout), path)
            except CollectiveTimeoutError as exc:
                raise _unknown(path, rank, size, exc) from exc
    finally:
        if lock_fd is not None:
            _unlock(path, save_id, lock_fd)
    _raise(outcome)
    return list(outcome["kept"])  # every rank sees what rank 0 kept


def _unknown(path: str, rank: int, size: int, exc: CollectiveTimeoutError) -> OutcomeUnknownError:
    """The error of a rank that timed out after reporting its part written: rank 0 may be committing
    (a slow file system, a large retention delete) or have committed; this rank cannot know which."""
    return OutcomeUnknownError(
        f"{path}: rank 0 did not report the outcome of the sharded save to rank {rank} of {size} in time ({exc}); "
        "the checkpoint may or may not be committed (rank 0 commits once every rank has reported its part "
        f"written, as this one did); latest_checkpoint({os.path.dirname(path)!r}) tells")


def _prepare(path: str, save_id: str) -> tuple[int, bool]:
    """Rank 0, before anything is written: check the parent directory and its state file,
    remove leftovers of killed saves, create the checkpoint directory and lock this save in it."""
    parent = os.path.dirname(os.path.abspath(path))
    require_directory(path)  # missing parents are created, durably, as for single-file saves
    if os.path.lexists(path) and not os.path.isdir(path):
        raise CheckpointWriteError(f"{path}: a file of that name exists; a sharded checkpoint is a directory "
                                   "(save under another name)")
    try:
        state = read_local_owner(parent, path)
        listed_before = state is not None and any(e.path == os.path.basename(path) for e in state.all_entries())
        clean_stale_temporaries(parent)
        remove_leftovers(parent)
        lock = os.path.join(path, f".{save_id}.saving")
        for attempt in (1, 2):  # another save's cleanup may remove the still-empty directory in between
            if not os.path.isdir(path):
                os.mkdir(path)
                fsync_directory(parent)  # the checkpoint's directory entry is durable before its commit
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _clean_inside(path, keep=save_id)
    except OSError as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointWriteError(f"{path}: cannot prepare the checkpoint directory: {exc.strerror or exc}; "
                                   "nothing was written") from exc
    return fd, listed_before


def _remote_store(job: Job, path: str) -> RemoteDirectory:
    from ckpt.storage.remote import RemoteDirectory  # object-store support is imported only for URLs

    store = store_of(path, job.storage_options)
    assert isinstance(store, RemoteDirectory)
    return store


def _prepare_remote(job: Job, path: str) -> tuple[bool, str]:
    """Rank 0, before anything is written to an object store: check the state file's owner,
    delete orphaned data of killed saves, refuse a name already committed (commit records are
    create-only); return whether the state file lists the name, and this save's data prefix."""
    store = _remote_store(job, path)
    name = os.path.basename(path)
    read_owner(store, path)  # refuses another program's state file, reports a missing bucket as a save does
    state = store.read_state()  # a damaged one is refused here (unlike a single-file save's, rewritten)
    store.clean_orphans()
    if store.exists(name):
        raise CheckpointWriteError(f"{path}: a checkpoint of that name exists (object-store checkpoints are "
                                   "committed create-only; save under another name); nothing was written")
    return state is not None and any(e.path == name for e in state.all_entries()), store.new_data(name)


def _commit_remote(job: Job, path: str, data: str, record: Any,
                   reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0, once every rank uploaded its shard file under the prefix ``data``: upload the
    sharded COMMIT there, then the checkpoint's commit record (create-only), then record it in
    the state file (retention included); on a failure, delete this save's objects."""
    store = _remote_store(job, path)
    failed = [r["error"] for r in reports if r["error"]]
    try:
        if failed:
            raise CheckpointWriteError(f"{path}: the sharded save failed; nothing was committed and the previous "
                                       "checkpoint is still the latest:\n  " + "\n  ".join(failed))
        name, body = os.path.basename(path), record.to_bytes()
        store.store.put(store.join(f"{data}/{COMMIT}"), body, create_only=True)
        # pending first: a kill after the commit hides nothing
        store.intend(name, record.step, f"{data}/{COMMIT}", job.metrics)
        store.publish_bytes(name, f"{data}/{COMMIT}", body, record.step)
    except CheckpointError as exc:
        urls = [store.join(f"{data}/{r['file'][0]}") for r in reports if r["file"] is not None]
        try:
            store.store.delete(urls + [store.join(f"{data}/{COMMIT}")])
        except CheckpointError:
            pass  # the store is failing: the next save's clean_orphans takes them
        return {"kind": "write", "error": str(exc)}
    try:
        state = store.record(os.path.basename(path), job.retention.change(store, path, record.step, job.metrics))
    except CheckpointError as exc:
        return {"kind": "write", "error": str(exc)}
    return {"error": None, "kept": kept_paths(path, state)}


def _unlock(path: str, save_id: str, fd: int) -> None:
    try:
        os.unlink(os.path.join(path, f".{save_id}.saving"))
    except OSError:
        pass
    os.close(fd)


def _lock_free(lock: str) -> bool:
    """True when no live save holds ``lock`` (its writer finished or was killed)."""
    try:
        fd = os.open(lock, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _ours(name: str) -> bool:
    """A name a sharded save creates inside its directory."""
    return sharded.is_shard_file(name) or is_temporary(name) or (name.startswith(".") and name.endswith(".saving"))


def _clean_inside(path: str, keep: str | None = None) -> None:
    """Remove the files of saves into ``path`` that never committed (or were superseded),
    unless a live save holds them; ``keep`` is the id of the save in progress."""
    names = os.listdir(path)
    live = {n[1:-len(".saving")] for n in names if n.startswith(".") and n.endswith(".saving")
            and not _lock_free(os.path.join(path, n))}
    if keep:
        live.add(keep)
    referenced: set[str] = set()
    if sharded.is_sharded(path):
        try:
            referenced = sharded.referenced_files(path)
        except CheckpointError:
            return  # a damaged commit record: leave the directory to the user
    for name in names:
        if name in referenced or name == sharded.COMMIT:
            continue
        ident = name.lstrip(".").split(".")[0]
        ours = sharded.is_shard_file(name) or (name.startswith(".") and name.endswith(".saving"))
        if ours and ident not in live:
            _unlink(os.path.join(path, name))
    clean_stale_temporaries(path)


def remove_leftovers(parent: str) -> list[str]:
    """Delete the directories of sharded saves in ``parent`` that were killed before their
    commit (no commit record, no live save); return their names."""
    removed = []
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if not os.path.isdir(path) or os.path.islink(path):
            continue
        try:
            inside = os.listdir(path)
        except OSError:
            continue
        if sharded.is_sharded(path):
            if any(n.endswith(".saving") for n in inside):  # a save of it was killed: its stray files
                _clean_inside(path)
            continue
        if not inside:
            if _checkpoint_name(name):  # a failed save whose rank 0 unlocked it before any file was written
                try:
                    os.rmdir(path)  # refuses if a save has just put its lock in it
                    removed.append(name)
                except OSError:
                    pass
            continue
        if not all(_ours(n) for n in inside):
            continue
        if all(_lock_free(os.path.join(path, n)) for n in inside if n.endswith(".saving")):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return removed


def _checkpoint_name(name: str) -> bool:
    """True for a name a sharded save could have created: one whose extension a writable format claims."""
    fmt = format_for_path(name)
    return fmt is not None and fmt.can_write


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _write_mine(files: Store, fmt: Any, save_id: str, rank: int, size: int, items: list[tuple[str, Any, Any]],
                writers: dict[str, int], sharded: Any, background: bool = False,
                compression: str | None = None, incremental: IncrementalJob | None = None) -> dict[str, Any]:
    """Write this rank's blocks to its own file in ``files`` (the checkpoint's directory, or the
    save's data prefix in an object store: the same Store calls either way), read its index back
    for the blocks' checksums; return the report rank 0 commits from. ``incremental`` (not a
    full save): the blocks' chunks go to the chunk store and the file is their index."""
    mine = []
    for key, var, value in items:
        if (var.shard is not None or writers.get(key) == rank) and boxes.volume(var.shape):
            offset = var.shard.offset if var.shard is not None else (0,) * len(var.shape)
            # read once, when the writer writes it (its checksum blocks: by the writer, from those bytes)
            mine.append(sharded.LazyBlock(lambda *_, v=value: np.asarray(v), key, var.dtype, offset, var.shape))
    if not mine:
        return {"error": None, "file": None, "blocks": []}
    name = sharded.shard_file_name(save_id, rank, size, fmt.extensions[0])
    blocks: list[list[Any]] = []

    def write(blob: WritableBlob) -> None:
        with gc_paused() if not background else nullcontext():
            write_with(fmt, blob, [(block.key, block) for block in mine], {}, compression)

    def check(written: ReadableBlob) -> None:  # the file's own record of each block: sizes and checksums
        with fmt.open(written.name, written) as reader:
            for block in mine:
                blocks.append([block.key, list(block.offset), list(block.shape), reader.tensors[block.key].nbytes,
                               sharded.stored_crcs(reader, block.key)])

    try:
        if incremental is not None and not incremental.full:
            assert isinstance(files, LocalStore)  # the Saver refuses object stores
            written, blocks = write_index_shard(files, name, mine, incremental)
            return {"error": None, "file": [name, written], "blocks": blocks}
        return {"error": None, "file": [name, files.write_file(name, write, check)], "blocks": blocks}
    except Exception as exc:
        return {"error": f"rank {rank}: {exc}", "file": [name, 0], "blocks": []}


def build_record(lay: planning.Layout, reports: list[dict[str, Any]], step: int | None,
                 metadata: dict[str, Any]) -> Any:
    """The commit record (a ``ckpt_sharded.CommitRecord``, docs/formats.md) from the agreed plan
    and every rank's report."""
    files: list[list[Any]] = []
    tensors = {key: TensorEntry(dtype, shape, crcs=None if dtypes.is_string(dtypes.as_dtype(dtype)) else [])
               for key, dtype, shape, *_ in lay.keys}
    for report in reports:
        if report["file"] is None:
            continue
        index = len(files)
        files.append(report["file"])
        for key, offset, shape, nbytes, crcs in report["blocks"]:
            tensors[key].add(index, offset, shape, nbytes, crcs)
    return CommitRecord(step, metadata, BLOCK_BYTES, len(lay.offsets), files, tensors)


def _commit(job: Job, path: str, save_id: str, lay: planning.Layout, reports: list[dict[str, Any]],
            step: int | None, metadata: dict[str, Any], listed_before: bool, sharded: Any,
            locked: bool = False) -> dict[str, Any]:
    """Rank 0: write the commit record and update the state file, or undo this save's files
    (``locked``: the caller holds the directory's lock); an incremental save's chunks no
    checkpoint references are deleted after, still under the lock."""
    failed = [r["error"] for r in reports if r["error"]]
    if failed:
        _discard(path, reports)
        return {"kind": "write", "error": f"{path}: the sharded save failed; nothing was committed and the "
                                          "previous checkpoint is still the latest:\n  " + "\n  ".join(failed)}
    parent = os.path.dirname(os.path.abspath(path))
    with ExitStack() as held:  # intent, commit, record and retention under the state lock, as a Saver's rename
        try:
            if not locked:
                held.enter_context(state_lock(parent))
            # the state file names the checkpoint pending first: rank 0 killed after the commit
            # record leaves it the latest all the same
            sharded.write_commit(path, build_record(lay, reports, step, metadata),
                                 lambda tmp: LocalStore(parent, REGISTRY).intend(os.path.basename(path), step, tmp,
                                                                                 job.metrics))
        except CheckpointError as exc:
            _discard(path, reports)
            return {"kind": "write", "error": str(exc)}
        try:
            state = job.retention.record(path, step, listed_before, locked=True, metrics=job.metrics)
        except CheckpointError as exc:
            return {"kind": "write", "error": str(exc)}
        if job.incremental is not None:
            try:
                collect(parent, job.incremental)
            except (OSError, CheckpointError):
                pass  # committed all the same; the next save collects what is left
    try:
        _clean_inside(path, keep=save_id)  # a checkpoint saved again under this name: the old files
    except OSError:
        pass
    return {"error": None, "kept": kept_paths(path, state)}


def _discard(path: str, reports: list[dict[str, Any]]) -> None:
    for report in reports:
        if report["file"] is not None:
            _unlink(os.path.join(path, report["file"][0]))
