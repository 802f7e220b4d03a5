"""The check every compare-and-swap read shares: the state file is small and has a version."""

from __future__ import annotations

from typing import Any

from ckpt.errors import CorruptCheckpointError

__all__ = ["checked_version"]


def checked_version(url: str, data: Any, version: Any, limit: int) -> tuple[bytes, Any]:
    """``(bytes, version)`` of a versioned read of the state file at ``url``.

    Raises:
        CorruptCheckpointError: over ``limit`` bytes, or the store sent no version.
    """
    if len(data) > limit:
        raise CorruptCheckpointError(f"{url}: the state file is over {limit} bytes")
    if not version:
        raise CorruptCheckpointError(f"{url}: the store sent no version (ETag, generation) for the state file")
    return bytes(data), version
