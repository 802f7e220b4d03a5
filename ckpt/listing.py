"""A directory's checkpoints: ``list_checkpoints``, what ``ckpt ls`` prints.

The rows come from the directory's state file (path, step, time, which is latest), then the
checkpoint files the state file does not know. Object-store directories ("s3://bucket/run")
list the same rows, from the state file and the commit records.

Example:
    >>> import ckpt, tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> saver = ckpt.Saver({"v": ckpt.Variable(1.0)})
    >>> _ = saver.save(os.path.join(d, "model.h5"), global_step=1)
    >>> _ = saver.save(os.path.join(d, "model.h5"), global_step=2)
    >>> [(c.path, c.step, c.latest) for c in ckpt.list_checkpoints(d)]
    [('model-1.h5', 1, False), ('model-2.h5', 2, True)]
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ._urls import StorageOptions, is_url
from .atomic import is_temporary
from .errors import CheckpointNotFoundError
from .state import STATE_FILE, latest_checkpoint, read_state

__all__ = ["ListedCheckpoint", "list_checkpoints"]


@dataclass(frozen=True)
class ListedCheckpoint:
    """One checkpoint of a directory.

    ``path`` is relative to the directory (as the state file records it); ``step``, ``time``
    (seconds since the epoch) and ``size`` (bytes, every file of the checkpoint) are None when
    unknown; ``note`` is "latest", "preserved", "missing" (listed but gone), "" or says that the
    state file does not list it.
    """

    path: str
    step: int | None
    time: float | None
    size: int | None
    note: str

    @property
    def latest(self) -> bool:
        """True for the checkpoint a restore of the directory would read."""
        return self.note == "latest"

    def to_json(self) -> dict[str, Any]:
        """The JSON view: the fields and "latest"."""
        return {"path": self.path, "step": self.step, "time": self.time, "size": self.size, "note": self.note,
                "latest": self.latest}


def list_checkpoints(directory: str | os.PathLike[str],
                     storage_options: StorageOptions | None = None) -> list[ListedCheckpoint]:
    """List a directory's checkpoints: the state file's entries oldest first, then unknown files.

    Args:
        directory: a local directory or an object-store URL ("s3://bucket/run").
        storage_options: for a URL, options for the store's fsspec filesystem.

    Returns:
        One ListedCheckpoint per checkpoint; the latest one has ``latest`` True.

    Raises:
        CheckpointNotFoundError: no such directory, or it holds no checkpoints.
        CorruptCheckpointError: its state file is damaged.

    Example:
        >>> import ckpt, tempfile
        >>> ckpt.list_checkpoints(tempfile.mkdtemp())
        Traceback (most recent call last):
        ...
        ckpt.errors.CheckpointNotFoundError: ...: no checkpoints (no 'checkpoint' state file and no checkpoint files)
    """
    directory = os.fspath(directory)
    if is_url(directory):
        from . import _remote

        with _remote.using(storage_options):
            rows = [ListedCheckpoint(*row) for row in _remote.listing(directory)]
    elif not os.path.isdir(directory):
        what = "not a directory" if os.path.exists(directory) else "no such directory"
        raise CheckpointNotFoundError(f"{directory}: {what}")
    else:
        rows = list(_local_rows(directory))
    if not rows:
        raise CheckpointNotFoundError(f"{directory}: no checkpoints (no '{STATE_FILE}' state file and no "
                                      "checkpoint files)")
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


def _local_rows(directory: str) -> Iterator[ListedCheckpoint]:
    from .formats.base import checkpoint_exists, format_for_path

    state = read_state(directory)
    latest = latest_checkpoint(directory)
    known: set[str] = set()
    if state is not None:
        preserved = {e.path for e in state.preserved}
        for entry in state.all_entries():
            full = os.path.join(directory, entry.path)  # TensorFlow may record absolute paths
            files = _files_of(full)
            known.update(os.path.abspath(f) for f in files)
            note = "latest" if full == latest else "missing" if not checkpoint_exists(full) else \
                "preserved" if entry.path in preserved else ""
            yield ListedCheckpoint(entry.path, entry.step, entry.time or None, _size(files), note)
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if os.path.abspath(full) in known or name == STATE_FILE or is_temporary(name) or \
                not os.path.isfile(full) or format_for_path(name) is None:
            continue
        yield ListedCheckpoint(name, None, os.path.getmtime(full), _size([full]),
                               f"not in the '{STATE_FILE}' state file")
