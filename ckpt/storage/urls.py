"""Checkpoint locations given as URLs: telling them from paths, splitting them, and the
fsspec filesystem behind each (internal; users pass URLs and ``storage_options=``).

Anything with a ``protocol://`` prefix other than ``file://`` is an object-store URL
(``s3://bucket/run/model.msgpack``, ``gs://...``, ``memory://...``); ``file://`` URLs
and plain paths stay on the local-file code. fsspec and the store's own package (s3fs,
gcsfs) are imported only when a URL is used.

Credentials and endpoints come from the store's usual configuration (for S3 the
``AWS_*`` environment variables, profiles and instance roles, read by botocore);
``storage_options`` are passed to the filesystem's constructor for anything else.

Example:
    >>> from ckpt.storage import urls as _urls
    >>> _urls.is_url("s3://bucket/run/model.msgpack"), _urls.is_url("/tmp/model.h5")
    (True, False)
    >>> _urls.split("s3://bucket/run/model-10.msgpack")
    ('s3://bucket/run', 'model-10.msgpack')
    >>> _urls.join("s3://bucket/run", "checkpoint")
    's3://bucket/run/checkpoint'
"""

from __future__ import annotations

import os
import re
from typing import Any
from collections.abc import Mapping

from ckpt.errors import CheckpointError, InvalidURLError

__all__ = ["is_url", "local_path", "split", "join", "protocol", "check", "check_options", "filesystem",
           "StorageOptions"]

StorageOptions = Mapping[str, Any]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
#: Which package provides each common protocol (for the "install ckpt-numpy[s3]" hint).
_EXTRAS = {"s3": "ckpt-numpy[s3]", "s3a": "ckpt-numpy[s3]", "gs": "ckpt-numpy[gcs]", "gcs": "ckpt-numpy[gcs]"}


def is_url(location: str | os.PathLike[str]) -> bool:
    """True for an object-store URL (``proto://...``, except ``file://``)."""
    if not isinstance(location, str):
        return False
    match = _SCHEME.match(location)
    return match is not None and match.group(1).lower() != "file"


def local_path(location: str | os.PathLike[str]) -> str:
    """A plain path for a path or a ``file://`` URL (``file:///tmp/x`` -> ``/tmp/x``)."""
    location = os.fspath(location)
    if location[:7].lower() == "file://":
        return location[7:]
    return location


def protocol(url: str) -> str:
    """The URL's protocol, lower case: ``s3://b/k`` -> ``s3``.

    Raises:
        InvalidURLError: ``url`` has no ``protocol://`` prefix.
    """
    match = _SCHEME.match(url)
    if match is None:
        raise InvalidURLError(f"{url}: not a URL (expected protocol://bucket/path)")
    return match.group(1).lower()


def check(url: str) -> str:
    """``url`` itself, once it is known to name a bucket (or host) and to have no empty part
    (a trailing "/" is fine): ``s3://`` or ``s3://b//run`` would otherwise reach the store as
    some other key, or fail deep inside fsspec with a bare ValueError.

    Raises:
        InvalidURLError: naming the URL and what is wrong with it.
    """
    proto = protocol(url)
    parts = url[len(proto) + 3:].rstrip("/").split("/")
    if not parts[0]:
        raise InvalidURLError(f"{url}: no bucket in the URL (expected {proto}://bucket/path)")
    if "" in parts:
        raise InvalidURLError(f"{url}: the URL has an empty part ('//'; expected {proto}://bucket/path)")
    return url


def check_options(storage_options: object) -> StorageOptions:
    """``storage_options`` itself when it is None or a mapping with string keys.

    Raises:
        TypeError: anything else (a string such as ``"anon=True"``), saying what is expected.
    """
    if storage_options is None:
        return {}
    if not isinstance(storage_options, Mapping) or not all(isinstance(k, str) for k in storage_options):
        raise TypeError(f"storage_options must be a mapping of option names to values (a dict such as "
                        f"{{'anon': True}}), got {type(storage_options).__name__} {storage_options!r:.80}")
    return storage_options


def split(url: str) -> tuple[str, str]:
    """``(directory URL, name)``; a trailing "/" is ignored."""
    stripped = url.rstrip("/")
    head, _, name = stripped.rpartition("/")
    if not name or head.endswith(":/"):  # "s3://bucket" alone: a bucket, no object name
        return stripped, ""
    return head, name


def join(directory: str, name: str) -> str:
    """``directory`` + "/" + ``name`` (a directory URL may end with "/")."""
    return f"{directory.rstrip('/')}/{name}"


def filesystem(url: str, storage_options: StorageOptions | None = None) -> Any:
    """The fsspec filesystem for ``url`` (fsspec reuses one instance per protocol and options,
    and makes a forked child a new one).

    Raises:
        CheckpointError: fsspec, or the package for this protocol, is not installed; or
            ``storage_options`` are not accepted by the filesystem.
    """
    proto = protocol(check(url))
    options = dict(check_options(storage_options))
    hint = _EXTRAS.get(proto, "fsspec and the package for this protocol")
    try:
        import fsspec  # lazy: an optional dependency (the hint below names its extra)
    except ImportError:
        raise CheckpointError(f"{url}: checkpoints in object stores need fsspec: pip install "
                              f"'{hint}'") from None
    try:
        cls = fsspec.get_filesystem_class(proto)
    except (ImportError, ValueError) as exc:
        raise CheckpointError(f"{url}: no filesystem for {proto}:// URLs ({exc}); pip install '{hint}'") from None
    try:
        return cls(**options)
    except TypeError as exc:
        raise CheckpointError(f"{url}: storage_options {sorted(options)} are not accepted by "
                              f"{cls.__name__}: {exc}") from None
