"""A directory's checkpoints: ``list_checkpoints``, what ``ckpt ls`` prints.

The rows come from the directory's state file (path, step, time, metrics, which is latest), then the
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
from dataclasses import dataclass, replace
from typing import Any

from ckpt.saving.incremental import chunk_usage
from ckpt.saving.stores import open_store
from ckpt.storage.urls import is_url
from ckpt.storage.urls import StorageOptions
from ckpt.errors import CheckpointNotFoundError
from ckpt.storage.state import STATE_FILE

__all__ = ["ListedCheckpoint", "list_checkpoints"]


@dataclass(frozen=True)
class ListedCheckpoint:
    """One checkpoint of a directory.

    ``path`` is relative to the directory (as the state file records it); ``step``, ``time``
    (seconds since the epoch) and ``size`` (bytes, every file of the checkpoint) are None when
    unknown; ``note`` is "latest", "preserved", "missing" (listed but gone), "" or says that the
    state file does not list it; ``metrics`` are those its save was given (``save(..., metrics=)``),
    or None. ``owned`` is what deleting it alone would free: its files and, for an incremental
    checkpoint, the chunks no other listed checkpoint references; ``shared`` the bytes of the
    chunks it shares with other listed checkpoints (0 for a self-contained checkpoint); both None
    when unknown.
    """

    path: str
    step: int | None
    time: float | None
    size: int | None
    note: str
    metrics: dict[str, float] | None = None
    owned: int | None = None
    shared: int | None = None

    @property
    def latest(self) -> bool:
        """True for the checkpoint a restore of the directory would read."""
        return self.note == "latest"

    def to_json(self) -> dict[str, Any]:
        """The JSON view: the fields and "latest"."""
        return {"path": self.path, "step": self.step, "time": self.time, "size": self.size, "note": self.note,
                "latest": self.latest, "metrics": self.metrics, "owned": self.owned, "shared": self.shared}


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
    rows = [ListedCheckpoint(*row) for row in open_store(directory, storage_options).listing()]
    if not rows:
        raise CheckpointNotFoundError(f"{directory}: no checkpoints (no '{STATE_FILE}' state file and no "
                                      "checkpoint files)", path=directory)
    return _with_usage(directory, rows, storage_options)


def _with_usage(directory: str, rows: list[ListedCheckpoint],
                storage_options: StorageOptions | None = None) -> list[ListedCheckpoint]:
    """The rows with ``owned`` and ``shared`` (an incremental checkpoint's chunks counted)."""
    present = [row.path for row in rows if row.note != "missing"]
    if is_url(directory):
        from ckpt.saving.incremental_remote import remote_chunk_usage  # lazy: object stores only
        from ckpt.storage.remote import RemoteDirectory

        store = open_store(directory, storage_options)
        assert isinstance(store, RemoteDirectory)
        usage = remote_chunk_usage(store, present)
    else:
        usage = chunk_usage(directory, present)
    out = []
    for row in rows:
        if row.size is None or row.note == "missing":
            out.append(row)
            continue
        owned, shared = usage.get(row.path, (0, 0))
        out.append(replace(row, owned=row.size + owned, shared=shared))
    return out
