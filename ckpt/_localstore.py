"""A checkpoint directory on a local file system: the :class:`ckpt.storage.Store` of local paths
(internal; ``open_store`` picks it or the object-store one).

Atomic writes are ``ckpt.atomic``'s (temporary file, fsync, rename, fsync of the directory,
with its locking and stale-temporary cleanup); the state file is ``ckpt.state``'s, read and
rewritten under the directory's ``flock``. A commit renames the new checkpoint into place,
records it and deletes what retention dropped under that one lock, so another saver's
retention never deletes a file this save put in place.

Example:
    >>> import tempfile
    >>> from ckpt._localstore import open_store
    >>> store = open_store(tempfile.mkdtemp())
    >>> store.write_checkpoint("notes.txt", lambda blob: blob.write_at(b"hello", 0))
    >>> store.list_names(), store.read_state() is None
    (['notes.txt'], True)
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import TypeVar

from . import _urls
from .atomic import is_temporary, replace_atomically
from .errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError, ReplacedWriteError
from .formats import _io
from .formats.base import format_for_path, formats  # the registry: formats claim prefixes, directories
from .state import LOCK_FILE, STATE_FILE, CheckpointState, read_state, state_lock, write_state
from .storage import Listed, ReadableBlob, StateChange, Store, WritableBlob

__all__ = ["LocalStore", "open_store", "store_of", "remove_checkpoint", "checkpoint_exists", "fill_file"]

T = TypeVar("T")


def fill_file(path: str, write: Callable[[WritableBlob], None]) -> None:
    """Run ``write`` on a :class:`ckpt.formats._io.LocalSink` over the (new, empty) file ``path``."""
    with _io.LocalSink(path) as blob:
        write(blob)


def checkpoint_exists(path: str) -> bool:
    """True for an existing checkpoint file, or a path a format claims (a TensorFlow prefix, a
    sharded checkpoint's directory)."""
    return os.path.isfile(path) or any(f.claims(path) for f in formats())


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint: a file, or a sharded checkpoint's directory (its commit record
    first, so a deletion cut short leaves an uncommitted directory the next save removes)."""
    if os.path.isdir(path) and not os.path.islink(path):
        # lazy: a format module, imported only when a sharded checkpoint is deleted (format modules load on use)
        from .formats.ckpt_sharded import COMMIT

        try:
            os.unlink(os.path.join(path, COMMIT))
        except FileNotFoundError:
            pass
        shutil.rmtree(path, ignore_errors=True)
    else:
        os.unlink(path)


class LocalStore:
    """A local directory of checkpoints (it need not exist yet: writing creates it)."""

    def __init__(self, directory: str) -> None:
        self.location = directory

    def join(self, name: str) -> str:
        return os.path.join(self.location, name)

    def open(self, name: str) -> ReadableBlob:
        blob: ReadableBlob = _io.LocalFile(self.join(name))
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
                         check: Callable[[str], None] | None = None) -> None:
        self.write_file(name, write, check)

    def write_file(self, name: str, write: Callable[[WritableBlob], None],
                   check: Callable[[str], None] | None = None) -> int:
        with replace_atomically(self.join(name)) as tmp:
            fill_file(tmp, write)
            if check is not None:
                check(tmp)
            return os.path.getsize(tmp)

    def read_state(self) -> CheckpointState | None:
        return read_state(self.location)

    def update_state(self, change: Callable[[CheckpointState | None], tuple[CheckpointState, T]]) -> T:
        with state_lock(self.location):
            state, result = change(read_state(self.location))
            write_state(self.location, state)
            return result

    def commit(self, name: str, write: Callable[[WritableBlob], None], change: StateChange,
               step: int | None = None) -> CheckpointState:
        path = self.join(name)
        flush_error: ReplacedWriteError | None = None
        with ExitStack() as held:
            # rename, record and retention's deletions happen under the directory's lock
            def lock() -> None:
                try:
                    held.enter_context(state_lock(self.location))
                except CheckpointWriteError as exc:
                    raise CheckpointWriteError(f"{path}: not saved, the state file cannot be locked: {exc}; "
                                               "the previous checkpoint is still the latest") from exc

            try:
                state = read_state(self.location) if os.path.isdir(self.location) else None
            except OSError as exc:
                if isinstance(exc, CheckpointError):
                    raise
                raise CheckpointWriteError(f"{path}: cannot read the state file of {self.location}: "
                                           f"{exc.strerror or exc}; nothing was written") from exc
            listed_before = state is not None and any(e.path == name for e in state.all_entries())
            try:
                with replace_atomically(path, before_rename=lock) as tmp:
                    fill_file(tmp, write)
            except ReplacedWriteError as exc:
                flush_error = exc  # complete and in place (fsynced before the rename): record it, then report
            written = self.record(name, change, listed_before)
        if flush_error is not None:
            raise flush_error
        return written

    def record(self, name: str, change: StateChange, listed_before: bool) -> CheckpointState:
        """Write the state ``change`` gives and delete what it drops; the caller holds the lock.

        If the state file cannot be written, a new checkpoint is removed again (no orphan the
        size of a model stays on a full disk); one that replaced a listed file is kept.
        """
        path = self.join(name)
        try:
            state, doomed = change(read_state(self.location))
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
            raise CheckpointWriteError(
                f"{path}: the checkpoint was written but could not be recorded in the state file "
                f"{self.join(STATE_FILE)} ({cause}); "
                f"{'it was removed, and ' if not listed_before else ''}the previous checkpoint is "
                "still the latest") from exc
        for old in doomed:
            try:
                remove_checkpoint(self.join(old))
            except FileNotFoundError:
                pass
            except OSError as exc:
                warnings.warn(f"could not delete old checkpoint {old}: {exc}", stacklevel=4)
        return state

    def latest(self) -> str | None:
        state = read_state(self.location)
        for entry in reversed(state.all_entries() if state is not None else []):
            candidate = self.join(entry.path)  # TensorFlow may record absolute paths
            if checkpoint_exists(candidate):
                return candidate
        return None

    def listing(self) -> list[Listed]:
        if not os.path.isdir(self.location):
            what = "not a directory" if os.path.exists(self.location) else "no such directory"
            raise CheckpointNotFoundError(f"{self.location}: {what}")
        state = read_state(self.location)
        latest = self.latest()
        rows: list[Listed] = []
        known: set[str] = set()
        if state is not None:
            preserved = {e.path for e in state.preserved}
            for entry in state.all_entries():
                full = self.join(entry.path)  # TensorFlow may record absolute paths
                files = _files_of(full)
                known.update(os.path.abspath(f) for f in files)
                note = "latest" if full == latest else "missing" if not checkpoint_exists(full) else \
                    "preserved" if entry.path in preserved else ""
                rows.append((entry.path, entry.step, entry.time or None, _size(files), note))
        for name in sorted(os.listdir(self.location)):
            full = self.join(name)
            if os.path.abspath(full) in known or name == STATE_FILE or is_temporary(name) or \
                    not os.path.isfile(full) or format_for_path(name) is None:
                continue
            rows.append((name, None, os.path.getmtime(full), _size([full]), f"not in the '{STATE_FILE}' state file"))
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


def open_store(location: str, storage_options: _urls.StorageOptions | None = None) -> Store:
    """The Store of a directory path or URL ("s3://bucket/run").

    Example:
        >>> open_store("/tmp/run").join("m.h5")
        '/tmp/run/m.h5'
    """
    if _urls.is_url(location):
        from ._remote import RemoteDirectory  # object-store support is imported only for URLs

        return RemoteDirectory(location, storage_options)
    return LocalStore(location)


def store_of(path: str, storage_options: _urls.StorageOptions | None = None) -> Store:
    """The Store of the directory a checkpoint path or URL is in.

    Example:
        >>> store_of("s3://bucket/run/m.h5").location
        's3://bucket/run'
    """
    if _urls.is_url(path):
        return open_store(_urls.split(path)[0], storage_options)
    return open_store(os.path.dirname(os.path.abspath(path)))
