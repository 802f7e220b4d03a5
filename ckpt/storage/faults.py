"""Store faults as CheckpointErrors naming the URL (internal).

fsspec filesystems raise builtin errors for what they recognise (s3fs: FileNotFoundError for a
missing key or bucket, PermissionError for denied access or bad keys, FileExistsError for a
failed create-only write) and let botocore, aiohttp and asyncio errors through for the rest
(no credentials, connection refused, timeouts). Every one of them becomes a CheckpointError
child here, with the URL, what was being done, and what the store said; the original stays
chained as ``__cause__``.

Example:
    >>> from ckpt.storage.faults import store_error
    >>> err = store_error(FileNotFoundError("bkt/run/m.msgpack"), "s3://bkt/run/m.msgpack", "reading")
    >>> type(err).__name__, str(err)
    ('CheckpointNotFoundError', 's3://bkt/run/m.msgpack: reading: no such object (bkt/run/m.msgpack)')
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from collections.abc import Iterator

from ckpt.errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError, StorageError

__all__ = ["store_error", "translating"]

# botocore / aiohttp classes, named so that neither needs importing
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                   "NoAuthTokenError", "DefaultCredentialsError", "RefreshError"}
_UNREACHABLE = {"EndpointConnectionError", "ConnectionClosedError", "ConnectTimeoutError", "ReadTimeoutError",
                "ClientConnectorError", "ServerDisconnectedError", "ClientOSError", "ServerTimeoutError",
                "ConnectionError", "HTTPClientError", "ProxyConnectionError"}
# aiohttp / botocore: the connection broke in the middle of a response body
_BROKEN = {"ClientPayloadError", "ContentLengthError", "IncompleteReadError", "ResponseStreamingError"}


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def _said(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text if len(text) < 300 else text[:297] + "..."


def store_error(exc: BaseException, url: str, doing: str, writing: bool = False) -> CheckpointError:
    """The CheckpointError for ``exc``, raised by the store while ``doing`` something to ``url``.

    Writes fail with CheckpointWriteError (a missing bucket: CheckpointNotFoundError, as a
    missing directory does for files); reads with CheckpointNotFoundError for a missing
    object or bucket and StorageError for everything else the store did.
    """
    if isinstance(exc, CheckpointError):
        return exc
    names = _names(exc)
    said = _said(exc)
    if isinstance(exc, FileNotFoundError) or names & {"NoSuchKey", "NoSuchBucket", "NotFound"}:
        bucket = "bucket" in said.lower()
        what = "the bucket does not exist" if bucket else "no such object"
        if writing and not bucket:
            return CheckpointWriteError(f"{url}: {doing}: {what} ({said}); nothing was committed")
        return CheckpointNotFoundError(f"{url}: {doing}: {what} ({said})")
    if isinstance(exc, FileExistsError):
        message = f"{url}: {doing}: the object already exists and writes here are create-only ({said})"
    elif isinstance(exc, PermissionError):
        message = (f"{url}: {doing}: access denied: check the credentials and the bucket's permissions "
                   f"({said})")
    elif names & _NO_CREDENTIALS:
        message = (f"{url}: {doing}: no usable credentials (for S3: AWS_ACCESS_KEY_ID and "
                   f"AWS_SECRET_ACCESS_KEY, a profile, or storage_options) ({said})")
    elif names & _BROKEN:
        message = f"{url}: {doing}: the connection to the store broke mid-transfer ({type(exc).__name__}: {said})"
    elif names & _UNREACHABLE or isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        message = f"{url}: {doing}: the store cannot be reached ({type(exc).__name__}: {said})"
    else:
        message = f"{url}: {doing} failed: {type(exc).__name__}: {said}"
    if writing:
        return CheckpointWriteError(f"{message}; nothing was committed")
    return StorageError(message)


@contextmanager
def translating(url: str, doing: str, writing: bool = False) -> Iterator[None]:
    """Raise store faults inside the block as ``store_error(...)`` (chained)."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:  # botocore/aiohttp/fsspec: any of them, never a raw traceback
        raise store_error(exc, url, doing, writing) from exc
