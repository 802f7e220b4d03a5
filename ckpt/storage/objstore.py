"""Bytes in an object store, through fsspec: ranged reads several at once, whole small
objects, create-only writes, compare-and-swap writes, uploads, listings, deletes (internal).

Every operation names the URL in its errors (``_storefaults``). Neighbouring spans are
fetched by one request, and large ranges are cut into parts fetched concurrently. On S3 each
part is one ranged GET whose body is streamed straight into the caller's buffers as it
arrives (each piece aiohttp received copied once into place; no copy of the part is held), so
parts can be large (``PART``: fewer requests, each cheap per byte) and memory stays bounded
whatever the size; a read of nearly all of an object up to ``SINGLE_GET_MAX`` is one GET of
the whole object; a caller may start each span's checksum as soon as it is filled. Other
async stores fetch pieces of at most ``MAX_PIECE`` bytes and copy each into place.

Atomicity comes from the store's conditional writes:

* create-only (``put(..., create_only=True)``): S3 ``If-None-Match: *`` on the PUT or on
  completing the multipart upload, GCS ``ifGenerationMatch=0``; fsspec spells both
  ``mode="create"``. ``memory://`` does it under a process lock.
* compare-and-swap (``get_versioned`` / ``put_if``): S3 ``If-Match: <ETag>`` (and
  ``If-None-Match: *`` for the first version); GCS ``ifGenerationMatch=<generation>`` (0 for
  the first version) on a media upload, the generation read from the ``x-goog-generation``
  header of the GET that read the bytes; ``memory://`` compares under the lock. Other stores
  compare the bytes just before writing, which narrows the race window but cannot close it
  (``atomic_swap`` says which).

Example:
    >>> from ckpt.storage.objstore import ObjectStore
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
import base64
import bisect
import io
import os
import threading
from contextlib import nullcontext
from typing import Any, TypeVar
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

from ckpt.checksums import crc32c
from ckpt.storage import urls as _urls
from ckpt.storage.faults import translating
from ckpt.errors import CorruptCheckpointError

__all__ = ["ObjectStore", "S3Upload", "StagedUpload", "PIECE", "PART", "CONCURRENCY", "UPLOAD_PART",
           "UPLOADS_IN_FLIGHT", "TIMEOUT", "RATE"]

#: Uploads and (on stores other than S3) ranged reads move pieces of this many bytes or more.
PIECE = 8 << 20
#: Requests in flight at once for one read or upload.
CONCURRENCY = 16
#: Pieces held whole in memory (uploads, non-streamed reads) are at most this big.
MAX_PIECE = 32 << 20
#: S3 reads: a run of bytes is fetched by ranged GETs of at least this many bytes (at most
#: CONCURRENCY of them when the run is larger), each streamed into the buffers. Every request
#: costs a round trip and, on some servers (moto reads the whole object for each ranged GET),
#: work in proportion to the object's size, so a read of a whole checkpoint uses few of them.
PART = 128 << 20
#: S3 objects up to this size go up as one PUT (S3 takes up to 5 GiB): a save's (``S3Upload``:
#: its body read out of the writer's lent buffers) and a local file's (``upload``: streamed from
#: the file). One request, nothing more held in memory, as fast as any single request; larger
#: objects are multipart uploads (moto, for one, spends about twice a PUT's time on them: it
#: re-reads and joins every part to complete one).
SINGLE_PUT_MAX = 512 << 20
#: Streamed S3 uploads (``S3Upload``) send parts of this many bytes (S3 wants 5 MiB or more,
#: at most 10,000 parts: every 1,000 parts the size grows by this much, so objects up to
#: 55,000 * UPLOAD_PART bytes fit), ...
UPLOAD_PART = 8 << 20
#: ... at most this many at once; memory holds at most UPLOADS_IN_FLIGHT + 2 parts (those in
#: flight, the one being filled, and the first, patched last).
UPLOADS_IN_FLIGHT = 8
#: Bytes a streamed GET hands over at a time (what it holds in memory).
CHUNK = 1 << 20
#: Spans at most this far apart are fetched by one ranged GET (the bytes between are dropped).
GAP = 64 << 10
#: S3 reads of an object up to this size that want all of it but at most WHOLE_SLACK bytes (and
#: 1/16 of it) are one GET of the whole object (``bytes=0-<size - 1>``), as the objects went up
#: in one PUT: one request, and a server that copies what it slices out of an object (moto)
#: copies nothing.
SINGLE_GET_MAX = SINGLE_PUT_MAX
#: Bytes a whole-object GET may fetch that nobody asked for (the head and tail a RemoteFile has).
WHOLE_SLACK = 1 << 20
#: Deadlines (storage options ``ckpt_timeout`` and ``ckpt_rate``): every request to a store with an
#: async implementation (S3, GCS) must finish, retries included, within TIMEOUT seconds plus one
#: second per RATE bytes it moves, or it ends in a StorageError (CheckpointWriteError when writing)
#: naming the URL. The rate is low on purpose (requests side by side share the link): it bounds a
#: stalled transfer without failing a slow one. botocore's own connect/read timeouts (s3fs: 5 s
#: and 15 s, ``config_kwargs``) end a silent connection sooner.
TIMEOUT = 60.0
RATE = 64 << 10


def piece_size(total: int) -> int:
    """Bytes per request when moving ``total`` bytes held in memory: CONCURRENCY requests
    where that gives pieces of PIECE to MAX_PIECE bytes (fewer, larger requests cost less)."""
    return min(MAX_PIECE, max(PIECE, -(-total // CONCURRENCY)))


def part_size(total: int) -> int:
    """Bytes per streamed ranged GET when reading ``total`` bytes: ``total`` cut into equal
    parts of PART to 2 * PART bytes, or CONCURRENCY larger ones (streaming keeps memory
    bounded whatever the part's size)."""
    return -(-total // max(1, min(CONCURRENCY, total // PART)))


def _pieces(spans: Sequence[tuple[int, memoryview]],
            size_for: Callable[[int], int] = piece_size) -> list[tuple[int, int, list[int]]]:
    """The ranged GETs ``(start, end, [span indices])`` that cover every non-empty span, each
    at most ``size_for(total bytes fetched)`` long."""
    order = sorted((i for i, (_, view) in enumerate(spans) if len(view)), key=lambda i: spans[i][0])
    runs: list[list[Any]] = []  # [start, end, members]
    for i in order:
        offset, view = spans[i]
        if runs and offset <= runs[-1][1] + GAP:
            runs[-1][1] = max(runs[-1][1], offset + len(view))
            runs[-1][2].append(i)
        else:
            runs.append([offset, offset + len(view), [i]])
    size = size_for(sum(end - start for start, end, _ in runs))
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


_memory_lock = threading.RLock()  # memory:// has no conditional writes of its own

T = TypeVar("T")


def _sync(loop: Any, func: Callable[..., Awaitable[T]], *args: Any) -> T:
    """fsspec's ``sync(loop, func, *args)``, raising a deadline's TimeoutError (its message
    saying which deadline) as it is: sync() replaces any TimeoutError by a bare one of its own."""
    from fsspec.asyn import FSTimeoutError, sync

    try:
        return sync(loop, func, *args)  # type: ignore[no-any-return]
    except FSTimeoutError as exc:
        raise (exc.__cause__ or exc) from None


def _seconds(options: Mapping[str, Any], key: str, default: float) -> float:
    """A positive number from the storage option ``key`` (``default`` when absent)."""
    value = options.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"storage_options {key!r} must be a positive number, got {value!r}")
    return float(value)


class ObjectStore:
    """The fsspec filesystem of one URL's store, with the operations checkpoints need."""

    def __init__(self, url: str, storage_options: _urls.StorageOptions | None = None) -> None:
        self.protocol = _urls.protocol(url)
        options = dict(_urls.check_options(storage_options))
        self.timeout = _seconds(options, "ckpt_timeout", TIMEOUT)
        self.rate = _seconds(options, "ckpt_rate", RATE)
        for key in ("ckpt_timeout", "ckpt_rate"):  # ckpt's own: not the filesystem's
            options.pop(key, None)
        self.fs = _urls.filesystem(url, options)
        self._s3 = self.protocol in ("s3", "s3a")
        self._gcs = self.protocol in ("gs", "gcs")
        self.atomic_swap = self._s3 or self._gcs or self.protocol == "memory"

    def _path(self, url: str) -> str:
        return str(self.fs._strip_protocol(url))

    # -- deadlines ---------------------------------------------------------------------------

    async def within(self, step: Awaitable[T], nbytes: int = 0) -> T:
        """Await ``step`` (one request, its retries included) for at most the deadline of a
        request moving ``nbytes``; past it, cancel it and raise TimeoutError."""
        limit = self.timeout + nbytes / self.rate
        try:
            return await asyncio.wait_for(step, limit)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no answer within {limit:g} s (storage_options ckpt_timeout={self.timeout:g}, "
                               f"ckpt_rate={self.rate:g} bytes/s)") from None

    def run(self, make: Callable[[], Awaitable[T]], nbytes: int = 0) -> T:
        """Run the coroutine ``make()`` on the filesystem's event loop, within its deadline."""
        async def bounded() -> T:
            return await self.within(make(), nbytes)

        return _sync(self.fs.loop, bounded)

    def call(self, method: str, *args: Any, nbytes: int = 0, **kwargs: Any) -> Any:
        """``fs.<method>(*args, **kwargs)``, within a deadline when the filesystem is async (its
        ``_<method>`` coroutine; a synchronous one, such as memory://, is called as it is)."""
        if not getattr(self.fs, "async_impl", False):
            return getattr(self.fs, method)(*args, **kwargs)
        return self.run(lambda: getattr(self.fs, "_" + method)(*args, **kwargs), nbytes)

    # -- reads -------------------------------------------------------------------------------

    def size(self, url: str) -> int:
        """The object's size in bytes (one HEAD request)."""
        with translating(url, "reading the object's size"):
            return int(self.call("size", self._path(url)))

    def read_into(self, url: str, spans: Sequence[tuple[int, memoryview]],
                  name: Callable[[int], str] = lambda i: "data", size: int | None = None,
                  done: Callable[[int], None] | None = None) -> None:
        """Fill each ``(offset, view)`` with the object's bytes there, many ranged GETs at once.

        Spans within GAP bytes of each other are fetched together, and what is fetched is cut
        into ranged GETs (``part_size`` on S3, streamed; ``piece_size`` elsewhere), up to
        CONCURRENCY in flight at once: many small tensors cost one request, a big read a few
        side by side. On S3, when the object's ``size`` is known, at most SINGLE_GET_MAX and all
        of it but WHOLE_SLACK bytes (and 1/16 of it) is wanted, it is one GET of the whole object. A range
        the object does not fully hold is a CorruptCheckpointError naming ``name(i)``. On S3,
        ``done(i)`` is called (on the event loop's thread: it must be quick) as soon as span i is
        filled, while the rest is still arriving (its checksum can start).
        """
        pieces = _pieces(spans, part_size if self._s3 else piece_size)
        if not pieces:
            return
        if self._s3 and size is not None and size <= SINGLE_GET_MAX and \
                sum(end - start for start, end, _ in pieces) >= size - min(WHOLE_SLACK, size // 16):
            pieces = [(0, max(size, pieces[-1][1]), sorted({i for _, _, members in pieces for i in members}))]
        path = self._path(url)
        with translating(url, f"reading {name(pieces[0][2][0])}"):
            if self._s3:
                _sync(self.fs.loop, self._stream_all, url, spans, pieces, name, done, size)  # bounded per GET
            elif getattr(self.fs, "async_impl", False):
                _sync(self.fs.loop, self._fetch_async, path, url, spans, pieces, name)  # bounded per GET
            else:
                for start, end, members in pieces:
                    data = self.fs.cat_file(path, start=start, end=end)
                    _scatter(data, start, end, spans, members, url, name)

    async def _fetch_async(self, path: str, url: str, spans: Sequence[tuple[int, memoryview]],
                           pieces: list[tuple[int, int, list[int]]], name: Callable[[int], str]) -> None:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def fetch(start: int, end: int, members: list[int]) -> None:
            async with gate:
                data = await self.within(self.fs._cat_file(path, start=start, end=end), end - start)
            _scatter(data, start, end, spans, members, url, name)

        results = await asyncio.gather(*(fetch(*piece) for piece in pieces), return_exceptions=True)
        # every request has finished (none writes into a buffer after we return): report the first fault
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _stream_all(self, url: str, spans: Sequence[tuple[int, memoryview]],
                          pieces: list[tuple[int, int, list[int]]], name: Callable[[int], str],
                          done: Callable[[int], None] | None, size: int | None) -> None:
        bucket, key = self._bucket_key(url)
        gate = asyncio.Semaphore(CONCURRENCY)
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
                    chunk = await _next_chunk(body, min(CHUNK, end - sink.pos))
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
                size = int(self.call("size", path))
                return bytes(self.call("cat_file", path, start=0, end=min(limit, size))), size
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


        try:
            return self.run(get, limit)
        except OSError as exc:
            if _invalid_range(exc):
                return b"", 0  # an empty object
            raise

    def read_small(self, url: str, limit: int, what: str) -> bytes | None:
        """A whole small object (a commit record, a state file), or None when there is none.

        Objects over ``limit`` bytes are a CorruptCheckpointError: never a large download.
        """
        path = self._path(url)
        with translating(url, f"reading {what}"):
            try:
                data = self.call("cat_file", path, start=0, end=limit + 1)
            except FileNotFoundError as exc:
                if "bucket" in str(exc).lower():
                    raise
                return None
            except OSError as exc:
                if not _invalid_range(exc):
                    raise
                data = b""  # S3 refuses any range of an empty object (416): no store fault
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
                self.call("pipe_file", path, data, mode="create" if create_only else "overwrite", nbytes=len(data))

    def upload(self, local: str, url: str, create_only: bool) -> None:
        """Copy a local file to ``url``: one PUT streamed from the file up to SINGLE_PUT_MAX
        bytes, a multipart upload in parallel parts above; the object appears whole or not at all."""
        path = self._path(url)
        size = os.path.getsize(local)
        with translating(url, "uploading the checkpoint", writing=True):
            if self._s3 and size <= SINGLE_PUT_MAX:
                bucket, key = self._bucket_key(url)
                cond = {"IfNoneMatch": "*"} if create_only else {}
                with open(local, "rb") as f:  # the body is read from the file as it is sent
                    self.call("call_s3", "put_object", Bucket=bucket, Key=key, Body=f, ContentLength=size, **cond,
                              nbytes=size)
                self.fs.invalidate_cache(path)
            elif self._s3:
                self.call("put_file", local, path, mode="create" if create_only else "overwrite",
                          max_concurrency=CONCURRENCY, chunksize=piece_size(size), nbytes=size)
            else:
                self.call("put_file", local, path, mode="create" if create_only else "overwrite", nbytes=size)

    def open_upload(self, url: str, create_only: bool) -> StagedUpload | S3Upload:
        """A :class:`ckpt.storage.WritableBlob` that becomes the object ``url`` on ``finish()``
        (create-only when asked) and never before; ``abort()`` discards it. On S3 the bytes go
        up as one PUT on ``finish()`` (up to SINGLE_PUT_MAX, lent buffers kept by reference) or
        in parts while they are written (``S3Upload``); other stores get a local file uploaded
        on ``finish()`` (``StagedUpload``)."""
        if self._s3:
            return S3Upload(self, url, create_only)
        return StagedUpload(self, url, create_only)

    def get_versioned(self, url: str, limit: int = 16 << 20) -> tuple[bytes | None, Any]:
        """A small object's bytes and a version token for ``put_if`` (None, None: no object)."""
        if not self._s3 and not self._gcs:
            data = self.read_small(url, limit, "the state file")
            return data, data
        if self._s3:
            bucket, key = self._bucket_key(url)

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
        else:
            path = self._path(url)

            async def get() -> tuple[bytes, Any]:  # one media GET: its x-goog-generation is the version
                headers, data = await self.fs._call("GET", self.fs.url(path), headers={"Range": f"bytes=0-{limit}"})
                return data, headers.get("x-goog-generation")


        with translating(url, "reading the state file"):
            try:
                data, version = self.run(get, limit)
            except FileNotFoundError as exc:
                if "bucket" in str(exc).lower():
                    raise
                return None, None
            except OSError as exc:
                if not (self._s3 and _invalid_range(exc)):
                    raise
                data, version = b"", self._etag(url)  # an empty object (416 for any range): its HEAD
        if len(data) > limit:
            raise CorruptCheckpointError(f"{url}: the state file is over {limit} bytes")
        if not version:
            raise CorruptCheckpointError(f"{url}: the store sent no version (ETag, generation) for the state file")
        return bytes(data), version

    def _etag(self, url: str) -> Any:
        """S3: the object's ETag (one HEAD)."""
        bucket, key = self._bucket_key(url)
        return self.call("call_s3", "head_object", Bucket=bucket, Key=key).get("ETag")

    def _gcs_put_if(self, url: str, data: bytes, version: Any) -> bool:
        """GCS: a media upload with ``ifGenerationMatch`` (0: only if there is no object yet);
        gcsfs raises FileExistsError for the 412 a changed generation gets."""
        from urllib.parse import quote

        bucket, key = self._bucket_key(url)

        async def post() -> None:
            await self.fs._call("POST", f"{self.fs._location}/upload/storage/v1/b/{quote(bucket)}/o",
                                uploadType="media", name=key, ifGenerationMatch=str(version or 0), data=data,
                                headers={"Content-Type": "application/json"}, json_out=True)


        with translating(url, "writing the state file", writing=True):
            try:
                self.run(post, len(data))
            except FileExistsError:
                return False  # another writer changed (or created) it first
            self.fs.invalidate_cache(self._path(url))
        return True

    def put_if(self, url: str, data: bytes, version: Any) -> bool:
        """Write ``data`` only if the object is still at ``version`` (from ``get_versioned``);
        False when another writer changed it first."""
        if self._gcs:
            return self._gcs_put_if(url, data, version)
        if self._s3:
            bucket, key = self._bucket_key(url)
            cond = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
            with translating(url, "writing the state file", writing=True):
                try:
                    self.call("call_s3", "put_object", Bucket=bucket, Key=key, Body=data, **cond, nbytes=len(data))
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
                return bool(self.call("isfile", self._path(url)))
            bucket, key = self._bucket_key(url)
            try:
                self.call("call_s3", "head_object", Bucket=bucket, Key=key)
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
                    found = self.call("find", base, detail=True)
                    entries = list(found.values())
                else:
                    entries = [e for e in self.call("ls", base, detail=True) if e.get("type") != "directory"]
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

    def unfinished_uploads(self, url: str) -> Sequence[tuple[str, str]]:
        """S3: ``(object URL, upload id)`` of the multipart uploads begun and neither completed nor
        aborted under the prefix ``url`` (a save killed mid-upload leaves one; S3 keeps, and bills,
        its parts until it is aborted). Other stores have none: an empty list, no request."""
        if not self._s3:
            return []
        bucket, key = self._bucket_key(url)
        with translating(url, "listing unfinished uploads"):
            listed = self.call("call_s3", "list_multipart_uploads", Bucket=bucket, Prefix=key.rstrip("/") + "/")
        return [(f"{self.protocol}://{bucket}/{u['Key']}", str(u["UploadId"])) for u in listed.get("Uploads", [])]

    def abort_upload(self, url: str, upload_id: str) -> None:
        """Abort the multipart upload ``upload_id`` of ``url`` (its parts are discarded)."""
        bucket, key = self._bucket_key(url)
        with translating(url, "aborting an unfinished upload", writing=True):
            self.call("call_s3", "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)

    def delete(self, urls: Sequence[str]) -> None:
        """Delete objects; ones already gone are fine."""
        if not urls:
            return
        with translating(urls[0], "deleting", writing=True):
            for url in urls:
                try:
                    self.call("rm_file", self._path(url))
                except FileNotFoundError:
                    pass


class StagedUpload:
    """A new object written to a local temporary file first, uploaded whole on ``finish()``
    (stores without streamed uploads: memory://, gs://, other fsspec filesystems)."""

    def __init__(self, store: ObjectStore, url: str, create_only: bool) -> None:
        import tempfile

        from ckpt.storage.localfile import LocalSink

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
        from ckpt.storage.remote import OPEN_HEAD, OPEN_TAIL

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


class _Held:
    """The bytes of an object held for one PUT, as a seekable file: ``segments`` ``(offset,
    view)`` in offset order (copies, or buffers lent by the writer), zeros between them, ``size``
    bytes in all. botocore reads it (``read``/``seek``) to sign the request; aiohttp sends it as
    an async iterable of views of the segments themselves (no copies, no executor hops: a file
    object would be read in 256 KiB pieces on aiohttp's thread pool)."""

    def __init__(self, segments: list[tuple[int, memoryview]], size: int) -> None:
        self._segments, self._size = segments, size
        self._starts = [offset for offset, _ in segments]
        self._pos = self._i = 0  # _i: no segment before it ends after _pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        pos = offset if whence == 0 else self._pos + offset if whence == 1 else self._size + offset
        if pos < 0:
            raise ValueError(f"negative seek position {pos}")
        self._pos, self._i = pos, max(0, bisect.bisect_right(self._starts, pos) - 1)
        return pos

    def _next(self, limit: int) -> memoryview:
        """Up to ``limit`` bytes from the position on, as a view of one segment (or zeros)."""
        segments, pos = self._segments, self._pos
        while self._i < len(segments) and segments[self._i][0] + len(segments[self._i][1]) <= pos:
            self._i += 1
        if self._i < len(segments) and segments[self._i][0] <= pos:
            offset, view = segments[self._i]
            out = view[pos - offset:pos - offset + limit]
        else:  # a gap: never written, zeros
            end = segments[self._i][0] if self._i < len(segments) else self._size
            out = memoryview(bytes(min(limit, end - pos)))
        self._pos += len(out)
        return out

    def read(self, size: int | None = -1) -> bytes:
        n = self._size - self._pos if size is None or size < 0 else min(size, max(0, self._size - self._pos))
        first = self._next(n) if n else memoryview(b"")
        if len(first) == n:
            return bytes(first)
        parts, got = [first], len(first)
        while got < n:
            parts.append(self._next(n - got))
            got += len(parts[-1])
        return b"".join(parts)

    async def __aiter__(self) -> AsyncIterator[bytes | memoryview]:
        """The bytes from the position on, in views of at most CHUNK bytes (aiohttp's body);
        runs of small pieces (many small tensors) are joined, so each send is large."""
        small: list[memoryview] = []
        held = 0
        while self._pos < self._size:
            view = self._next(CHUNK)
            if len(view) >= _SMALL_SEND and not small:
                yield view
                continue
            small.append(view)
            held += len(view)
            if held >= _SMALL_SEND or self._pos >= self._size:
                yield b"".join(small)
                small, held = [], 0

    def pread(self, offset: int, n: int) -> bytes:
        """``n`` bytes at ``offset`` (the position is left where it was)."""
        pos = self._pos
        self.seek(offset)
        try:
            return self.read(n)
        finally:
            self.seek(pos)

    def crc32c(self) -> int:
        """The CRC-32C of all the bytes (segments and gaps, in order)."""
        value = pos = 0
        for offset, view in self._segments:
            if offset > pos:
                value = _zeros_crc(value, offset - pos)
            value, pos = crc32c(view, value), offset + len(view)
        return _zeros_crc(value, self._size - pos) if self._size > pos else value


def _zeros_crc(value: int, n: int) -> int:
    """``value`` continued over ``n`` zero bytes."""
    zeros = bytes(min(n, CHUNK))
    while n:
        value = crc32c(zeros[:min(n, len(zeros))], value)
        n -= min(n, len(zeros))
    return value


#: Pieces of a one-PUT body smaller than this are joined before they are sent (one send each
#: would cost a system call per small tensor).
_SMALL_SEND = 256 << 10


def _sends_own_checksum(client: Any) -> bool:
    """Whether a PUT should carry the CRC-32C ckpt computes (from the held buffers, ~15 GB/s)
    instead of the one botocore would add: over http, where botocore puts a CRC32 it computes
    itself (a pass over the body with zlib) in a header. A request with its own checksum header
    gets none from botocore (botocore >= 1.36, which has ``request_checksum_calculation``), which
    also means over https botocore would sign the payload (SHA-256) instead of sending its
    checksum as an unsigned trailer; so over https, or when the client computes checksums only
    when required, botocore's own way stands."""
    meta = getattr(client, "meta", None)
    config = getattr(meta, "config", None)
    return getattr(config, "request_checksum_calculation", None) == "when_supported" and \
        str(getattr(meta, "endpoint_url", "")).startswith("http://")


def _hold_max(part: int) -> int:
    """Bytes of copies an upload sent as one PUT may hold before it becomes a multipart upload:
    what a multipart upload holds at most (the parts in flight, the one being filled, the first)."""
    return (UPLOADS_IN_FLIGHT + 2) * part


class S3Upload:
    """A new S3 object written as a :class:`ckpt.storage.WritableBlob` (the blob of saves to
    s3://): one PUT when it is small enough, else a multipart upload streamed while it is
    written; no local copy, bounded memory either way.

    **One PUT** (objects up to SINGLE_PUT_MAX): the blob keeps what it is given until
    ``finish()``, then sends it as one request whose body is read straight out of those bytes
    (``_Held``) with its Content-Length and, unless the client was configured to send
    checksums only when required, its CRC-32C (S3 checks it). Buffers a writer *lends*
    (``lend_pieces``: views of the caller's arrays, alive and unchanged until the blob is
    finished; ``_io.Runs`` lends them for the writers) are kept by reference; everything else
    is copied, at most ``_hold_max`` bytes of it. One request costs less than a multipart
    upload: moto, for one, re-reads and joins every part to complete an upload, about a second
    PUT's work.

    **Multipart** (once the object grows past SINGLE_PUT_MAX, or its copies past
    ``_hold_max``): what was held goes out as parts of UPLOAD_PART bytes, and every later byte
    is cut into parts uploaded as they fill (UPLOADS_IN_FLIGHT at once). It relies on the blob
    write order: the first part, which holds the head (patched last), stays in memory until
    ``finish()``, which sends it and completes the upload.

    Either way the object appears whole or never, create-only when asked (``If-None-Match: *``
    on the PUT or on completing the upload); ``abort()`` cancels the parts and drops what was held.
    """

    def __init__(self, store: ObjectStore, url: str, create_only: bool, part: int = 0) -> None:
        self._store, self.url = store, url
        self._bucket, self._key = store._bucket_key(url)
        self._cond: dict[str, Any] = {"IfNoneMatch": "*"} if create_only else {}
        self._part = part or UPLOAD_PART
        self._head_end = -1  # the end of the first write: bytes before it are the head (unknown until then)
        self._end = 0  # the end of the furthest byte written
        # one PUT: the head, and the bytes after it as (offset, view) in order; _held bytes are copies
        self._single = True
        self._head = bytearray()
        self._segments: list[tuple[int, memoryview]] = []
        self._held = 0
        # multipart: part 1, bytes [0, _first_end), is kept until finish(); the part being filled
        # starts at _buf_start and has _fill bytes
        self._first = bytearray()
        self._first_end = -1
        self._buf: io.BytesIO | None = None
        self._buf_start = self._fill = 0
        self._upload_id: str | None = None
        self._parts: list[tuple[int, Any]] = []  # (part number, future of its ETag)
        self._in_flight: list[Any] = []  # futures of the parts on their way
        self._tail = b""  # the last OPEN_TAIL bytes before _buf_start

    @property
    def name(self) -> str:
        return self.url

    @property
    def size(self) -> int:
        return self._end

    @property
    def single(self) -> bool:
        """True while the object is to go up as one PUT (False: a multipart upload)."""
        return self._single

    def write_pieces(self, pieces: Sequence[Any], offset: int) -> None:
        if self._single and len(pieces) > 1:  # one copy of the run, not one per piece
            self._write(memoryview(b"".join(pieces)), offset, False)
            return
        for piece in pieces:
            view = memoryview(piece).cast("B")
            self._write(view, offset, False)
            offset += len(view)

    def lend_pieces(self, pieces: Sequence[Any], offset: int) -> None:
        """Write ``pieces`` back to back from ``offset``, keeping references instead of copies
        while the object is to go up as one PUT: the caller promises each piece stays alive and
        unchanged until the blob is finished (``bytes`` objects always do)."""
        for piece in pieces:
            view = memoryview(piece).cast("B")
            self._write(view, offset, not isinstance(piece, bytes))
            offset += len(view)

    def write_at(self, data: Any, offset: int) -> None:
        self._write(memoryview(data).cast("B"), offset, False)

    def _write(self, view: memoryview, offset: int, lent: bool) -> None:
        n = len(view)
        if not n:
            return
        if self._head_end < 0:  # the first write: its end closes the head
            self._head_end = offset + n
        if not self._single:
            self._write_parts(view, offset)
            return
        if offset < self._head_end:  # the head: in memory, writable at any time
            take = min(n, self._head_end - offset)
            if len(self._head) < offset + take:
                self._head.extend(bytes(offset + take - len(self._head)))
            self._head[offset:offset + take] = view[:take]
            self._end = max(self._end, offset + take)
            view, offset = view[take:], offset + take
        if view:
            if offset < self._end:
                raise ValueError(f"{self.url}: a write at offset {offset} goes back before {self._end}: writers "
                                 "keep the WritableBlob order (only the head is patched later)")
            if not lent:
                view = memoryview(bytes(view))
                self._held += len(view)
            self._segments.append((offset, view))
            self._end = offset + len(view)
        if self._end > SINGLE_PUT_MAX or self._held + len(self._head) > _hold_max(self._part):
            with translating(self.url, "uploading the checkpoint", writing=True):
                self._to_parts()

    def _to_parts(self) -> None:
        """Turn the upload into a multipart one: what is held goes out in parts (copied)."""
        self._single = False
        segments, self._segments, self._held = self._segments, [], 0
        self._first, self._head = self._head, bytearray()
        self._first_end = max(self._part, self._head_end)
        self._buf_start, self._fill = self._first_end, 0
        for offset, view in segments:
            self._write_parts(view, offset)

    def _write_parts(self, view: memoryview, offset: int) -> None:
        if offset < self._first_end:  # the first part: in memory, writable at any time
            take = min(len(view), self._first_end - offset)
            if len(self._first) < offset + take:
                self._first.extend(bytes(offset + take - len(self._first)))
            self._first[offset:offset + take] = view[:take]
            self._end = max(self._end, offset + take)
            view, offset = view[take:], offset + take
            if not view:
                return
        end = self._buf_start + self._fill
        if offset < end:
            raise ValueError(f"{self.url}: a write at offset {offset} goes back before {end}: writers keep "
                             "the WritableBlob order (only the head is patched later)")
        with translating(self.url, "uploading the checkpoint", writing=True):
            self._append(bytes(offset - end) if offset > end else b"")  # a gap reads as zeros
            self._append(view)
        self._end = max(self._end, offset + len(view))

    def _append(self, view: Any) -> None:
        """Copy ``view`` into the part being filled, sending each part that fills up."""
        view = memoryview(view).cast("B")
        while len(view):
            if self._buf is None:
                self._buf = io.BytesIO()  # sent as it is: aiohttp streams a BytesIO without copying it
            take = min(len(view), self._part_size() - self._fill)
            self._buf.write(view[:take])
            self._fill += take
            view = view[take:]
            if self._fill == self._part_size():
                self._send()

    def _part_size(self) -> int:
        return self._part * (1 + len(self._parts) // 1000)  # within S3's 10,000 parts

    def _send(self) -> None:
        """Start uploading the part being filled (waiting while UPLOADS_IN_FLIGHT are on their way)."""

        from ckpt.storage.remote import OPEN_TAIL

        body, n = self._buf, self._fill
        assert body is not None
        with body.getbuffer() as view:  # no copy of the part
            self._tail = (self._tail + bytes(view[-OPEN_TAIL:]))[-OPEN_TAIL:]
        body.seek(0)
        if self._upload_id is None:
            mpu = self._store.call("call_s3", "create_multipart_upload", Bucket=self._bucket, Key=self._key)
            self._upload_id = str(mpu["UploadId"])
        while len(self._in_flight) >= UPLOADS_IN_FLIGHT:
            self._in_flight.pop(0).result()
        number = len(self._parts) + 2  # part 1 is the first part, sent last
        future = asyncio.run_coroutine_threadsafe(self._upload_part(number, body), self._store.fs.loop)
        self._parts.append((number, future))
        self._in_flight.append(future)
        self._buf_start += n
        self._buf, self._fill = None, 0

    async def _upload_part(self, number: int, body: Any) -> str:
        resp = await self._store.within(self._store.fs._call_s3("upload_part", Bucket=self._bucket, Key=self._key,
                                                                UploadId=self._upload_id, PartNumber=number, Body=body),
                                        len(body.getbuffer()))
        return str(resp["ETag"])

    def close(self) -> None:
        self.finish()

    def finish(self) -> tuple[int, bytes, bytes]:
        """Send what is left (the whole object as one PUT, or the last parts) and complete the
        upload: the object now exists, whole. Return ``(size, its first OPEN_HEAD bytes, its
        last OPEN_TAIL bytes)`` (the copies a commit record carries). On failure nothing is left
        in the store (the upload is aborted)."""
        try:
            with translating(self.url, "uploading the checkpoint", writing=True):
                head, tail = self._put_held() if self._single else self._complete()
                self._store.fs.invalidate_cache(self._store._path(self.url))
        finally:
            self.abort()
        return self._end, head, tail

    def _put_held(self) -> tuple[bytes, bytes]:
        """One PUT of the held bytes, read out of them as it is sent (no joined copy)."""
        from ckpt.storage.remote import OPEN_HEAD, OPEN_TAIL

        size = self._end
        body = _Held(([(0, memoryview(self._head))] if self._head else []) + self._segments, size)
        checksum = {}
        if _sends_own_checksum(getattr(self._store.fs, "s3", None)):  # S3 checks it on arrival
            checksum = {"ChecksumAlgorithm": "CRC32C",
                        "ChecksumCRC32C": base64.b64encode(body.crc32c().to_bytes(4, "big")).decode()}
        self._store.call("call_s3", "put_object", Bucket=self._bucket, Key=self._key, Body=body, ContentLength=size,
                         **checksum, **self._cond, nbytes=size)
        head = body.pread(0, min(OPEN_HEAD, size))
        return head, body.pread(max(len(head), size - OPEN_TAIL), size)

    def _complete(self) -> tuple[bytes, bytes]:
        """Send the last part and the first, then complete the multipart upload."""

        from ckpt.storage.remote import OPEN_HEAD, OPEN_TAIL

        fs, size = self._store.fs, self._end
        head = bytes(self._first[:OPEN_HEAD])
        if self._upload_id is None and not self._fill:  # it fits in the first part: one PUT
            self._store.call("call_s3", "put_object", Bucket=self._bucket, Key=self._key, Body=io.BytesIO(self._first),
                             **self._cond, nbytes=len(self._first))
            return head, bytes(self._first[max(len(head), size - OPEN_TAIL):])
        if self._fill:
            self._send()  # the last part may be short
        if len(self._first) < self._first_end:  # never written up to its end: zeros
            self._first.extend(bytes(self._first_end - len(self._first)))
        tail_start, sent_from = max(len(head), size - OPEN_TAIL), size - len(self._tail)
        tail = bytes(self._first[tail_start:sent_from]) + self._tail[max(0, tail_start - sent_from):]
        parts = [{"PartNumber": 1, "ETag": _sync(fs.loop, self._upload_part, 1, io.BytesIO(self._first))}]
        while self._in_flight:
            self._in_flight.pop(0).result()
        parts += [{"PartNumber": n, "ETag": f.result()} for n, f in self._parts]
        self._store.call("call_s3", "complete_multipart_upload", Bucket=self._bucket, Key=self._key,
                         UploadId=self._upload_id, MultipartUpload={"Parts": parts}, **self._cond)
        self._upload_id = None
        return head, tail

    def abort(self) -> None:
        """Cancel the upload (parts sent so far are discarded by the store) and drop what is
        held (lent buffers included); idempotent."""

        for future in self._in_flight:
            future.cancel()
        for future in self._in_flight:
            try:
                future.exception()
            except BaseException:  # cancelled, or failed: either way it is over
                pass
        self._in_flight.clear()
        self._first, self._buf, self._head, self._segments = bytearray(), None, bytearray(), []
        upload_id, self._upload_id = self._upload_id, None
        if upload_id is not None:
            try:
                self._store.call("call_s3", "abort_multipart_upload", Bucket=self._bucket, Key=self._key,
                                 UploadId=upload_id)
            except Exception:  # the store is failing: its lifecycle rules drop the parts
                pass
