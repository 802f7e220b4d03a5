"""The one place a format's path becomes bytes: a local file or, for a URL, an object in its
store (formats never ask whether a path is a URL).

Example:
    >>> import os, tempfile
    >>> from ckpt.formats import _blobs
    >>> path = os.path.join(tempfile.mkdtemp(), "x")
    >>> with open(path, "wb") as f:
    ...     _ = f.write(b"abc")
    >>> blob = _blobs.open_blob(path)
    >>> type(blob).__name__, blob.size
    ('LocalFile', 3)
    >>> blob.close()
"""

from __future__ import annotations

import os

from ckpt.storage.urls import StorageOptions, is_url
from ckpt.storage import Folder, ReadableBlob
from ckpt.storage.localfile import LocalFolder

from ._io import LocalFile


def open_blob(path: str, storage_options: StorageOptions | None = None) -> ReadableBlob:
    """The readable blob behind a checkpoint path: a local file, or an object for a URL, read
    through a store opened with ``storage_options`` (unused for a local file).

    The one place a format's path becomes bytes: formats never ask whether a path is a URL.
    """
    if is_url(path):  # an object store: ranged GETs instead of preads
        # lazy: object-store code loads only for URLs (start-up cost of local reads)
        from ckpt.storage.remote import RemoteFile

        return RemoteFile(path, storage_options=storage_options)
    return LocalFile(path)


def open_folder(blob: ReadableBlob, name: str) -> Folder:
    """The folder ``name`` beside ``blob`` (in the directory of the checkpoint it is), read through
    the same store: for an object, the store (and storage options) that opened it, so a format's
    side objects (an incremental checkpoint's chunks) are read as the checkpoint was."""
    if isinstance(blob, LocalFile):
        return LocalFolder(os.path.normpath(os.path.join(os.path.dirname(blob.name), name)))  # "../x": named plainly
    from ckpt.storage.objfolder import RemoteFolder  # lazy: object-store code loads only for objects
    from ckpt.storage.remote import RemoteFile

    if not isinstance(blob, RemoteFile):
        raise TypeError(f"{blob.name}: cannot open the folder {name!r} beside a {type(blob).__name__}")
    return RemoteFolder(blob.directory.store, blob.directory.join(name))
