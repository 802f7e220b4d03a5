"""The collective restore: one checkpoint for every rank, one outcome for every rank.

Rank 0 resolves the path (a directory -> its latest checkpoint) and broadcasts it, so a save
finishing meanwhile cannot make ranks read different checkpoints; for a sharded checkpoint it
also reads the commit record and broadcasts its bytes, and every rank opens that version, so a
re-save of the same step meanwhile (a new record, new files, the old ones deleted) cannot make
ranks restore different versions: a rank that finds that version's files gone fails, saying so.
Each rank then plans and reads its own variables (sharded ones read only their block, whatever
layout wrote it), and the ranks exchange outcomes: if any rank failed, every rank raises,
naming the ranks.

Example:
    >>> import numpy as np, ckpt, tempfile, os
    >>> from ckpt import distributed
    >>> v = ckpt.Variable(np.arange(4.0), name="v")
    >>> saver = ckpt.Saver([v], comm=distributed.local())
    >>> path = saver.save(os.path.join(tempfile.mkdtemp(), "m.msgpack"))
    >>> saver.restore(path).restored
    ['v']
"""

from __future__ import annotations

import os
from typing import Any
from collections.abc import Mapping

from .. import errors
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..formats import ckpt_sharded as sharded
from ckpt.saving.reader import open_checkpoint
from ckpt.saving.restore import RestoreResult, restore_from
from ckpt.saving.locations import resolve_checkpoint
from ckpt.storage.urls import StorageOptions, is_url
from ckpt.runtime.variables import Variable
from .comm import Communicator, decode, encode

__all__ = ["restore_collective"]


def restore_collective(path: str | os.PathLike[str], variables: Mapping[str, Variable], comm: Communicator,
                       timeout: float, strict: bool = True, allow_cast: bool = False,
                       storage_options: StorageOptions | None = None) -> RestoreResult:
    """Restore ``variables`` on every rank of ``comm`` from one checkpoint (``storage_options``:
    for an object-store URL)."""
    where = os.fspath(path)
    if comm.rank == 0:
        try:
            message: dict[str, Any] = {"path": resolve_checkpoint(where, storage_options)}
            if not is_url(message["path"]) and sharded.is_sharded(message["path"]):
                message["commit"] = sharded.read_commit(message["path"])  # the version every rank opens
        except (CheckpointError, OSError) as exc:
            message = {"error": str(exc), "type": type(exc).__name__}
        message = decode(comm.broadcast(encode(message), 0, timeout), where)
    else:
        message = decode(comm.broadcast(None, 0, timeout), where)
    if "error" in message:
        raise _error_type(message["type"])(message["error"])
    result, error = None, None
    target, commit = message["path"], message.get("commit")
    try:
        result = restore_from(lambda: sharded.ShardedReader(target, commit=commit) if commit is not None
                              else open_checkpoint(target, storage_options), variables, strict, allow_cast)
    except Exception as exc:
        error = _saved_again(target, commit, exc) or exc
    outcome = None if error is None else {"error": str(error), "type": type(error).__name__}
    outcomes = [decode(raw, where) for raw in comm.allgather(encode(outcome), timeout)]
    failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
    if error is not None:
        raise error
    if failed:
        ranks = ", ".join(str(r) for r, _ in failed)
        first = failed[0][1]
        raise _error_type(first["type"])(
            f"{message['path']}: the restore failed on rank(s) {ranks} (this rank, {comm.rank}, restored its "
            f"variables); rank {failed[0][0]}: {first['error']}")
    assert result is not None
    return result


def _saved_again(path: str, commit: bytes | None, exc: Exception) -> CheckpointError | None:
    """The error to raise when the version of ``path`` the ranks restore (``commit``) lost files
    because the checkpoint was saved again, or deleted, meanwhile (not damage); else None."""
    if commit is None or not isinstance(exc, (CorruptCheckpointError, CheckpointNotFoundError)):
        return None
    try:
        if sharded.read_commit(path) == commit:
            return None  # still the same version: the failure is what it says
    except CheckpointError:
        pass  # no record any more: deleted (retention), or being saved again
    replaced = CheckpointNotFoundError(
        f"{path}: saved again (or deleted) while the ranks restored it: the version rank 0 found is gone; "
        f"restore again ({exc})")
    replaced.__cause__ = exc
    return replaced


def _error_type(name: str) -> type[CheckpointError]:
    """The CheckpointError class called ``name`` (another rank's error, raised here too)."""
    found = getattr(errors, name, None)
    return found if isinstance(found, type) and issubclass(found, CheckpointError) else CheckpointError
