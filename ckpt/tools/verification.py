"""Checking a checkpoint's structure and every checksum: ``verify``, what ``ckpt verify`` does.

Example:
    >>> import ckpt, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "m.h5")
    >>> _ = ckpt.Saver({"w": ckpt.Variable([1.0, 2.0])}).save(path)
    >>> report = ckpt.verify(path)
    >>> report.ok, report.tensors, report.problems
    (True, 1, [])
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckpt.errors import CheckpointError
from ckpt.storage import urls as _urls
from ckpt.tools.listing import list_checkpoints
from ckpt.tools.sources import Checkpoint, opened
from ckpt.storage.urls import StorageOptions

__all__ = ["Verification", "verify", "verify_directory"]

#: ``ListedCheckpoint.note`` of the checkpoints a directory keeps (and has)
_KEPT = ("", "latest", "preserved")


@dataclass(frozen=True)
class Verification:
    """The result of :func:`verify`: the checkpoint, its format, whether it carries checksums,
    how many tensors it holds and one line per problem found (none when ``ok``)."""

    path: str
    format: str
    checksummed: bool
    tensors: int
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        """The JSON view ``ckpt verify --json`` prints."""
        return {"path": self.path, "format": self.format, "checksummed": self.checksummed,
                "tensors": self.tensors, "problems": list(self.problems), "ok": self.ok}


def verify(checkpoint: Checkpoint | str | os.PathLike[str], *, progress: Callable[[int], None] | None = None,
           storage_options: StorageOptions | None = None) -> Verification:
    """Check a checkpoint's structure and every tensor's checksum (in an object store, also its
    data object's own head and tail against the commit record's copies, which readers use).

    Files without checksums (HDF5 written by other tools) are read in full, which finds
    unreadable data but cannot vouch for the values: ``checksummed`` is False for them.

    Args:
        checkpoint: a checkpoint file, a directory (its latest checkpoint), a URL, or an open
            ``CheckpointReader``.
        progress: called with the number of bytes checked, as the work goes on.
        storage_options: for a URL, options for the store's fsspec filesystem.

    Raises:
        CheckpointNotFoundError, UnsupportedCheckpointError, CorruptCheckpointError: the
            checkpoint cannot be opened at all (damage found after opening is reported in
            ``problems`` instead).
    """
    with opened(checkpoint, storage_options) as reader:
        problems = reader.verify(progress) + _data_object_problems(reader.path, storage_options)
        return Verification(reader.path, reader.format, reader.checksummed, len(reader.tensors), problems)


def _data_object_problems(path: str, storage_options: StorageOptions | None) -> list[str]:
    """An object-store checkpoint's data object checked against its commit record's copies of
    its head and tail (which the reader used instead of those bytes)."""
    if not _urls.is_url(path):
        return []
    from ckpt.storage.remote import RemoteDirectory  # object-store code loads only for URLs

    _urls.check_options(storage_options)
    parent, name = _urls.split(path)
    return RemoteDirectory(parent, storage_options).copy_problems(name)


def verify_directory(directory: str | os.PathLike[str], *,
                     storage_options: StorageOptions | None = None) -> list[Verification]:
    """:func:`verify` every checkpoint a directory keeps (its state file's entries, oldest first).

    For incremental checkpoints this checks every chunk each one references (present, and
    matching its hash), so a damaged or missing shared chunk is reported by every checkpoint
    that needs it. A kept checkpoint that is missing or cannot be opened is one problem of its
    own report (``format`` "unknown").

    Raises:
        CheckpointNotFoundError: no such directory, or it holds no checkpoints.
        CorruptCheckpointError: its state file is damaged.

    Example:
        >>> import ckpt, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> saver = ckpt.Saver({"w": ckpt.Variable([1.0])}, format="msgpack", incremental=True)
        >>> for step in (1, 2):
        ...     _ = saver.save(os.path.join(d, "m.msgpack"), global_step=step)
        >>> [(os.path.basename(r.path), r.ok) for r in ckpt.verify_directory(d)]
        [('m-1.msgpack', True), ('m-2.msgpack', True)]
    """
    directory = os.fspath(directory)
    reports = []
    for row in list_checkpoints(directory, storage_options):
        path = f"{directory.rstrip('/')}/{row.path}" if _urls.is_url(directory) else os.path.join(directory, row.path)
        if row.note == "missing":
            reports.append(Verification(path, "unknown", False, 0, [f"{path}: listed in the state file, but missing"]))
        elif row.note in _KEPT:
            try:
                reports.append(verify(path, storage_options=storage_options))
            except CheckpointError as exc:  # a kept checkpoint that cannot be opened is a problem, not the end
                reports.append(Verification(path, "unknown", False, 0, [str(exc)]))
    return reports
