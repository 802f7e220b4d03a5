"""What a save changes in its directory's state file: the owner check, the new entry, retention.

The Saver and the sharded save (ckpt/distributed/save.py) both commit through one
:class:`Retention` (max_to_keep, keep-every-N-hours): it builds the state change a commit
applies under the directory's lock (``Store.commit``, ``Store.record``) and reads back which
checkpoints are kept.

Example:
    >>> from ckpt.storage.state import CheckpointState
    >>> keep = Retention(max_to_keep=2)
    >>> state = CheckpointState()
    >>> for name in ("m-1.h5", "m-2.h5", "m-3.h5"):
    ...     state, doomed = keep.apply(state, name, None, lambda name: True)
    >>> [e.path for e in state.checkpoints], doomed
    (['m-2.h5', 'm-3.h5'], ['m-1.h5'])
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

from ckpt.errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError, CorruptCheckpointError, \
    StorageError
from ckpt.storage import StateChange, Store
from ckpt.storage.local import LocalStore
from ckpt.saving.stores import REGISTRY
from ckpt.storage.state import STATE_FILE, CheckpointEntry, CheckpointState, read_state, state_lock

__all__ = ["Retention", "check_owner", "read_owner", "read_local_owner", "kept_paths"]


@dataclass(frozen=True)
class Retention:
    """Which checkpoints of a directory a save keeps.

    Args:
        max_to_keep: keep the newest N (None: all).
        keep_hours: additionally keep one checkpoint per this many hours forever (None: none).
    """

    max_to_keep: int | None = None
    keep_hours: float | None = None

    def apply(self, state: CheckpointState, name: str, step: int | None,
              exists: Callable[[str], bool]) -> tuple[CheckpointState, list[str]]:
        """Add ``name`` to ``state`` and apply max_to_keep / keep-every-N-hours; return the new
        state and the names to delete."""
        now = time.time()
        doomed: list[str] = []
        state.checkpoints = [e for e in state.checkpoints if e.path != name]
        state.preserved = [e for e in state.preserved if e.path != name]
        state.checkpoints.append(CheckpointEntry(name, now, step))
        if state.last_preserved_time is None:
            state.last_preserved_time = now
        while self.max_to_keep is not None and len(state.checkpoints) > self.max_to_keep:
            old = state.checkpoints.pop(0)
            if self.keep_hours and old.time - self.keep_hours * 3600 >= state.last_preserved_time:
                state.preserved.append(old)
                state.last_preserved_time = old.time
            else:
                doomed.append(old.path)
        # recorded before deleting: a save killed in between leaves the files to the next save
        kept = {e.path for e in state.checkpoints + state.preserved}
        leftover = [n for n in state.deleting if exists(n)]
        state.deleting = [n for n in dict.fromkeys(leftover + doomed) if n not in kept]
        return state, list(state.deleting)

    def change(self, store: Store, path: str, step: int | None) -> StateChange:
        """The state file's change for a save of ``path``: refuse another program's state file,
        add the checkpoint, apply retention."""
        name = os.path.basename(path)
        return lambda state: self.apply(check_owner(state, store.location, path) or CheckpointState(),
                                        name, step, store.exists)

    def record(self, path: str, step: int | None, listed_before: bool, locked: bool = False) -> CheckpointState:
        """Add a checkpoint put in place by the caller (a sharded save) to its directory's state
        file and apply retention (``LocalStore.record``); ``locked``: the caller holds the lock."""
        store = LocalStore(os.path.dirname(os.path.abspath(path)), REGISTRY)
        with state_lock(store.location) if not locked else nullcontext():
            return store.record(os.path.basename(path), self.change(store, path, step), listed_before)


def check_owner(state: CheckpointState | None, directory: str, path: str) -> CheckpointState | None:
    """``state``, unless another program owns it (CheckpointWriteError: ckpt will not rewrite it)."""
    if state is not None and state.written_by != "ckpt":
        raise CheckpointWriteError(
            f"{path}: {directory} holds a {state.written_by} '{STATE_FILE}' state file; save ckpt "
            "checkpoints into another directory (ckpt will not rewrite it)", path=path)
    return state


def read_owner(store: Store, path: str) -> CheckpointState | None:
    """Read the state file of ``store`` before anything is written, refusing one another program
    owns; a damaged one reads as None (ckpt's to rewrite: the commit goes by the checkpoints)."""
    try:
        return check_owner(store.read_state(), store.location, path)
    except CorruptCheckpointError:
        return None
    except CheckpointNotFoundError as exc:  # the bucket: as a missing directory is for files
        raise CheckpointNotFoundError(f"{path}: cannot save: {exc}", path=path) from exc
    except StorageError as exc:
        raise CheckpointWriteError(f"{path}: cannot save: {exc}; nothing was committed", path=path) from exc
    except OSError as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointWriteError(f"{path}: cannot read the state file of {store.location}: "
                                   f"{exc.strerror or exc}; nothing was written", path=path) from exc


def read_local_owner(directory: str, path: str) -> CheckpointState | None:
    """``read_owner`` for a local directory, where an unreadable file is the caller's to report."""
    try:
        state = read_state(directory)
    except CorruptCheckpointError:
        return None
    return check_owner(state, directory, path)


def kept_paths(path: str, state: CheckpointState) -> list[str]:
    """The paths of the checkpoints ``state`` keeps beside ``path``, oldest first."""
    return [os.path.join(os.path.dirname(path), e.path) for e in state.checkpoints]
