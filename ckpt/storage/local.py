"""A checkpoint directory on a local file system: the :class:`ckpt.storage.Store` of local paths
(internal; ``open_store`` picks it or the object-store one).

Atomic writes are ``ckpt.storage.atomic``'s (temporary file, fsync, rename, fsync of the directory,
with its locking and stale-temporary cleanup); the state file is ``ckpt.storage.state``'s, read and
rewritten under the directory's ``flock``. A commit renames the new checkpoint into place,
records it and deletes what retention dropped under that one lock, so another saver's
retention never deletes a file this save put in place. Before the rename the state file is
written with the new checkpoint *pending* (``ckpt.storage.state.settle``): a save killed between the
rename and the state file's final write still leaves its checkpoint the latest. A damaged state
file is replaced, for readers and for the next save, by the verified checkpoints of the
directory (``ckpt.storage.recovery``). What is a checkpoint beyond a plain file (a TensorFlow
prefix, a sharded checkpoint's directory) and whether one verifies the store asks its
:class:`ckpt.storage.Catalog` (the format registry, handed in by ``ckpt.saving.stores``).

Example:
    >>> import tempfile
    >>> from ckpt.storage.local import LocalStore
    >>> store = LocalStore(tempfile.mkdtemp())
    >>> store.write_checkpoint("notes.txt", lambda blob: blob.write_at(b"hello", 0))
    >>> store.list_names(), store.read_state() is None
    (['notes.txt'], True)
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import TypeVar

from ckpt.storage.atomic import is_temporary, replace_atomically
from ckpt.storage.recovery import is_candidate, recover_state
from ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    ReplacedWriteError,
)
from ckpt.storage.localfile import LocalFile, LocalSink
from ckpt.storage.state import (
    LOCK_FILE,
    STATE_FILE,
    CheckpointEntry,
    CheckpointState,
    read_state,
    settle,
    state_lock,
    with_pending,
    write_state,
)
from ckpt.storage import FILES_ONLY, Catalog, Listed, ReadableBlob, StateChange, WritableBlob
from ckpt.storage.commits import SHARDED_COMMIT

__all__ = ["LocalStore", "remove_checkpoint", "checkpoint_exists", "fill_file"]

T = TypeVar("T")


def fill_file(path: str, write: Callable[[WritableBlob], None]) -> None:
    """Run ``write`` on a :class:`ckpt.storage.localfile.LocalSink` over the (new, empty) file ``path``."""
    with LocalSink(path) as blob:
        write(blob)


def checkpoint_exists(path: str, catalog: Catalog) -> bool:
    """True for an existing checkpoint file, or a path a format of ``catalog`` claims (a
    TensorFlow prefix, a sharded checkpoint's directory)."""
    return os.path.isfile(path) or catalog.claims(path)


def _committing_file(path: str) -> str:
    """The file whose rename commits the checkpoint ``path``: the file, or a sharded
    checkpoint's commit record."""
    if os.path.isdir(path) and not os.path.islink(path):
        return os.path.join(path, SHARDED_COMMIT)
    return path


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint: a file, or a sharded checkpoint's directory (its commit record
    first, so a deletion cut short leaves an uncommitted directory the next save removes)."""
    if os.path.isdir(path) and not os.path.islink(path):
        try:
            os.unlink(os.path.join(path, SHARDED_COMMIT))
        except FileNotFoundError:
            pass
        import shutil  # lazy: only a sharded checkpoint's removal needs it (with bz2 and lzma, ~3 ms of a process)

        shutil.rmtree(path, ignore_errors=True)
    else:
        os.unlink(path)


class LocalStore:
    """A local directory of checkpoints (it need not exist yet: writing creates it); ``catalog``
    says which paths are checkpoints beyond plain files, and verifies them (the format registry,
    ``ckpt.saving.stores.REGISTRY``; without it only plain files count and nothing is recovered)."""

    def __init__(self, directory: str, catalog: Catalog = FILES_ONLY) -> None:
        self.location = directory
        self.catalog = catalog

    def join(self, name: str) -> str:
        return os.path.join(self.location, name)

    def open(self, name: str) -> ReadableBlob:
        blob: ReadableBlob = LocalFile(self.join(name))
        return blob

    def exists(self, name: str) -> bool:
        return os.path.lexists(self.join(name))

    def list_names(self) -> list[str]:
        try:
            names = os.listdir(self.location)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(n for n in names if not is_temporary(n) and n != LOCK_FILE)

    def delete_checkpoints(self, names: Sequence[str]) -> None:
        for name in names:
            try:
                remove_checkpoint(self.join(name))
            except FileNotFoundError:
                pass

    def write_checkpoint(self, name: str, write: Callable[[WritableBlob], None],
                         check: Callable[[ReadableBlob], None] | None = None) -> None:
        self.write_file(name, write, check)

    def write_file(self, name: str, write: Callable[[WritableBlob], None],
                   check: Callable[[ReadableBlob], None] | None = None) -> int:
        with replace_atomically(self.join(name)) as tmp:
            fill_file(tmp, write)
            if check is not None:
                with LocalFile(tmp) as blob:
                    check(blob)
            return os.path.getsize(tmp)

    def read_state(self) -> CheckpointState | None:
        return read_state(self.location)

    def update_state(self, change: Callable[[CheckpointState | None], tuple[CheckpointState, T]]) -> T:
        with state_lock(self.location):
            state, result = change(read_state(self.location))
            write_state(self.location, state)
            return result

    def commit(self, name: str, write: Callable[[WritableBlob], None], change: StateChange,
               step: int | None = None, metrics: Mapping[str, float] | None = None) -> CheckpointState:
        path = self.join(name)
        flush_error: ReplacedWriteError | None = None
        read: list[CheckpointState] = []  # the state file as read under the lock, once per commit
        with ExitStack() as held:
            # intent, rename, record and retention's deletions happen under the directory's lock
            def lock() -> None:
                try:
                    held.enter_context(state_lock(self.location))
                except CheckpointWriteError as exc:
                    raise CheckpointWriteError(f"{path}: not saved, the state file cannot be locked: {exc}; "
                                               "the previous checkpoint is still the latest") from exc
                read.append(self.intend(name, step, tmp, metrics))

            try:
                with replace_atomically(path, before_rename=lock) as tmp:
                    fill_file(tmp, write)
            except ReplacedWriteError as exc:
                flush_error = exc  # complete and in place (fsynced before the rename): record it, then report
            # nobody else writes the state file while the lock is held: the state read by ``intend`` is
            # the one to change (its settled entries, without this save's pending one)
            written = self.record(name, change, state=read[0])
        if flush_error is not None:
            raise flush_error
        return written

    def intend(self, name: str, step: int | None, new_file: str,
               metrics: Mapping[str, float] | None = None) -> CheckpointState:
        """Write the state file with ``name`` pending, before ``new_file`` (complete, fsynced) is
        renamed into place to commit it; the caller holds the lock. Where the rename replaces a
        file, the entry names ``new_file``'s inode: the old file of that name is not this save's.
        Returns the state as read (settled, without the new pending entry)."""
        path = self.join(name)
        try:
            state = self.state_for_update()
            if state.written_by != "ckpt":
                raise CheckpointWriteError(f"{self.join(STATE_FILE)}: a {state.written_by} state file; ckpt will "
                                           "not rewrite it")
            replaces = os.path.lexists(_committing_file(path))
            entry = CheckpointEntry(name, time.time(), step, str(os.stat(new_file).st_ino) if replaces else None,
                                    None if metrics is None else dict(metrics))
            write_state(self.location, with_pending(dataclasses.replace(state), entry))
            return state
        except OSError as exc:  # CheckpointWriteError included
            cause = exc if isinstance(exc, CheckpointError) else (exc.strerror or exc)
            raise CheckpointWriteError(f"{path}: not saved, the state file cannot be written ({cause}); the "
                                       "previous checkpoint is still the latest") from exc

    def state_for_update(self) -> CheckpointState:
        """The state a save changes: pending entries settled, a damaged file replaced by the
        directory's verified checkpoints (with a warning), an empty one for no state file."""
        return self.effective_state() or CheckpointState()

    def effective_state(self, recording: str | None = None) -> CheckpointState | None:
        """The state readers go by: ``read_state`` with pending entries settled (counted where their
        commit happened, dropped where not; ``recording``'s dropped: its save adds it); for a damaged
        state file, the verified checkpoints of the directory, with a StateFileWarning."""
        try:
            state = read_state(self.location)
        except CorruptCheckpointError as exc:
            state = self._recovered(exc)
        return None if state is None else settle(state, self._committed, recording)

    def _committed(self, entry: CheckpointEntry) -> bool:
        """True when the pending ``entry``'s save committed: its file (or commit record) is there,
        and is the file that save renamed into place where it named one."""
        path = self.join(entry.path)
        if entry.commit is None:
            return checkpoint_exists(path, self.catalog)
        try:
            return str(os.stat(_committing_file(path)).st_ino) == entry.commit
        except OSError:
            return False

    def _recovered(self, problem: CorruptCheckpointError) -> CheckpointState:
        found = []
        for name in self.list_names():
            full = self.join(name)
            if name != STATE_FILE and is_candidate(name, self.catalog) and checkpoint_exists(full, self.catalog):
                found.append((name, os.path.getmtime(full)))
        return recover_state(problem, found, self._verifies, self.catalog)

    def _verifies(self, name: str) -> bool:
        try:
            return self.catalog.verifies(self.join(name), None)
        except (CheckpointError, OSError):
            return False

    def record(self, name: str, change: StateChange, listed_before: bool | None = None,
               state: CheckpointState | None = None) -> CheckpointState:
        """Write the state ``change`` gives and delete what it drops; the caller holds the lock.

        ``state``: the state file as the caller read it under the lock (settled; read again when
        None). ``listed_before``: whether it listed ``name`` before this save (from ``state``
        when None). If the state file cannot be written, a new checkpoint is removed again (no
        orphan the size of a model stays on a full disk); one that replaced a listed file is kept.
        """
        path = self.join(name)
        if state is None:
            state = self.effective_state(recording=name)
        if listed_before is None:
            listed_before = state is not None and any(e.path == name for e in state.all_entries())
        try:
            state, doomed = change(state)
            write_state(self.location, state)
        except ReplacedWriteError:
            raise  # the state file names the new checkpoint; only its durability is in doubt
        except OSError as exc:  # CheckpointWriteError included
            cause = exc if isinstance(exc, CheckpointError) else (exc.strerror or exc)
            if not listed_before:
                try:
                    remove_checkpoint(path)
                except OSError:
                    pass
            outcome = "it was removed, and the previous checkpoint is still the latest" if not listed_before \
                else "it replaced the earlier file of that name, and the state file names it as pending"
            raise CheckpointWriteError(
                f"{path}: the checkpoint was written but could not be recorded in the state file "
                f"{self.join(STATE_FILE)} ({cause}); {outcome}") from exc
        for old in doomed:
            try:
                remove_checkpoint(self.join(old))
            except FileNotFoundError:
                pass
            except OSError as exc:
                warnings.warn(f"could not delete old checkpoint {old}: {exc}", stacklevel=4)
        return state

    def latest(self) -> str | None:
        return self._latest_in(self.effective_state())

    def _latest_in(self, state: CheckpointState | None) -> str | None:
        for entry in reversed(state.all_entries() if state is not None else []):
            candidate = self.join(entry.path)  # TensorFlow may record absolute paths
            if checkpoint_exists(candidate, self.catalog):
                return candidate
        return None

    def listing(self) -> list[Listed]:
        if not os.path.isdir(self.location):
            what = "not a directory" if os.path.exists(self.location) else "no such directory"
            raise CheckpointNotFoundError(f"{self.location}: {what}")
        state = self.effective_state()
        latest = self._latest_in(state)
        rows: list[Listed] = []
        known: set[str] = set()
        if state is not None:
            preserved = {e.path for e in state.preserved}
            for entry in state.all_entries():
                full = self.join(entry.path)  # TensorFlow may record absolute paths
                files = _files_of(full)
                known.update(os.path.abspath(f) for f in files + [full])
                note = "latest" if full == latest else "missing" if not checkpoint_exists(full, self.catalog) else \
                    "preserved" if entry.path in preserved else ""
                rows.append((entry.path, entry.step, entry.time or None, _size(files), note, entry.metrics))
        for name in sorted(os.listdir(self.location)):
            full = self.join(name)
            # a file, or a committed sharded checkpoint's directory
            if os.path.abspath(full) in known or name == STATE_FILE or is_temporary(name) or \
                    self.catalog.extension(name) is None or not checkpoint_exists(full, self.catalog):
                continue
            rows.append((name, None, os.path.getmtime(full), _size(_files_of(full)),
                         f"not in the '{STATE_FILE}' state file", None))
        return rows


def _files_of(path: str) -> list[str]:
    """The files of a checkpoint: the file itself, or those of a prefix (TensorFlow's
    "model.ckpt-7" is model.ckpt-7.index and model.ckpt-7.data-*)."""
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):  # a sharded checkpoint: its commit record and shard files
        return [os.path.join(path, n) for n in sorted(os.listdir(path)) if not n.startswith(".")]
    parent, prefix = os.path.split(path)
    try:
        names = os.listdir(parent or ".")
    except OSError:
        return []
    return [os.path.join(parent, n) for n in sorted(names) if n.startswith(prefix + ".")]


def _size(files: list[str]) -> int | None:
    return sum(os.path.getsize(f) for f in files) if files else None
