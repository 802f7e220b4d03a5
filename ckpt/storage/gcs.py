"""Google Cloud Storage through gcsfs: compare-and-swap on object generations (internal).

Create-only writes are ``ifGenerationMatch=0`` (fsspec's ``mode="create"``); ``put_if`` is a
media upload with ``ifGenerationMatch=<generation>``, the generation read from the
``x-goog-generation`` header of the GET that read the bytes.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from ckpt.storage.faults import translating
from ckpt.storage.objstore import ObjectStore, missing_object
from ckpt.storage.versions import checked_version

__all__ = ["GCSStore"]


class GCSStore(ObjectStore):
    """A GCS bucket's objects (``gs://``, ``gcs://``)."""

    atomic_swap = True

    def get_versioned(self, url: str, limit: int = 16 << 20) -> tuple[bytes | None, Any]:
        """A small object's bytes and its generation, the version ``put_if`` checks (None, None:
        no object): one media GET, the generation from its ``x-goog-generation`` header."""
        path = self.path(url)

        async def get() -> tuple[bytes, Any]:
            headers, data = await self.fs._call("GET", self.fs.url(path), headers={"Range": f"bytes=0-{limit}"})
            return data, headers.get("x-goog-generation")

        with translating(url, "reading the state file"):
            try:
                data, version = self.run(get, limit)
            except FileNotFoundError as exc:
                if not missing_object(exc):
                    raise
                return None, None
        return checked_version(url, data, version, limit)

    def put_if(self, url: str, data: bytes, version: Any) -> bool:
        """A media upload with ``ifGenerationMatch`` (0: only if there is no object yet);
        gcsfs raises FileExistsError for the 412 a changed generation gets."""
        bucket, key = self.bucket_key(url)

        async def post() -> None:
            await self.fs._call("POST", f"{self.fs._location}/upload/storage/v1/b/{quote(bucket)}/o",
                                uploadType="media", name=key, ifGenerationMatch=str(version or 0), data=data,
                                headers={"Content-Type": "application/json"}, json_out=True)

        with translating(url, "writing the state file", writing=True):
            try:
                self.run(post, len(data))
            except FileExistsError:
                return False  # another writer changed (or created) it first
            self.fs.invalidate_cache(self.path(url))
        return True
