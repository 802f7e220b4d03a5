"""Stores that know the formats: the registry as the :class:`ckpt.storage.Catalog` every Store
the library opens is handed (internal).

Storage sits below the formats (formats read and write through its blobs), so a store never
imports the registry; what it must know about formats (is this path a checkpoint, which names
could a Saver have written, does a candidate verify) it asks the catalog it was given. This
module combines the two.

Example:
    >>> import tempfile
    >>> from ckpt.saving.stores import REGISTRY, open_store
    >>> store = open_store(tempfile.mkdtemp())
    >>> store.catalog is REGISTRY, REGISTRY.extension("model-3.H5"), REGISTRY.writable("notes.txt")
    (True, '.h5', False)
"""

from __future__ import annotations

import os

from ckpt.formats.base import format_for_path, formats, open_reader
from ckpt.storage import Catalog, ReadableBlob, Store
from ckpt.storage import urls as _urls
from ckpt.storage.local import LocalStore

__all__ = ["REGISTRY", "open_store", "store_of"]


class _Registry:
    """The format registry (``ckpt.formats.base``) answering a Store's questions."""

    def claims(self, path: str) -> bool:
        return any(f.claims(path) for f in formats())

    def extension(self, name: str) -> str | None:
        fmt = format_for_path(name)
        return None if fmt is None else next(e for e in fmt.extensions if name.lower().endswith(e))

    def writable(self, name: str) -> bool:
        fmt = format_for_path(name)
        return fmt is not None and fmt.can_write

    def verifies(self, path: str, blob: ReadableBlob | None) -> bool:
        with open_reader(path, blob) as reader:
            return not reader.verify()


#: The Catalog of the registered formats.
REGISTRY: Catalog = _Registry()


def open_store(location: str, storage_options: _urls.StorageOptions | None = None) -> Store:
    """The Store of a directory path or URL ("s3://bucket/run"), knowing the registered formats.

    Example:
        >>> open_store("/tmp/run").join("m.h5")
        '/tmp/run/m.h5'
    """
    if _urls.is_url(location):
        from ckpt.storage.remote import RemoteDirectory  # object-store support is imported only for URLs

        return RemoteDirectory(location, storage_options, catalog=REGISTRY)
    return LocalStore(location, REGISTRY)


def store_of(path: str, storage_options: _urls.StorageOptions | None = None) -> Store:
    """The Store of the directory a checkpoint path or URL is in.

    Example:
        >>> store_of("s3://bucket/run/m.h5").location
        's3://bucket/run'
    """
    if _urls.is_url(path):
        return open_store(_urls.split(path)[0], storage_options)
    return open_store(os.path.dirname(os.path.abspath(path)))
