"""Bytes in an object store, through fsspec: ranged reads several at once, whole small
objects, create-only writes, compare-and-swap writes, uploads, listings, deletes (internal).

Every operation names the URL in its errors (``_storefaults``). Reads of large ranges are
split into pieces fetched concurrently and copied straight into the caller's buffer as each
arrives, so memory stays bounded by ``CONCURRENCY * MAX_PIECE`` whatever the checkpoint's size;
neighbouring spans are fetched by one request.

Atomicity comes from the store's conditional writes:

* create-only (``put(..., create_only=True)``): S3 ``If-None-Match: *`` on the PUT or on
  completing the multipart upload, GCS ``ifGenerationMatch=0``; fsspec spells both
  ``mode="create"``. ``memory://`` does it under a process lock.
* compare-and-swap (``get_versioned`` / ``put_if``): S3 ``If-Match: <ETag>`` (and
  ``If-None-Match: *`` for the first version); ``memory://`` compares under the lock.
  Other stores compare the bytes just before writing, which narrows the race window
  but cannot close it (``atomic_swap`` says which).

Example:
    >>> from ckpt._objstore import ObjectStore
    >>> store = ObjectStore("memory://doc-objstore")
    >>> store.put("memory://doc-objstore/a", b"hello", create_only=True)
    >>> buf = bytearray(3)
    >>> store.read_into("memory://doc-objstore/a", [(1, memoryview(buf))])
    >>> bytes(buf)
    b'ell'
    >>> store.put_if("memory://doc-objstore/a", b"bye", store.get_versioned("memory://doc-objstore/a")[1])
    True
"""

from __future__ import annotations

import asyncio
import os
import threading
from contextlib import nullcontext
from typing import Any
from collections.abc import Callable, Sequence

from . import _urls
from ._storefaults import translating
from .errors import CorruptCheckpointError

__all__ = ["ObjectStore", "PIECE", "CONCURRENCY"]

#: Ranged reads are split into pieces of this many bytes, fetched side by side.
PIECE = 8 << 20
#: Requests in flight at once for one read or upload.
CONCURRENCY = 16
#: Ranged GETs and upload parts are at most this big (bounds the memory of a read in flight).
MAX_PIECE = 32 << 20
#: Spans at most this far apart are fetched by one ranged GET (the bytes between are dropped).
GAP = 64 << 10


def piece_size(total: int) -> int:
    """Bytes per request when moving ``total`` bytes: CONCURRENCY requests where that gives
    pieces of PIECE to MAX_PIECE bytes (fewer, larger requests cost less per byte)."""
    return min(MAX_PIECE, max(PIECE, -(-total // CONCURRENCY)))


def _pieces(spans: Sequence[tuple[int, memoryview]]) -> list[tuple[int, int, list[int]]]:
    """The ranged GETs ``(start, end, [span indices])`` that cover every non-empty span."""
    order = sorted((i for i, (_, view) in enumerate(spans) if len(view)), key=lambda i: spans[i][0])
    runs: list[list[Any]] = []  # [start, end, members]
    for i in order:
        offset, view = spans[i]
        if runs and offset <= runs[-1][1] + GAP:
            runs[-1][1] = max(runs[-1][1], offset + len(view))
            runs[-1][2].append(i)
        else:
            runs.append([offset, offset + len(view), [i]])
    size = piece_size(sum(end - start for start, end, _ in runs))
    pieces = []
    for start, end, members in runs:
        for a in range(start, end, size):
            b = min(end, a + size)
            pieces.append((a, b, [i for i in members if spans[i][0] < b and spans[i][0] + len(spans[i][1]) > a]))
    return pieces


def _scatter(data: bytes, start: int, end: int, spans: Sequence[tuple[int, memoryview]], members: list[int],
             url: str, name: Callable[[int], str]) -> None:
    """Copy a fetched range ``[start, end)`` into the parts of the spans it covers."""
    if len(data) != end - start:
        raise CorruptCheckpointError(f"{url}: the object ends in the middle of {name(members[0])} (offset "
                                     f"{start + len(data)}): it is truncated")
    for i in members:
        offset, view = spans[i]
        lo, hi = max(start, offset), min(end, offset + len(view))
        view[lo - offset:hi - offset] = data[lo - start:hi - start]


_memory_lock = threading.RLock()  # memory:// has no conditional writes of its own


class ObjectStore:
    """The fsspec filesystem of one URL's store, with the operations checkpoints need."""

    def __init__(self, url: str, storage_options: _urls.StorageOptions | None = None) -> None:
        self.protocol = _urls.protocol(url)
        self.fs = _urls.filesystem(url, storage_options)
        self._s3 = self.protocol in ("s3", "s3a")
        self.atomic_swap = self._s3 or self.protocol == "memory"

    def _path(self, url: str) -> str:
        return str(self.fs._strip_protocol(url))

    # -- reads -------------------------------------------------------------------------------

    def size(self, url: str) -> int:
        """The object's size in bytes (one HEAD request)."""
        with translating(url, "reading the object's size"):
            return int(self.fs.size(self._path(url)))

    def read_into(self, url: str, spans: Sequence[tuple[int, memoryview]],
                  name: Callable[[int], str] = lambda i: "data") -> None:
        """Fill each ``(offset, view)`` with the object's bytes there, many ranged GETs at once.

        Spans within GAP bytes of each other are fetched together, and what is fetched is cut
        into up to CONCURRENCY ranges of PIECE to MAX_PIECE bytes, all in flight at once: many
        small tensors cost one request, a big one many side by side. A range the object does not
        fully hold is a CorruptCheckpointError naming ``name(i)``.
        """
        pieces = _pieces(spans)
        if not pieces:
            return
        path = self._path(url)
        with translating(url, f"reading {name(pieces[0][2][0])}"):
            if getattr(self.fs, "async_impl", False):
                from fsspec.asyn import sync

                sync(self.fs.loop, self._fetch_async, path, url, spans, pieces, name)
            else:
                for start, end, members in pieces:
                    data = self.fs.cat_file(path, start=start, end=end)
                    _scatter(data, start, end, spans, members, url, name)

    async def _fetch_async(self, path: str, url: str, spans: Sequence[tuple[int, memoryview]],
                           pieces: list[tuple[int, int, list[int]]], name: Callable[[int], str]) -> None:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def fetch(start: int, end: int, members: list[int]) -> None:
            async with gate:
                data = await self.fs._cat_file(path, start=start, end=end)
            _scatter(data, start, end, spans, members, url, name)

        results = await asyncio.gather(*(fetch(*piece) for piece in pieces), return_exceptions=True)
        # every request has finished (none writes into a buffer after we return): report the first fault
        for result in results:
            if isinstance(result, BaseException):
                raise result

    def read(self, url: str, offset: int, size: int, what: str = "data") -> bytes:
        """``size`` bytes at ``offset`` (a CorruptCheckpointError if the object is shorter)."""
        buf = bytearray(size)
        self.read_into(url, [(offset, memoryview(buf))], lambda i: what)
        return bytes(buf)

    def read_small_or_head(self, url: str, limit: int, what: str) -> tuple[bytes, int] | None:
        """The first ``limit`` bytes of an object and its size (None: no such object)."""
        path = self._path(url)
        with translating(url, f"reading {what}"):
            try:
                if self._s3:
                    return self._s3_head(url, limit)
                size = int(self.fs.size(path))
                return bytes(self.fs.cat_file(path, start=0, end=min(limit, size))), size
            except FileNotFoundError as exc:
                if "bucket" in str(exc).lower():
                    raise
                return None

    def _s3_head(self, url: str, limit: int) -> tuple[bytes, int]:
        """One ranged GET: the first bytes, and the size from its Content-Range header."""
        bucket, key = self._bucket_key(url)

        async def get() -> tuple[bytes, int]:
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{limit - 1}")
            try:
                data = await resp["Body"].read()
            finally:
                resp["Body"].close()
            total = str(resp.get("ContentRange", "")).rpartition("/")[2]
            return data, int(total) if total.isdigit() else len(data)

        from fsspec.asyn import sync

        try:
            return sync(self.fs.loop, get)  # type: ignore[no-any-return]
        except OSError as exc:
            if "InvalidRange" in repr(exc.__cause__) or "not satisfiable" in str(exc).lower():
                return b"", 0  # an empty object
            raise

    def read_small(self, url: str, limit: int, what: str) -> bytes | None:
        """A whole small object (a commit record, a state file), or None when there is none.

        Objects over ``limit`` bytes are a CorruptCheckpointError: never a large download.
        """
        path = self._path(url)
        with translating(url, f"reading {what}"):
            try:
                data = self.fs.cat_file(path, start=0, end=limit + 1)
            except FileNotFoundError as exc:
                if "bucket" in str(exc).lower():
                    raise
                return None
        if len(data) > limit:
            raise CorruptCheckpointError(f"{url}: {what} is over {limit} bytes: not a ckpt {what}")
        return bytes(data)

    # -- writes ------------------------------------------------------------------------------

    def put(self, url: str, data: bytes, create_only: bool) -> None:
        """Write a whole small object; with ``create_only`` fail if it exists (FileExistsError
        from the store, raised as CheckpointWriteError naming the URL)."""
        path = self._path(url)
        with translating(url, "writing", writing=True):
            if self.protocol == "memory":
                with _memory_lock:
                    self.fs.pipe_file(path, data, mode="create" if create_only else "overwrite")
            else:
                self.fs.pipe_file(path, data, mode="create" if create_only else "overwrite")

    def upload(self, local: str, url: str, create_only: bool) -> None:
        """Copy a local file to ``url`` (a multipart upload in parallel parts for large files);
        the object appears whole or not at all."""
        path = self._path(url)
        with translating(url, "uploading the checkpoint", writing=True):
            if self._s3:
                self.fs.put_file(local, path, mode="create" if create_only else "overwrite",
                                 max_concurrency=CONCURRENCY, chunksize=piece_size(os.path.getsize(local)))
            else:
                self.fs.put_file(local, path, mode="create" if create_only else "overwrite")

    def get_versioned(self, url: str, limit: int = 16 << 20) -> tuple[bytes | None, Any]:
        """A small object's bytes and a version token for ``put_if`` (None, None: no object)."""
        if not self._s3:
            data = self.read_small(url, limit, "the state file")
            return data, data
        bucket, key = self._bucket_key(url)

        async def get() -> tuple[bytes, str]:
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{limit}")
            try:
                return await resp["Body"].read(), resp["ETag"]
            finally:
                resp["Body"].close()

        from fsspec.asyn import sync

        with translating(url, "reading the state file"):
            try:
                data, etag = sync(self.fs.loop, get)
            except FileNotFoundError as exc:
                if "bucket" in str(exc).lower():
                    raise
                return None, None
        if len(data) > limit:
            raise CorruptCheckpointError(f"{url}: the state file is over {limit} bytes")
        return bytes(data), etag

    def put_if(self, url: str, data: bytes, version: Any) -> bool:
        """Write ``data`` only if the object is still at ``version`` (from ``get_versioned``);
        False when another writer changed it first."""
        if self._s3:
            bucket, key = self._bucket_key(url)
            cond = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
            with translating(url, "writing the state file", writing=True):
                try:
                    self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **cond)
                except FileExistsError:
                    return False  # If-None-Match: someone created it first
                except FileNotFoundError as exc:
                    if "bucket" in str(exc).lower():
                        raise
                    return False  # If-Match on an object deleted meanwhile
                except OSError as exc:
                    if "pre-condition" in str(exc) or "PreconditionFailed" in repr(exc.__cause__):
                        return False  # If-Match: someone replaced it first
                    raise
                self.fs.invalidate_cache(self._path(url))
            return True
        with _memory_lock if self.protocol == "memory" else nullcontext():
            current = self.read_small(url, max(len(data), 16 << 20), "the state file")
            if current != version:
                return False
            self.put(url, data, create_only=version is None)
        return True

    def _bucket_key(self, url: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(self._path(url))
        return bucket, key

    # -- listing and deleting --------------------------------------------------------------

    def exists(self, url: str) -> bool:
        """Whether the object exists (for S3 one HEAD; fsspec's exists() also lists prefixes)."""
        with translating(url, "looking up"):
            if not self._s3:
                return bool(self.fs.isfile(self._path(url)))
            bucket, key = self._bucket_key(url)
            try:
                self.fs.call_s3("head_object", Bucket=bucket, Key=key)
            except FileNotFoundError as exc:
                if "bucket" in str(exc).lower():
                    raise
                return False
            return True

    def list(self, url: str, recursive: bool = False) -> list[dict[str, Any]]:
        """Objects under the directory ``url``: dicts with "name" (relative), "size" and the
        store's other details; an empty list for a directory with nothing in it."""
        base = self._path(url).rstrip("/")
        with translating(url, "listing"):
            try:
                self.fs.invalidate_cache(base)
                if recursive:
                    found = self.fs.find(base, detail=True)
                    entries = list(found.values())
                else:
                    entries = [e for e in self.fs.ls(base, detail=True) if e.get("type") != "directory"]
            except FileNotFoundError as exc:
                if "bucket" in str(exc).lower():
                    raise
                return []
        out = []
        for entry in entries:
            name = str(entry["name"]).rstrip("/")
            if name.startswith(base + "/"):
                out.append({**entry, "name": name[len(base) + 1:]})
        return out

    def delete(self, urls: Sequence[str]) -> None:
        """Delete objects; ones already gone are fine."""
        if not urls:
            return
        with translating(urls[0], "deleting", writing=True):
            for url in urls:
                try:
                    self.fs.rm_file(self._path(url))
                except FileNotFoundError:
                    pass
