"""Writing new objects (internal): the :class:`Upload` interface every object store's
``open_upload`` returns (a writable blob, ``ckpt.storage.WritableBlob``, whose ``finish()`` makes
the object appear whole, create-only when asked, and returns its size and the copies of its head
and tail a commit record carries), and :class:`StagedUpload`, a local file uploaded whole at the
end (stores without streamed uploads; S3's streamed one is ``ckpt.storage.s3upload.S3Upload``).

Example:
    >>> from ckpt.storage.objstore import MemoryStore
    >>> store = MemoryStore("memory://doc-uploads")
    >>> blob = store.open_upload("memory://doc-uploads/x", create_only=True)
    >>> blob.write_at(b"hello", 0)
    >>> blob.finish()[:2], store.read("memory://doc-uploads/x", 0, 5)
    ((5, b'hello'), b'hello')
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Protocol
from collections.abc import Sequence

from ckpt.storage import WritableBlob
from ckpt.storage.localfile import LocalSink

__all__ = ["OPEN_HEAD", "OPEN_TAIL", "StagedUpload", "Upload", "UploadTarget"]

#: Bytes of a data object fetched when it is opened: its start (format sniffing, headers)
#: and its end (footers and indexes). The commit record carries a copy of both (``finish()``
#: returns them), so opening a committed checkpoint costs no GET of the data object.
OPEN_HEAD, OPEN_TAIL = 4096, 64 << 10


class Upload(WritableBlob, Protocol):
    """A new object being written: a :class:`ckpt.storage.WritableBlob` that appears in the store,
    whole, on ``finish()`` and never before."""

    def finish(self) -> tuple[int, bytes, bytes]:
        """Make the object (create-only when asked); return its size and the copies of its first
        OPEN_HEAD and last OPEN_TAIL bytes. On failure nothing is left in the store."""

    def abort(self) -> None:
        """Discard what was written (nothing reaches the store); idempotent."""


class UploadTarget(Protocol):
    """What a :class:`StagedUpload` needs of its store."""

    def upload(self, local: str, url: str, create_only: bool) -> None:
        """Copy the local file ``local`` to ``url``, whole or not at all."""


class StagedUpload(Upload):
    """A new object written to a local temporary file first, uploaded whole on ``finish()``
    (stores without streamed uploads: memory://, gs://, other fsspec filesystems)."""

    def __init__(self, store: UploadTarget, url: str, create_only: bool) -> None:
        self._store, self.url, self._create_only = store, url, create_only
        fd, self._local = tempfile.mkstemp(prefix=".ckpt-upload-")
        os.close(fd)
        self._sink = LocalSink(self._local)

    @property
    def name(self) -> str:
        return self.url

    @property
    def size(self) -> int:
        return int(self._sink.size)

    def write_at(self, data: Any, offset: int) -> None:
        self._sink.write_at(data, offset)

    def write_pieces(self, pieces: Sequence[Any], offset: int) -> None:
        self._sink.write_pieces(pieces, offset)

    def close(self) -> None:
        self.finish()

    def finish(self) -> tuple[int, bytes, bytes]:
        """Upload the file; return ``(size, its first OPEN_HEAD bytes, its last OPEN_TAIL bytes)``
        (the copies a commit record carries)."""
        try:
            size = self._sink.size
            with open(self._local, "rb") as f:
                head = f.read(min(OPEN_HEAD, size))
                f.seek(max(len(head), size - OPEN_TAIL))
                tail = f.read()
            self._store.upload(self._local, self.url, self._create_only)
        finally:
            self.abort()
        return size, head, tail

    def abort(self) -> None:
        """Discard what was written (nothing reaches the store)."""
        self._sink.close()
        try:
            os.unlink(self._local)
        except FileNotFoundError:
            pass
