"""Streamed S3 uploads (internal): :class:`S3Upload`, the writable blob of saves to ``s3://``:
one PUT read straight out of the writer's buffers (``_Held``), or a multipart upload whose parts
go up while the checkpoint is written.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import io
from typing import Any
from collections.abc import AsyncIterator, Sequence

from ckpt.checksums import crc32c
from ckpt.storage.faults import translating
from ckpt.storage.objstore import ObjectStore
from ckpt.storage.uploads import OPEN_HEAD, OPEN_TAIL, Upload

__all__ = ["S3Upload"]

#: Bytes of a held body sent at a time.
_SEND_CHUNK = 1 << 20


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
        """The bytes from the position on, in views of at most _SEND_CHUNK bytes (aiohttp's body);
        runs of small pieces (many small tensors) are joined, so each send is large."""
        small: list[memoryview] = []
        held = 0
        while self._pos < self._size:
            view = self._next(_SEND_CHUNK)
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
    zeros = bytes(min(n, _SEND_CHUNK))
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


class S3Upload(Upload):
    """A new S3 object written as a :class:`ckpt.storage.WritableBlob` (the blob of saves to
    s3://): one PUT when it is small enough, else a multipart upload streamed while it is
    written; no local copy, bounded memory either way.

    **One PUT** (objects up to ``Sizes.single_put_max``): the blob keeps what it is given until
    ``finish()``, then sends it as one request whose body is read straight out of those bytes
    (``_Held``) with its Content-Length and, unless the client was configured to send
    checksums only when required, its CRC-32C (S3 checks it). Buffers a writer *lends*
    (``lend_pieces``: views of the caller's arrays, alive and unchanged until the blob is
    finished; ``_io.Runs`` lends them for the writers) are kept by reference; everything else
    is copied, at most ``_hold_max`` bytes of it. One request costs less than a multipart
    upload: moto, for one, re-reads and joins every part to complete an upload, about a second
    PUT's work.

    **Multipart** (once the object grows past ``single_put_max``, or its copies past
    ``_hold_max``): what was held goes out as parts of ``upload_part`` bytes, and every later byte
    is cut into parts uploaded as they fill (``uploads_in_flight`` at once). It relies on the blob
    write order: the first part, which holds the head (patched last), stays in memory until
    ``finish()``, which sends it and completes the upload.

    Either way the object appears whole or never, create-only when asked (``If-None-Match: *``
    on the PUT or on completing the upload); ``abort()`` cancels the parts and drops what was held.
    """

    def __init__(self, store: ObjectStore, url: str, create_only: bool) -> None:
        self._store, self.url = store, url
        self._bucket, self._key = store.bucket_key(url)
        self._cond: dict[str, Any] = {"IfNoneMatch": "*"} if create_only else {}
        sizes = store.sizes
        self._part, self._in_flight_max, self._single_max = sizes.upload_part, sizes.uploads_in_flight, \
            sizes.single_put_max
        #: Bytes of copies one PUT may hold before it becomes a multipart upload: what a multipart
        #: upload holds at most (the parts in flight, the one being filled, the first).
        self._hold_max = (sizes.uploads_in_flight + 2) * sizes.upload_part
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
        if self._end > self._single_max or self._held + len(self._head) > self._hold_max:
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
        """Start uploading the part being filled (waiting while ``uploads_in_flight`` are on their way)."""
        body, n = self._buf, self._fill
        assert body is not None
        with body.getbuffer() as view:  # no copy of the part
            self._tail = (self._tail + bytes(view[-OPEN_TAIL:]))[-OPEN_TAIL:]
        body.seek(0)
        if self._upload_id is None:
            mpu = self._store.call("call_s3", "create_multipart_upload", Bucket=self._bucket, Key=self._key)
            self._upload_id = str(mpu["UploadId"])
        while len(self._in_flight) >= self._in_flight_max:
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
                self._store.fs.invalidate_cache(self._store.path(self.url))
        finally:
            self.abort()
        return self._end, head, tail

    def _put_held(self) -> tuple[bytes, bytes]:
        """One PUT of the held bytes, read out of them as it is sent (no joined copy)."""
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
        size = self._end
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
        first = io.BytesIO(self._first)
        parts = [{"PartNumber": 1, "ETag": self._store.run(lambda: self._upload_part(1, first), len(self._first))}]
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
