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

from ckpt.storage import urls as _urls
from ckpt.tools.sources import Checkpoint, opened
from ckpt.storage.urls import StorageOptions

__all__ = ["Verification", "verify"]


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
