"""What a save changes in its directory's state file: the owner check, the new entry, retention.

The Saver and the sharded save (ckpt/distributed/save.py) both commit through one
:class:`Retention` (max_to_keep, keep-the-best-by-a-metric, keep-every-N-hours): it builds the state change a commit
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

import math
import numbers
import os
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

from ckpt.errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError, CorruptCheckpointError, \
    InvalidMetricsError, StorageError
from ckpt.storage import StateChange, Store
from ckpt.storage.local import LocalStore
from ckpt.saving.stores import REGISTRY
from ckpt.storage.state import STATE_FILE, CheckpointEntry, CheckpointState, read_state, state_lock

__all__ = ["Retention", "check_owner", "read_owner", "read_local_owner", "kept_paths", "best_entries",
           "check_metrics", "BEST_MODES"]

BEST_MODES = ("min", "max")


@dataclass(frozen=True)
class Retention:
    """Which checkpoints of a directory a save keeps.

    Args:
        max_to_keep: keep the newest N (None: all).
        keep_hours: additionally keep one checkpoint per this many hours forever (None: none).
        keep_best: additionally keep the N best checkpoints by ``best_metric`` (None: none).
        best_metric: the metric (``save(..., metrics=)``) that ranks checkpoints for ``keep_best``.
        best_mode: "min" (lower is better) or "max".
    """

    max_to_keep: int | None = None
    keep_hours: float | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"

    def apply(self, state: CheckpointState, name: str, step: int | None,
              exists: Callable[[str], bool],
              metrics: Mapping[str, float] | None = None) -> tuple[CheckpointState, list[str]]:
        """Add ``name`` (with its ``metrics``) to ``state`` and apply max_to_keep / keep_best /
        keep-every-N-hours; return the new state and the names to delete."""
        now = time.time()
        doomed: list[str] = []
        state.checkpoints = [e for e in state.checkpoints if e.path != name]
        state.preserved = [e for e in state.preserved if e.path != name]
        state.checkpoints.append(CheckpointEntry(name, now, step, metrics=None if metrics is None else dict(metrics)))
        if state.last_preserved_time is None:
            state.last_preserved_time = now
        if self.max_to_keep is not None and len(state.checkpoints) > self.max_to_keep:
            best = {id(e) for e in self._best(state.checkpoints)}
            newest = state.checkpoints[len(state.checkpoints) - self.max_to_keep:]
            kept_best: list[CheckpointEntry] = []
            for old in state.checkpoints[:len(state.checkpoints) - self.max_to_keep]:
                if id(old) in best:
                    kept_best.append(old)
                elif self.keep_hours and old.time - self.keep_hours * 3600 >= state.last_preserved_time:
                    state.preserved.append(old)
                    state.last_preserved_time = old.time
                else:
                    doomed.append(old.path)
            state.checkpoints = kept_best + newest  # still oldest first: both parts were in order
        # recorded before deleting: a save killed in between leaves the files to the next save
        kept = {e.path for e in state.checkpoints + state.preserved}
        leftover = [n for n in state.deleting if exists(n)]
        state.deleting = [n for n in dict.fromkeys(leftover + doomed) if n not in kept]
        return state, list(state.deleting)

    def _best(self, entries: Sequence[CheckpointEntry]) -> list[CheckpointEntry]:
        if not self.keep_best or self.best_metric is None:
            return []
        return best_entries(entries, self.best_metric, self.best_mode)[:self.keep_best]

    def change(self, store: Store, path: str, step: int | None,
               metrics: Mapping[str, float] | None = None) -> StateChange:
        """The state file's change for a save of ``path``: refuse another program's state file,
        add the checkpoint (with its ``metrics``), apply retention."""
        name = os.path.basename(path)
        return lambda state: self.apply(check_owner(state, store.location, path) or CheckpointState(),
                                        name, step, store.exists, metrics)

    def record(self, path: str, step: int | None, listed_before: bool, locked: bool = False,
               metrics: Mapping[str, float] | None = None) -> CheckpointState:
        """Add a checkpoint put in place by the caller (a sharded save) to its directory's state
        file and apply retention (``LocalStore.record``); ``locked``: the caller holds the lock."""
        store = LocalStore(os.path.dirname(os.path.abspath(path)), REGISTRY)
        with state_lock(store.location) if not locked else nullcontext():
            return store.record(os.path.basename(path), self.change(store, path, step, metrics), listed_before)


def best_entries(entries: Sequence[CheckpointEntry], metric: str, mode: str) -> list[CheckpointEntry]:
    """The entries that have ``metric``, best first ("min": lowest first; "max": highest); of
    equal values the newer (later in ``entries``, which are oldest first) comes first.

    Example:
        >>> e = [CheckpointEntry("a", 1, metrics={"loss": 0.5}), CheckpointEntry("b", 2),
        ...      CheckpointEntry("c", 3, metrics={"loss": 0.2}), CheckpointEntry("d", 4, metrics={"loss": 0.5})]
        >>> [x.path for x in best_entries(e, "loss", "min")]
        ['c', 'd', 'a']
    """
    sign = 1.0 if mode == "min" else -1.0
    ranked = [(sign * e.metrics[metric], -i, e) for i, e in enumerate(entries)
              if e.metrics is not None and metric in e.metrics]
    return [e for _, _, e in sorted(ranked, key=lambda r: (r[0], r[1]))]


def check_metrics(metrics: Mapping[str, object] | None, path: str) -> dict[str, float] | None:
    """``metrics`` as the state file records them: finite numbers by name.

    Raises:
        InvalidMetricsError: not a mapping of str to a finite real number (NaN and inf included).
    """
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping):
        raise InvalidMetricsError(f"cannot save {path}: metrics must be a dict of name -> number, got "
                                  f"{type(metrics).__name__}", path=path)
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise InvalidMetricsError(f"cannot save {path}: metric names are strings, got {name!r}", path=path)
        # numpy scalars are numbers.Real; bool is not a metric
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise InvalidMetricsError(f"cannot save {path}: metric {name!r} must be a real number, got "
                                      f"{type(value).__name__} {value!r}", path=path, key=name)
        number = float(value)
        if not math.isfinite(number):
            raise InvalidMetricsError(f"cannot save {path}: metric {name!r} is {number} (expected a finite "
                                      "number); nothing was written", path=path, key=name)
        out[name] = number
    return out


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
