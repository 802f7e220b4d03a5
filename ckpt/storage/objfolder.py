"""The objects under one prefix of an object store read whole (internal): the
:class:`ckpt.storage.Folder` of an incremental checkpoint's chunk store in S3, GCS or memory://.

``read_objects`` reads each object with one GET of its first ``n + 1`` bytes (the extra byte tells
an object longer than expected; a shorter one, an encoded chunk, comes back as its bytes), and
``read_whole`` objects of unknown length up to a limit (a delta chain's files) with one GET each; up to
``Sizes.concurrency`` in flight at once on stores with an async implementation. A missing object
is reported, not raised, so a reader names the tensor that needed it.

Example:
    >>> from ckpt.storage.objstore import MemoryStore
    >>> store = MemoryStore("memory://doc-objfolder")
    >>> store.put("memory://doc-objfolder/c/a", b"abc", create_only=True)
    >>> folder = RemoteFolder(store, "memory://doc-objfolder/c")
    >>> buf, short, long = bytearray(3), bytearray(2), bytearray(4)
    >>> folder.read_objects([("a", memoryview(buf)), ("b", memoryview(buf)), ("a", memoryview(short)),
    ...                      ("a", memoryview(long))])
    [None, 'is missing', 'holds more than 2 bytes', b'abc']
    >>> bytes(buf), folder.read_whole(["a", "b"], 3), folder.read_whole(["a"], 2), folder.sizes()
    (b'abc', [b'abc', 'is missing'], ['holds more than 2 bytes'], {'a': 3})
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from ckpt.storage import urls as _urls
from ckpt.storage.faults import translating
from ckpt.storage.objstore import ObjectStore, missing_object, sync

__all__ = ["RemoteFolder"]


class RemoteFolder:
    """The objects under ``url`` (a prefix of ``store``), read whole through ``store``."""

    def __init__(self, store: ObjectStore, url: str) -> None:
        self.store = store
        self.url = url.rstrip("/")

    @property
    def location(self) -> str:
        return self.url

    def where(self, name: str) -> str:
        return _urls.join(self.url, name)

    def read_objects(self, items: Sequence[tuple[str, memoryview]]) -> list[str | bytes | None]:
        if not items:
            return []
        with translating(self.where(items[0][0]), "reading the chunk store's objects"):
            if getattr(self.store.fs, "async_impl", False):
                return list(sync(self.store.fs.loop, self._read_all, [(n, v, len(v) + 1) for n, v in items]))
            return [self._fill(view, self._range_sync(name, 0, len(view) + 1)) for name, view in items]

    def read_whole(self, names: Sequence[str], limit: int) -> list[bytes | str]:
        if not names:
            return []
        with translating(self.where(names[0]), "reading the chunk store's objects"):
            if getattr(self.store.fs, "async_impl", False):
                got = sync(self.store.fs.loop, self._read_all, [(n, None, limit + 1) for n in names])
            else:
                got = [self._range_sync(name, 0, limit + 1) for name in names]
        return ["is missing" if data is None else f"holds more than {limit} bytes" if len(data) > limit else data
                for data in got]

    def read_ranges(self, items: Sequence[tuple[str, int, memoryview]]) -> list[tuple[str | None, int | None]]:
        """One ranged GET per item, up to ``Sizes.concurrency`` in flight (no crc32c computed)."""
        if not items:
            return []
        with translating(self.where(items[0][0]), "reading the chunk store's objects"):
            if getattr(self.store.fs, "async_impl", False):
                got = sync(self.store.fs.loop, self._read_all, [(n, None, (o, o + len(v))) for n, o, v in items])
            else:
                got = [self._range_sync(n, o, o + len(v)) for n, o, v in items]
        answers: list[tuple[str | None, int | None]] = []
        for (_, offset, view), data in zip(items, got):
            if data is None:
                answers.append(("is missing", None))
            elif len(data) < len(view):
                answers.append((f"is truncated: the object ends at byte {offset + len(data)}, before byte "
                                f"{offset + len(view)}", None))
            else:
                view[:] = data[:len(view)]
                answers.append((None, None))
        return answers

    def _range_sync(self, name: str, start: int, end: int) -> bytes | None:
        """Bytes ``start`` to ``end`` of the object ``name`` (fewer where it ends first), or None: missing."""
        try:
            return bytes(self.store.fs.cat_file(self.store.path(self.where(name)), start=start, end=end))
        except FileNotFoundError as exc:
            if not missing_object(exc):
                raise
            return None

    async def _read_all(self, items: Sequence[tuple[str, memoryview | None, int | tuple[int, int]]]) -> list[Any]:
        """GET each ``(name, view, end)``'s first ``end`` bytes (``end`` a (start, end) pair: those
        bytes) side by side; each result is ``_fill``'s for a view, else the bytes or None (missing)."""
        gate = asyncio.Semaphore(self.store.sizes.concurrency)

        async def one(name: str, view: memoryview | None, end: int | tuple[int, int]) -> Any:
            path = self.store.path(self.where(name))
            start, end = end if isinstance(end, tuple) else (0, end)
            async with gate:
                try:
                    data = bytes(await self.store.within(self.store.fs._cat_file(path, start=start, end=end),
                                                         end - start))
                except FileNotFoundError as exc:
                    if not missing_object(exc):
                        raise
                    return "is missing" if view is not None else None
            return self._fill(view, data) if view is not None else data

        results = await asyncio.gather(*(one(*item) for item in items), return_exceptions=True)
        for result in results:  # every request finished (no buffer is written after we return)
            if isinstance(result, BaseException):
                raise result
        return list(results)

    @staticmethod
    def _fill(view: memoryview, data: bytes | None) -> str | bytes | None:
        if data is None:
            return "is missing"
        if len(data) < len(view):
            return data  # an encoded chunk: the caller decodes it
        if len(data) > len(view):
            return f"holds more than {len(view)} bytes"
        view[:] = data
        return None

    def sizes(self) -> dict[str, int]:
        return {str(e["name"]): int(e.get("size") or 0) for e in self.store.list(self.url)}
