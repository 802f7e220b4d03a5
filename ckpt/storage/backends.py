"""Which :class:`ckpt.storage.objstore.ObjectStore` class serves a URL: the one place that
looks at an object-store URL's protocol (internal).

Example:
    >>> type(object_store("memory://doc-backends")).__name__
    'MemoryStore'
"""

from __future__ import annotations

from ckpt.storage import urls as _urls
from ckpt.storage.gcs import GCSStore
from ckpt.storage.objstore import MemoryStore, ObjectStore, Sizes
from ckpt.storage.s3 import S3Store

__all__ = ["object_store"]

_BACKENDS: dict[str, type[ObjectStore]] = {"s3": S3Store, "s3a": S3Store, "gs": GCSStore, "gcs": GCSStore,
                                           "memory": MemoryStore}


def object_store(url: str, storage_options: _urls.StorageOptions | None = None,
                 sizes: Sizes | None = None) -> ObjectStore:
    """The store of ``url``: its backend's class, or the generic fsspec one."""
    return _BACKENDS.get(_urls.protocol(url), ObjectStore)(url, storage_options, sizes)
