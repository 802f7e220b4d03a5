"""Bytes in an object store, through fsspec (internal): the operations checkpoints need (ranged
reads several at once, whole small objects, create-only writes, compare-and-swap writes,
uploads, listings, deletes), generic over any fsspec filesystem. A store with more to offer is a
subclass (``ckpt.storage.s3.S3Store``, ``ckpt.storage.gcs.GCSStore``, :class:`MemoryStore`);
``ckpt.storage.backends.object_store`` picks the class for a URL.

Every operation names the URL in its errors (``ckpt.storage.faults``). Neighbouring spans are
fetched by one request, and large ranges are cut into pieces fetched concurrently (at most
``Sizes.max_piece`` bytes each, copied into place).

Atomicity comes from the store's conditional writes: create-only (``put(..., create_only=True)``,
fsspec's ``mode="create"``) and compare-and-swap (``get_versioned`` / ``put_if``). The generic
store compares the bytes just before writing, which narrows the race window but cannot close it
(``atomic_swap`` is False); the subclasses close it with the store's own conditions.

Sizes (parts, pieces, thresholds) are a :class:`Sizes` given to the constructor, or taken from
the storage options ``ckpt_<field>`` (``{"ckpt_upload_part": 5 << 20}``).

Example:
    >>> from ckpt.storage.objstore import MemoryStore
    >>> store = MemoryStore("memory://doc-objstore")
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
import dataclasses
import os
import threading
from dataclasses import dataclass
from typing import Any, TypeVar
from collections.abc import Awaitable, Callable, Mapping, Sequence

from ckpt.errors import CorruptCheckpointError
from ckpt.storage import urls as _urls
from ckpt.storage.faults import translating
from ckpt.storage.uploads import StagedUpload, Upload

__all__ = ["ObjectStore", "MemoryStore", "Sizes", "TIMEOUT", "RATE"]

#: Deadlines (storage options ``ckpt_timeout`` and ``ckpt_rate``): every request to a store with an
#: async implementation (S3, GCS) must finish, retries included, within TIMEOUT seconds plus one
#: second per RATE bytes it moves, or it ends in a StorageError (CheckpointWriteError when writing)
#: naming the URL. The rate is low on purpose (requests side by side share the link): it bounds a
#: stalled transfer without failing a slow one. botocore's own connect/read timeouts (s3fs: 5 s
#: and 15 s, ``config_kwargs``) end a silent connection sooner.
TIMEOUT = 60.0
RATE = 64 << 10
#: Seconds a chunk store's lease (``ckpt.storage.leases``) stays valid unless renewed (storage
#: option ``ckpt_grace``): a save or collection paused longer than half of it gives up.
GRACE = 3600.0


@dataclass(frozen=True)
class Sizes:
    """How an object store cuts its transfers (the defaults suit real stores; tests pass KiB).

    ``piece``: uploads and (on stores other than S3) ranged reads move pieces of this many bytes
    or more; ``concurrency``: requests in flight at once for one read or upload; ``max_piece``:
    pieces held whole in memory are at most this big; ``part``: S3 reads fetch a run of bytes by
    streamed ranged GETs of at least this many bytes (every request costs a round trip and, on
    some servers, work in proportion to the object's size: moto reads the whole object for each);
    ``single_put_max``: S3 objects up to this size go up as one PUT (S3 takes up to 5 GiB; larger
    ones are multipart uploads, which moto completes by re-reading every part); ``upload_part``:
    streamed S3 uploads send parts of this many bytes (S3 wants 5 MiB or more, at most 10,000
    parts: every 1,000 parts the size grows by this much); ``uploads_in_flight``: at most this many
    parts at once (memory holds at most uploads_in_flight + 2 parts); ``chunk``: bytes a streamed
    GET hands over at a time; ``gap``: spans at most this far apart are fetched by one ranged GET;
    ``single_get_max``/``whole_slack``: S3 reads of an object up to single_get_max bytes that want
    all of it but at most whole_slack bytes (and 1/16 of it) are one GET of the whole object.
    """

    piece: int = 8 << 20
    concurrency: int = 16
    max_piece: int = 32 << 20
    part: int = 128 << 20
    single_put_max: int = 512 << 20
    upload_part: int = 8 << 20
    uploads_in_flight: int = 8
    chunk: int = 1 << 20
    gap: int = 64 << 10
    single_get_max: int = 512 << 20
    whole_slack: int = 1 << 20

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Sizes:
        """The sizes with each ``ckpt_<field>`` storage option in ``options`` applied.

        Raises:
            ValueError: an option is not a whole number of bytes (at least 1, or 0 for the
                thresholds ``single_put_max``, ``single_get_max``, ``whole_slack`` and ``gap``).
        """
        changes = {}
        for field in dataclasses.fields(cls):
            key = "ckpt_" + field.name
            if key in options:
                value, least = options[key], 0 if field.name in _MAY_BE_ZERO else 1
                if type(value) is not int or value < least:
                    raise ValueError(f"storage_options {key!r} must be a whole number of bytes >= {least}, "
                                     f"got {value!r}")
                changes[field.name] = value
        return dataclasses.replace(cls(), **changes) if changes else cls()

    def piece_size(self, total: int) -> int:
        """Bytes per request when moving ``total`` bytes held in memory: ``concurrency`` requests
        where that gives pieces of ``piece`` to ``max_piece`` bytes (fewer, larger requests cost less)."""
        return min(self.max_piece, max(self.piece, -(-total // self.concurrency)))

    def part_size(self, total: int) -> int:
        """Bytes per streamed ranged GET when reading ``total`` bytes: ``total`` cut into equal
        parts of ``part`` to 2 * ``part`` bytes, or ``concurrency`` larger ones (streaming keeps
        memory bounded whatever the part's size)."""
        return -(-total // max(1, min(self.concurrency, total // self.part)))


_MAY_BE_ZERO = frozenset({"single_put_max", "single_get_max", "whole_slack", "gap"})
#: The storage options that are ckpt's own, not the filesystem's.
CKPT_OPTIONS = frozenset({"ckpt_timeout", "ckpt_rate", "ckpt_grace"} |
                         {"ckpt_" + f.name for f in dataclasses.fields(Sizes)})


def pieces_of(spans: Sequence[tuple[int, memoryview]], size_for: Callable[[int], int],
              gap: int) -> list[tuple[int, int, list[int]]]:
    """The ranged GETs ``(start, end, [span indices])`` that cover every non-empty span (spans at
    most ``gap`` bytes apart together), each at most ``size_for(total bytes fetched)`` long."""
    order = sorted((i for i, (_, view) in enumerate(spans) if len(view)), key=lambda i: spans[i][0])
    runs: list[list[Any]] = []  # [start, end, members]
    for i in order:
        offset, view = spans[i]
        if runs and offset <= runs[-1][1] + gap:
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


def missing_object(exc: FileNotFoundError) -> bool:
    """True when a FileNotFoundError says the object is absent (not its bucket)."""
    return "bucket" not in str(exc).lower()


T = TypeVar("T")


def sync(loop: Any, func: Callable[..., Awaitable[T]], *args: Any) -> T:
    """fsspec's ``sync(loop, func, *args)``, raising a deadline's TimeoutError (its message
    saying which deadline) as it is: sync() replaces any TimeoutError by a bare one of its own."""
    from fsspec.asyn import FSTimeoutError, sync as fsspec_sync  # lazy: fsspec is an optional dependency

    try:
        return fsspec_sync(loop, func, *args)  # type: ignore[no-any-return]
    except FSTimeoutError as exc:
        raise (exc.__cause__ or exc) from None


def _seconds(options: Mapping[str, Any], key: str, default: float) -> float:
    """A positive number from the storage option ``key`` (``default`` when absent)."""
    value = options.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"storage_options {key!r} must be a positive number, got {value!r}")
    return float(value)


class ObjectStore:
    """The fsspec filesystem of one URL's store, with the operations checkpoints need.

    ``sizes`` (default: from the ``ckpt_<field>`` storage options) says how transfers are cut.
    """

    #: Whether ``put_if`` is a true compare-and-swap (the store checks the version itself).
    atomic_swap = False

    def __init__(self, url: str, storage_options: _urls.StorageOptions | None = None,
                 sizes: Sizes | None = None) -> None:
        self.protocol = _urls.protocol(url)
        options = dict(_urls.check_options(storage_options))
        self.timeout = _seconds(options, "ckpt_timeout", TIMEOUT)
        self.rate = _seconds(options, "ckpt_rate", RATE)
        self.grace = _seconds(options, "ckpt_grace", GRACE)
        self.sizes = sizes if sizes is not None else Sizes.from_options(options)
        self.fs = _urls.filesystem(url, {k: v for k, v in options.items() if k not in CKPT_OPTIONS})

    def path(self, url: str) -> str:
        """The filesystem's path of ``url`` (no protocol)."""
        return str(self.fs._strip_protocol(url))

    def bucket_key(self, url: str) -> tuple[str, str]:
        """The bucket and key of ``url``."""
        bucket, key, _ = self.fs.split_path(self.path(url))
        return bucket, key

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

        return sync(self.fs.loop, bounded)

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
            return int(self.call("size", self.path(url)))

    def read_into(self, url: str, spans: Sequence[tuple[int, memoryview]],
                  name: Callable[[int], str] = lambda i: "data", size: int | None = None,
                  done: Callable[[int], None] | None = None) -> None:
        """Fill each ``(offset, view)`` with the object's bytes there, many ranged GETs at once.

        Spans within ``gap`` bytes of each other are fetched together, and what is fetched is cut
        into ranged GETs (``Sizes.piece_size``), up to ``concurrency`` in flight at once: many
        small tensors cost one request, a big read a few side by side. A range the object does not
        fully hold is a CorruptCheckpointError naming ``name(i)``. ``size`` (the object's, when
        known) and ``done(i)`` (called as soon as span i is filled) are for stores that stream.
        """
        pieces = pieces_of(spans, self.sizes.piece_size, self.sizes.gap)
        if not pieces:
            return
        path = self.path(url)
        with translating(url, f"reading {name(pieces[0][2][0])}"):
            if getattr(self.fs, "async_impl", False):
                sync(self.fs.loop, self._fetch_async, path, url, spans, pieces, name)  # bounded per GET
            else:
                for start, end, members in pieces:
                    data = self.fs.cat_file(path, start=start, end=end)
                    _scatter(data, start, end, spans, members, url, name)

    async def _fetch_async(self, path: str, url: str, spans: Sequence[tuple[int, memoryview]],
                           pieces: list[tuple[int, int, list[int]]], name: Callable[[int], str]) -> None:
        gate = asyncio.Semaphore(self.sizes.concurrency)

        async def fetch(start: int, end: int, members: list[int]) -> None:
            async with gate:
                data = await self.within(self.fs._cat_file(path, start=start, end=end), end - start)
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
        path = self.path(url)
        with translating(url, f"reading {what}"):
            try:
                size = int(self.call("size", path))
                return bytes(self.call("cat_file", path, start=0, end=min(limit, size))), size
            except FileNotFoundError as exc:
                if not missing_object(exc):
                    raise
                return None

    def read_small(self, url: str, limit: int, what: str) -> bytes | None:
        """A whole small object (a commit record, a state file), or None when there is none.

        Objects over ``limit`` bytes are a CorruptCheckpointError: never a large download.
        """
        path = self.path(url)
        with translating(url, f"reading {what}"):
            try:
                data = self._cat_small(path, limit)
            except FileNotFoundError as exc:
                if not missing_object(exc):
                    raise
                return None
        if len(data) > limit:
            raise CorruptCheckpointError(f"{url}: {what} is over {limit} bytes: not a ckpt {what}")
        return bytes(data)

    def _cat_small(self, path: str, limit: int) -> bytes:
        """Up to ``limit + 1`` bytes of the object at ``path`` (more than ``limit``: too big)."""
        return bytes(self.call("cat_file", path, start=0, end=limit + 1))

    # -- writes ------------------------------------------------------------------------------

    def put(self, url: str, data: bytes, create_only: bool) -> None:
        """Write a whole small object; with ``create_only`` fail if it exists (FileExistsError
        from the store, raised as CheckpointWriteError naming the URL)."""
        with translating(url, "writing", writing=True):
            self.call("pipe_file", self.path(url), data, mode="create" if create_only else "overwrite",
                      nbytes=len(data))

    def upload(self, local: str, url: str, create_only: bool) -> None:
        """Copy a local file to ``url``; the object appears whole or not at all."""
        size = os.path.getsize(local)
        with translating(url, "uploading the checkpoint", writing=True):
            self.call("put_file", local, self.path(url), mode="create" if create_only else "overwrite", nbytes=size)

    def open_upload(self, url: str, create_only: bool) -> Upload:
        """An upload (a :class:`ckpt.storage.WritableBlob`) that becomes the object ``url`` on ``finish()``
        (create-only when asked) and never before; ``abort()`` discards it. Here: a local file
        uploaded on ``finish()`` (``ckpt.storage.uploads.StagedUpload``)."""
        return StagedUpload(self, url, create_only)

    def get_versioned(self, url: str, limit: int = 16 << 20) -> tuple[bytes | None, Any]:
        """A small object's bytes and a version token for ``put_if`` (None, None: no object).
        Here the version is the bytes themselves."""
        data = self.read_small(url, limit, "the state file")
        return data, data

    def put_if(self, url: str, data: bytes, version: Any) -> bool:
        """Write ``data`` only if the object is still at ``version`` (from ``get_versioned``);
        False when another writer changed it first. Here: the bytes compared just before the
        write (a race window remains: ``atomic_swap`` is False)."""
        current = self.read_small(url, max(len(data), 16 << 20), "the state file")
        if current != version:
            return False
        self.put(url, data, create_only=version is None)
        return True

    # -- listing and deleting --------------------------------------------------------------

    def exists(self, url: str) -> bool:
        """Whether the object exists."""
        with translating(url, "looking up"):
            return bool(self.call("isfile", self.path(url)))

    def list(self, url: str, recursive: bool = False) -> list[dict[str, Any]]:
        """Objects under the directory ``url``: dicts with "name" (relative), "size" and the
        store's other details; an empty list for a directory with nothing in it."""
        base = self.path(url).rstrip("/")
        with translating(url, "listing"):
            try:
                self.fs.invalidate_cache(base)
                if recursive:
                    found = self.call("find", base, detail=True)
                    entries = list(found.values())
                else:
                    entries = [e for e in self.call("ls", base, detail=True) if e.get("type") != "directory"]
            except FileNotFoundError as exc:
                if not missing_object(exc):
                    raise
                return []
        out = []
        for entry in entries:
            name = str(entry["name"]).rstrip("/")
            if name.startswith(base + "/"):
                out.append({**entry, "name": name[len(base) + 1:]})
        return out

    def unfinished_uploads(self, url: str) -> Sequence[tuple[str, str]]:
        """``(object URL, upload id)`` of the uploads begun and neither completed nor aborted
        under the prefix ``url`` (a save killed mid-upload leaves one where a store keeps parts).
        Here: none, and no request."""
        return []

    def abort_upload(self, url: str, upload_id: str) -> None:
        """Abort the unfinished upload ``upload_id`` of ``url`` (a store without them has none)."""

    def delete(self, urls: Sequence[str]) -> None:
        """Delete objects; ones already gone are fine."""
        if not urls:
            return
        with translating(urls[0], "deleting", writing=True):
            for url in urls:
                try:
                    self.call("rm_file", self.path(url))
                except FileNotFoundError:
                    pass


_memory_lock = threading.RLock()  # memory:// has no conditional writes of its own


class MemoryStore(ObjectStore):
    """fsspec's ``memory://`` (tests, examples): conditional writes made atomic by a process lock."""

    atomic_swap = True

    def put(self, url: str, data: bytes, create_only: bool) -> None:
        with _memory_lock:
            super().put(url, data, create_only)

    def put_if(self, url: str, data: bytes, version: Any) -> bool:
        with _memory_lock:
            return super().put_if(url, data, version)
