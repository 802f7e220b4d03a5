"""Checkpoint locations, read side: the one place in the core that tells a local path from an
object-store URL (internal; the public names are ``ckpt.latest_checkpoint`` and the readers).

A directory of checkpoints is a :class:`ckpt.storage.Store` (``ckpt.saving.stores.open_store``
picks ``LocalStore`` or ``_remote.RemoteDirectory``); what differs between the two beyond the
Store methods is decided here once: how a location resolves to a checkpoint (storage options
are passed in, for the store of a URL). ``reader.py``, ``listing.py`` and the collective restore ask here instead of
branching on URLs themselves.

Example:
    >>> import tempfile
    >>> from ckpt.saving import locations as _locations
    >>> _locations.latest_checkpoint(tempfile.mkdtemp()) is None
    True
"""

from __future__ import annotations

import os
from typing import Any
from collections.abc import Mapping

from ckpt.storage import urls as _urls
from ckpt.errors import CheckpointNotFoundError
from ckpt.formats.base import format_for_path  # the registry: checkpoint names
from ckpt.saving.stores import REGISTRY, open_store
from ckpt.storage.state import STATE_FILE

__all__ = ["latest_checkpoint", "resolve_checkpoint"]


def latest_checkpoint(directory: str | os.PathLike[str],
                      storage_options: Mapping[str, Any] | None = None) -> str | None:
    """Return the path of the newest checkpoint in ``directory`` that exists, or None.

    ``directory`` may be an object-store URL ("s3://bucket/run"); ``storage_options`` go to
    its fsspec filesystem (credentials and endpoints otherwise come from the environment).

    Example:
        >>> import ckpt, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> saver = ckpt.Saver({"v": ckpt.Variable(1.0)})
        >>> path = saver.save(os.path.join(d, "model.h5"), global_step=7)
        >>> ckpt.latest_checkpoint(d) == path
        True
    """
    return open_store(os.fspath(directory), storage_options).latest()


def resolve_checkpoint(path: str | os.PathLike[str], storage_options: _urls.StorageOptions | None = None) -> str:
    """A checkpoint file as is; a directory -> its latest checkpoint, or itself when a format reads
    whole directories (a Hugging Face model directory without a state file). A URL ending in a
    checkpoint extension is a checkpoint (no request spent on looking for a state file); other
    URLs are looked up in their store, opened with ``storage_options``.

    Raises:
        CheckpointNotFoundError: nothing at ``path``, or a directory without checkpoints.
    """
    path = os.fspath(path)
    if _urls.is_url(path):
        return _resolve_url(path, storage_options)
    if os.path.isdir(path):
        latest = open_store(path).latest()
        if latest is None and REGISTRY.claims(path):  # a Hugging Face model directory, say
            return path
        if latest is None:
            raise CheckpointNotFoundError(f"{path}: no checkpoint in this directory{_why_none(path)}", path=path)
        return latest
    return path


def _resolve_url(url: str, storage_options: _urls.StorageOptions | None) -> str:
    """``resolve_checkpoint`` of a URL."""
    if format_for_path(url) is not None:
        return url
    found = open_store(url, storage_options).latest()
    if found is not None:
        return found
    parent, name = _urls.split(url)
    if name and open_store(parent, storage_options).exists(name):
        return url  # a checkpoint object without a known extension
    raise CheckpointNotFoundError(f"{url}: no checkpoint in this directory (no '{STATE_FILE}' state file "
                                  "naming an existing checkpoint)")


def _why_none(directory: str) -> str:
    """What the state file of a directory without checkpoints names (a copied TensorFlow
    directory's state file names the old machine's absolute paths)."""
    state = open_store(directory).read_state()
    entries = state.all_entries() if state is not None else []
    if not entries:
        return f" (no '{STATE_FILE}' state file naming an existing checkpoint)"
    missing = os.path.join(directory, entries[-1].path)  # an absolute path stays as recorded
    what = "is not a checkpoint file" if os.path.lexists(missing) else "does not exist"  # a FIFO, say
    earlier = f"; nor do the {len(entries) - 1} earlier ones it lists" if len(entries) > 1 else ""
    return f": its '{STATE_FILE}' state file names {missing}, which {what}{earlier}"
