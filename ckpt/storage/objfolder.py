"""The objects under one prefix of an object store read whole (internal): the
:class:`ckpt.storage.Folder` of an incremental checkpoint's chunk store in S3, GCS or memory://.

Each object is one GET of its first ``n + 1`` bytes (the extra byte tells an object longer than
expected), up to ``Sizes.concurrency`` in flight at once on stores with an async implementation;
a missing object is reported, not raised, so a reader names the tensor that needed it.

Example:
    >>> from ckpt.storage.objstore import MemoryStore
    >>> store = MemoryStore("memory://doc-objfolder")
    >>> store.put("memory://doc-objfolder/c/a", b"abc", create_only=True)
    >>> folder = RemoteFolder(store, "memory://doc-objfolder/c")
    >>> buf, short = bytearray(3), bytearray(2)
    >>> folder.read_objects([("a", memoryview(buf)), ("b", memoryview(buf)), ("a", memoryview(short))])
    [None, 'is missing', 'should hold 2 bytes']
    >>> bytes(buf), folder.sizes()
    (b'abc', {'a': 3})
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

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

    def read_objects(self, items: Sequence[tuple[str, memoryview]]) -> list[str | None]:
        if not items:
            return []
        with translating(self.where(items[0][0]), "reading the chunk store's objects"):
            if getattr(self.store.fs, "async_impl", False):
                return list(sync(self.store.fs.loop, self._read_all, items))
            return [self._fill(view, self._get_sync(name, len(view))) for name, view in items]

    def _get_sync(self, name: str, n: int) -> bytes | None:
        try:
            return bytes(self.store.fs.cat_file(self.store.path(self.where(name)), start=0, end=n + 1))
        except FileNotFoundError as exc:
            if not missing_object(exc):
                raise
            return None

    async def _read_all(self, items: Sequence[tuple[str, memoryview]]) -> list[str | None]:
        gate = asyncio.Semaphore(self.store.sizes.concurrency)

        async def one(name: str, view: memoryview) -> str | None:
            path = self.store.path(self.where(name))
            async with gate:
                try:
                    data = await self.store.within(self.store.fs._cat_file(path, start=0, end=len(view) + 1),
                                                   len(view))
                except FileNotFoundError as exc:
                    if not missing_object(exc):
                        raise
                    return "is missing"
            return self._fill(view, bytes(data))

        results = await asyncio.gather(*(one(n, v) for n, v in items), return_exceptions=True)
        for result in results:  # every request finished (no buffer is written after we return)
            if isinstance(result, BaseException):
                raise result
        return [r for r in results if not isinstance(r, BaseException)]

    @staticmethod
    def _fill(view: memoryview, data: bytes | None) -> str | None:
        if data is None:
            return "is missing"
        if len(data) != len(view):
            return f"should hold {len(view)} bytes"
        view[:] = data
        return None

    def sizes(self) -> dict[str, int]:
        return {str(e["name"]): int(e.get("size") or 0) for e in self.store.list(self.url)}
