"""zstd decompression with an output limit, shared by the orbax reader and its OCDBT store.

A leaf module (it imports only ckpt.errors): orbax.py and _ocdbt.py both use it without
importing each other. ``zstandard`` is optional and imported on first use.

Example:
    >>> zstd_decompress(b"not zstd", 10, "f.zarr/0")
    Traceback (most recent call last):
    ...
    ckpt.errors.CorruptCheckpointError: f.zarr/0: does not decompress (zstd): ...
"""

from __future__ import annotations

from ckpt.errors import CorruptCheckpointError, UnsupportedCheckpointError

__all__ = ["zstd_decompress", "zstd_bytes"]


def zstd_decompress(data: bytes, limit: int, where: str) -> bytes:
    """At most ``limit`` bytes of a zstd frame; CorruptCheckpointError when it is damaged."""
    try:
        return zstd_bytes(data, limit)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{where}: does not decompress (zstd): {exc}") from exc


def zstd_bytes(data: bytes, limit: int) -> bytes:
    """At most ``limit`` bytes of a zstd frame; ValueError when it is damaged."""
    try:
        # optional dependency: only orbax's zstd chunks need zstandard
        import zstandard
    except ImportError:
        raise UnsupportedCheckpointError("orbax's zstd-compressed chunks need the zstandard package: "
                                         "pip install \"ckpt-numpy[orbax]\"") from None
    try:
        with zstandard.ZstdDecompressor().stream_reader(data) as reader:
            return reader.read(limit)
    except zstandard.ZstdError as exc:
        raise ValueError(str(exc)) from exc
