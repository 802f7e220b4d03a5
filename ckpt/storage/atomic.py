"""Atomic file replacement: a crash at any moment leaves the old file or the complete new one.

A new file is written under a temporary name in the same directory, flushed to disk,
renamed over the target, and the directory entry is flushed. The writer holds an exclusive
``flock`` on its temporary file for as long as it lives, so a later save can tell a
leftover of a killed process (unlocked) from a file another process is still writing
(locked), and delete only the former.

Example:
    >>> import os, tempfile
    >>> from ckpt.storage.atomic import replace_atomically
    >>> target = os.path.join(tempfile.mkdtemp(), "state.json")
    >>> with replace_atomically(target) as tmp:
    ...     with open(tmp, "w") as f:
    ...         _ = f.write("{}")
    >>> with open(target) as f:
    ...     f.read()
    '{}'
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ckpt.errors import CheckpointError, CheckpointWriteError, ReplacedWriteError

__all__ = ["replace_atomically", "require_directory", "is_temporary", "clean_stale_temporaries",
           "fsync_directory", "remove_live_temporaries"]

_TEMP_MARK = ".ckpt-tmp-"

# This process's temporary files still being written: a process that abandons its saves on the way
# out (a second Ctrl-C at exit) removes them instead of leaving them to the next save's cleanup.
_live_lock = threading.Lock()
_live: set[str] = set()


def remove_live_temporaries() -> list[str]:
    """Delete the temporary files this process is writing now; return their paths.

    For a process about to end with saves unfinished: their writers must not touch the files
    afterwards (the rename then fails, so the previous checkpoint stays the latest)."""
    with _live_lock:
        paths = sorted(_live)
        _live.clear()
    for path in paths:
        _unlink_quietly(path)
    return paths


def is_temporary(name: str) -> bool:
    """True for the name of an in-progress (or abandoned) temporary file."""
    return name.startswith(".") and _TEMP_MARK in name


def fsync_directory(directory: str) -> None:
    """Flush a directory's entries (a rename is durable only after this)."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:  # some filesystems cannot fsync directories; nothing more to do there
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _create_locked(directory: str, base: str) -> tuple[int, str]:
    """Create and lock a fresh temporary file; retry if a cleaner took it before we locked it."""
    for _ in range(100):
        tmp = os.path.join(directory, f".{base}{_TEMP_MARK}{os.urandom(6).hex()}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                with _live_lock:
                    _live.add(tmp)
                return fd, tmp
        except (BlockingIOError, FileNotFoundError):
            pass  # another save's cleanup claimed it between create and lock
        except BaseException:  # e.g. no locks on this filesystem: leave no file behind
            _unlink_quietly(tmp)
            _close_quietly(fd)
            raise
        os.close(fd)
    raise CheckpointWriteError(f"{directory}: could not create a temporary file")


def require_directory(path: str) -> None:
    """Make sure the directory ``path`` is to be written in exists: create it and its missing
    parents as TensorFlow, orbax and torch do, durably (each new directory's entry is fsynced
    in its parent, so a crash cannot lose the directory of a saved checkpoint).

    Raises:
        CheckpointWriteError: naming ``path``, when a directory cannot be created (a file in
            the way, no permission, a full disk).
    """
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    missing = []
    while not os.path.isdir(directory) and os.path.dirname(directory) != directory:
        missing.append(directory)
        directory = os.path.dirname(directory)
    for new in reversed(missing):
        try:
            try:
                os.mkdir(new)
            except FileExistsError:
                if not os.path.isdir(new):
                    raise
                continue  # another process made it first (and made it durable)
            fsync_directory(os.path.dirname(new))
        except OSError as exc:
            raise CheckpointWriteError(f"{path}: cannot create the directory {new}: "
                                       f"{exc.strerror or exc}") from exc


@contextmanager
def replace_atomically(path: str, before_rename: Callable[[], object] | None = None, *,
                       clean: bool = True) -> Iterator[str]:
    """Yield a temporary path next to ``path``; on success it atomically becomes ``path``.

    With ``clean`` (the default), temporary files that killed writers left in the directory
    are deleted first (``clean_stale_temporaries``), so every save or convert into a directory
    removes what an interrupted one left there.

    On any error before the rename the temporary file is removed, ``path`` is untouched and
    the error is re-raised (OS errors as CheckpointWriteError naming the file).
    ``before_rename`` is called once the new file is on disk, just before the rename (the
    Saver takes the directory's state lock there, so renaming and recording are one step).

    Missing parent directories are created first (see ``require_directory``).

    Raises:
        CheckpointWriteError: the file could not be written (full disk, permissions, ...).
        ReplacedWriteError: (a CheckpointWriteError) ``path`` was replaced, but closing the file
            or flushing the directory failed afterwards.
    """
    path = os.path.abspath(path)
    directory, base = os.path.split(path)
    require_directory(path)
    if clean:
        clean_stale_temporaries(directory)
    try:
        fd, tmp = _create_locked(directory, base)
    except OSError as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointWriteError(f"{path}: cannot create a file in {directory}: "
                                   f"{exc.strerror or exc}") from exc
    replaced = False
    try:
        try:
            yield tmp
            os.fsync(fd)
            if before_rename is not None:
                before_rename()
            os.replace(tmp, path)
            replaced = True
            _forget(tmp)
        except BaseException as exc:
            _forget(tmp)
            _unlink_quietly(tmp)
            _close_quietly(fd)  # a failing close must not hide the error that stopped the write
            renamed = _naming(exc, tmp, path)
            if renamed is not exc:
                raise renamed from exc
            raise
        os.close(fd)
        fsync_directory(directory)
    except OSError as exc:
        if isinstance(exc, CheckpointError):
            raise
        if replaced:
            raise ReplacedWriteError(f"{path}: the new file is complete and in place, but flushing it to "
                                     f"disk failed: {exc.strerror or exc}; it may not survive a power "
                                     "loss") from exc
        raise CheckpointWriteError(f"{path}: writing failed: {exc.strerror or exc}; the previous "
                                   "file, if any, is untouched") from exc


def _forget(tmp: str) -> None:
    with _live_lock:
        _live.discard(tmp)


def _naming(exc: BaseException, tmp: str, path: str) -> BaseException:
    """``exc`` with the temporary file's name replaced by the target's (users never see temp names)."""
    message = str(exc)
    if tmp not in message or not isinstance(exc, (CheckpointError, ValueError, TypeError)):
        return exc
    try:
        return type(exc)(message.replace(tmp, path))
    except TypeError:  # an exception class with another constructor: keep it as it is
        return exc


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def clean_stale_temporaries(directory: str) -> list[str]:
    """Delete temporary files whose writer is gone (killed mid-save); return their names.

    A file whose lock is still held belongs to a save in progress and is left alone.
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not is_temporary(name):
            continue
        tmp = os.path.join(directory, name)
        try:
            fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                os.unlink(tmp)
                removed.append(name)
        except OSError:
            pass  # locked by a live writer, or already gone
        finally:
            os.close(fd)
    return removed
