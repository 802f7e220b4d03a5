"""S3 (and S3-compatible servers) through s3fs: reads streamed straight into the caller's
buffers, uploads sent as one PUT or streamed in parts, compare-and-swap on ETags (internal).

On S3 each part of a read is one ranged GET whose body is streamed into the caller's buffers as
it arrives (each piece aiohttp received copied once into place; no copy of the part is held), so
parts can be large (``Sizes.part``: fewer requests, each cheap per byte) and memory stays bounded
whatever the size; a read of nearly all of an object up to ``Sizes.single_get_max`` is one GET of
the whole object; a caller may start each span's checksum as soon as it is filled.

Conditional writes: create-only is ``If-None-Match: *`` on the PUT or on completing the multipart
upload; compare-and-swap is ``If-Match: <ETag>`` (``If-None-Match: *`` for the first version).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any
from collections.abc import Callable, Sequence

from ckpt.errors import CorruptCheckpointError
from ckpt.storage.faults import translating
from ckpt.storage.objstore import ObjectStore, missing_object, pieces_of, sync
from ckpt.storage.s3upload import S3Upload
from ckpt.storage.versions import checked_version

__all__ = ["S3Store"]


class _Sink:
    """Copies the consecutive chunks of one ranged GET ``[start, end)`` into the spans it
    covers (``members``, in offset order), remembering where it is in both. With ``done``,
    calls ``done(i)`` once span i is whole (``left``: its bytes still to come, shared by the
    sinks of one read, as a span may be cut between two GETs)."""

    def __init__(self, start: int, spans: Sequence[tuple[int, memoryview]], members: list[int],
                 left: dict[int, int] | None = None, done: Callable[[int], None] | None = None) -> None:
        self.pos, self.spans = start, spans
        self.members = sorted(members, key=lambda i: spans[i][0])
        self.first = 0  # members before this one end at or before pos
        self.left, self.done = left, done

    def write(self, chunk: bytes) -> None:
        start, end = self.pos, self.pos + len(chunk)
        members, spans = self.members, self.spans
        while self.first < len(members) and spans[members[self.first]][0] + len(spans[members[self.first]][1]) \
                <= start:
            self.first += 1
        data = memoryview(chunk)  # slices of it are not copies
        for i in members[self.first:]:
            offset, view = spans[i]
            if offset >= end:
                break
            lo, hi = max(start, offset), min(end, offset + len(view))
            if lo < hi:
                view[lo - offset:hi - offset] = data[lo - start:hi - start]
                if self.done is not None and self.left is not None:
                    self.left[i] -= hi - lo
                    if not self.left[i]:
                        self.done(i)
        self.pos = end

    def missing(self) -> int:
        """The first member not completely written yet (for the truncation message)."""
        spans = self.spans
        return next((i for i in self.members if spans[i][0] + len(spans[i][1]) > self.pos), self.members[-1])


def _invalid_range(exc: BaseException) -> bool:
    """S3's answer to a range starting at or after the object's end (416 InvalidRange)."""
    return "InvalidRange" in repr(exc.__cause__) or "not satisfiable" in str(exc).lower()


#: Times a streamed GET whose connection dropped is resumed from where it stopped.
_RESUMES = 3


async def _next_chunk(body: Any, limit: int) -> bytes:
    """The next bytes of a GET's body: on aiohttp the next piece as it came off the socket (no
    copy of it; often under ``limit``, never far over), else ``body.read(limit)``."""
    readchunk = getattr(getattr(getattr(body, "raw_stream", None), "content", None), "readchunk", None)
    if readchunk is None:  # aiobotocore's httpx backend, or a wrapped body
        return await body.read(limit)  # type: ignore[no-any-return]
    chunk, _ = await readchunk()
    return chunk  # type: ignore[no-any-return]


def _resumable(exc: BaseException) -> bool:
    """A connection fault mid-body (aiohttp payload/connection errors, timeouts), not an answer."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"ClientPayloadError", "ClientConnectionError", "ServerDisconnectedError",
                         "IncompleteReadError", "ResponseStreamingError"}) or \
        isinstance(exc, (ConnectionError, asyncio.TimeoutError, TimeoutError))


class S3Store(ObjectStore):
    """An S3 bucket's objects (``s3://``, ``s3a://``)."""

    atomic_swap = True

    def read_into(self, url: str, spans: Sequence[tuple[int, memoryview]],
                  name: Callable[[int], str] = lambda i: "data", size: int | None = None,
                  done: Callable[[int], None] | None = None) -> None:
        """Fill each ``(offset, view)`` with the object's bytes there: streamed ranged GETs of
        ``Sizes.part_size`` bytes, up to ``concurrency`` in flight, each body copied into the
        buffers as it arrives. When the object's ``size`` is known, at most ``single_get_max`` and
        all of it but ``whole_slack`` bytes (and 1/16 of it) is wanted, it is one GET of the whole
        object. ``done(i)`` is called (on the event loop's thread: it must be quick) as soon as
        span i is filled, while the rest is still arriving (its checksum can start)."""
        sizes = self.sizes
        pieces = pieces_of(spans, sizes.part_size, sizes.gap)
        if not pieces:
            return
        if size is not None and size <= sizes.single_get_max and \
                sum(end - start for start, end, _ in pieces) >= size - min(sizes.whole_slack, size // 16):
            pieces = [(0, max(size, pieces[-1][1]), sorted({i for _, _, members in pieces for i in members}))]
        with translating(url, f"reading {name(pieces[0][2][0])}"):
            sync(self.fs.loop, self._stream_all, url, spans, pieces, name, done, size)  # bounded per GET

    async def _stream_all(self, url: str, spans: Sequence[tuple[int, memoryview]],
                          pieces: list[tuple[int, int, list[int]]], name: Callable[[int], str],
                          done: Callable[[int], None] | None, size: int | None) -> None:
        bucket, key = self.bucket_key(url)
        gate = asyncio.Semaphore(self.sizes.concurrency)
        left = {i: len(spans[i][1]) for _, _, members in pieces for i in members} if done is not None else None

        async def fetch(start: int, end: int, members: list[int]) -> None:
            async with gate:
                await self.within(self._stream(bucket, key, start, end, _Sink(start, spans, members, left, done), url,
                                               name, size), end - start)

        results = await asyncio.gather(*(fetch(*piece) for piece in pieces), return_exceptions=True)
        for result in results:  # every request has finished (none writes into a buffer later)
            if isinstance(result, BaseException):
                raise result

    async def _stream(self, bucket: str, key: str, start: int, end: int, sink: _Sink, url: str,
                      name: Callable[[int], str], size: int | None = None) -> None:
        """One ranged GET ``[start, end)`` copied into ``sink`` chunk by chunk as it arrives; a
        connection dropped mid-body is resumed from where it stopped (a few times). With the
        object's expected ``size``, the size the store answers with (Content-Range) must be it."""
        for attempt in range(_RESUMES + 1):
            try:
                resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key,
                                              Range=f"bytes={sink.pos}-{end - 1}")
            except OSError as exc:
                if not _invalid_range(exc):
                    raise
                break  # starts at or past the object's end: truncated
            total = str(resp.get("ContentRange", "")).rpartition("/")[2]
            if size is not None and total.isdigit() and int(total) != size:
                resp["Body"].close()
                raise CorruptCheckpointError(f"{url}: the object is {int(total)} bytes, {size} were written: it was "
                                             "truncated or replaced")
            body = resp["Body"]
            try:
                while sink.pos < end:
                    chunk = await _next_chunk(body, min(self.sizes.chunk, end - sink.pos))
                    if not chunk:
                        break
                    sink.write(chunk if len(chunk) <= end - sink.pos else chunk[:end - sink.pos])
            except Exception as exc:  # aiohttp's payload and connection errors: resume, then give up
                if attempt == _RESUMES or not _resumable(exc):
                    raise
                continue
            finally:
                body.close()
            break
        if sink.pos < end:
            raise CorruptCheckpointError(f"{url}: the object ends in the middle of {name(sink.missing())} (offset "
                                         f"{sink.pos}): it is truncated")

    def read_small_or_head(self, url: str, limit: int, what: str) -> tuple[bytes, int] | None:
        """The first ``limit`` bytes of an object and its size (None: no such object): one GET."""
        with translating(url, f"reading {what}"):
            try:
                return self._s3_head(url, limit)
            except FileNotFoundError as exc:
                if not missing_object(exc):
                    raise
                return None

    def _s3_head(self, url: str, limit: int) -> tuple[bytes, int]:
        """One ranged GET: the first bytes, and the size from its Content-Range header."""
        bucket, key = self.bucket_key(url)

        async def get() -> tuple[bytes, int]:
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{limit - 1}")
            try:
                data = await resp["Body"].read()
            finally:
                resp["Body"].close()
            total = str(resp.get("ContentRange", "")).rpartition("/")[2]
            return data, int(total) if total.isdigit() else len(data)

        try:
            return self.run(get, limit)
        except OSError as exc:
            if _invalid_range(exc):
                return b"", 0  # an empty object
            raise

    def _cat_small(self, path: str, limit: int) -> bytes:
        try:
            return super()._cat_small(path, limit)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) or not _invalid_range(exc):
                raise
            return b""  # S3 refuses any range of an empty object (416): no store fault

    def upload(self, local: str, url: str, create_only: bool) -> None:
        """Copy a local file to ``url``: one PUT streamed from the file up to ``single_put_max``
        bytes, a multipart upload in parallel parts above; the object appears whole or not at all."""
        size = os.path.getsize(local)
        with translating(url, "uploading the checkpoint", writing=True):
            if size <= self.sizes.single_put_max:
                bucket, key = self.bucket_key(url)
                cond = {"IfNoneMatch": "*"} if create_only else {}
                with open(local, "rb") as f:  # the body is read from the file as it is sent
                    self.call("call_s3", "put_object", Bucket=bucket, Key=key, Body=f, ContentLength=size, **cond,
                              nbytes=size)
                self.fs.invalidate_cache(self.path(url))
            else:
                self.call("put_file", local, self.path(url), mode="create" if create_only else "overwrite",
                          max_concurrency=self.sizes.concurrency, chunksize=self.sizes.piece_size(size), nbytes=size)

    def open_upload(self, url: str, create_only: bool) -> S3Upload:
        """A writable blob that becomes the object ``url`` on ``finish()``: one PUT (up to
        ``single_put_max``, lent buffers kept by reference) or parts sent while it is written."""
        return S3Upload(self, url, create_only)

    def get_versioned(self, url: str, limit: int = 16 << 20) -> tuple[bytes | None, Any]:
        """A small object's bytes and its ETag, the version ``put_if`` checks (None, None: no object)."""
        bucket, key = self.bucket_key(url)

        async def get() -> tuple[bytes, Any]:  # one ranged GET: the bytes and their ETag
            try:
                resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{limit}")
            except OSError as exc:
                if not _invalid_range(exc):
                    raise
                # an empty object (S3 refuses any range of it): its ETag from a HEAD
                return b"", (await self.fs._call_s3("head_object", Bucket=bucket, Key=key))["ETag"]
            try:
                return await resp["Body"].read(), resp["ETag"]
            finally:
                resp["Body"].close()

        with translating(url, "reading the state file"):
            try:
                data, version = self.run(get, limit)
            except FileNotFoundError as exc:
                if not missing_object(exc):
                    raise
                return None, None
            except OSError as exc:
                if not _invalid_range(exc):
                    raise
                data, version = b"", self._etag(url)  # an empty object (416 for any range): its HEAD
        return checked_version(url, data, version, limit)

    def _etag(self, url: str) -> Any:
        """The object's ETag (one HEAD)."""
        bucket, key = self.bucket_key(url)
        return self.call("call_s3", "head_object", Bucket=bucket, Key=key).get("ETag")

    def put_if(self, url: str, data: bytes, version: Any) -> bool:
        """Write ``data`` only if the object still has the ETag ``version`` (``If-Match``; None:
        only if there is no object, ``If-None-Match: *``); False when another writer changed it first."""
        bucket, key = self.bucket_key(url)
        cond = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
        with translating(url, "writing the state file", writing=True):
            try:
                self.call("call_s3", "put_object", Bucket=bucket, Key=key, Body=data, **cond, nbytes=len(data))
            except FileExistsError:
                return False  # If-None-Match: someone created it first
            except FileNotFoundError as exc:
                if not missing_object(exc):
                    raise
                return False  # If-Match on an object deleted meanwhile
            except OSError as exc:
                if "pre-condition" in str(exc) or "PreconditionFailed" in repr(exc.__cause__):
                    return False  # If-Match: someone replaced it first
                raise
            self.fs.invalidate_cache(self.path(url))
        return True

    def exists(self, url: str) -> bool:
        """Whether the object exists (one HEAD; fsspec's exists() also lists prefixes)."""
        with translating(url, "looking up"):
            bucket, key = self.bucket_key(url)
            try:
                self.call("call_s3", "head_object", Bucket=bucket, Key=key)
            except FileNotFoundError as exc:
                if not missing_object(exc):
                    raise
                return False
            return True

    def unfinished_uploads(self, url: str) -> Sequence[tuple[str, str]]:
        """``(object URL, upload id)`` of the multipart uploads begun and neither completed nor
        aborted under the prefix ``url`` (a save killed mid-upload leaves one; S3 keeps, and bills,
        its parts until it is aborted)."""
        bucket, key = self.bucket_key(url)
        with translating(url, "listing unfinished uploads"):
            listed = self.call("call_s3", "list_multipart_uploads", Bucket=bucket, Prefix=key.rstrip("/") + "/")
        return [(f"{self.protocol}://{bucket}/{u['Key']}", str(u["UploadId"])) for u in listed.get("Uploads", [])]

    def abort_upload(self, url: str, upload_id: str) -> None:
        """Abort the multipart upload ``upload_id`` of ``url`` (its parts are discarded)."""
        bucket, key = self.bucket_key(url)
        with translating(url, "aborting an unfinished upload", writing=True):
            self.call("call_s3", "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
