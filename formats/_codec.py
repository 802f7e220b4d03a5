"""Encodings ckpt's own formats share: msgpack with every decoder limit set, fixed-width strings.

One place for what hdf5.py, h5plain.py, msgpack.py and ckpt_sharded.py all need, so that
no format module imports another for a helper (hdf5 reads through h5plain as its fallback;
h5plain needs these codecs, not hdf5).

Example:
    >>> import numpy as np
    >>> unpack(packb({"a": [1, b"x"]}), "f.msgpack", "the index")
    {'a': [1, b'x']}
    >>> fixed, lengths = encode_strings(np.array([b"ab", b"c\\x00"], dtype=object))
    >>> decode_strings(fixed, lengths)
    [b'ab', b'c\\x00']
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ckpt.errors import CorruptCheckpointError

from . import _io
from .base import unique_pairs

__all__ = ["HDF5_VERSION", "packb", "unpack", "encode_strings", "decode_strings"]

#: The ckpt HDF5 layout version: written by hdf5.py, checked by it and by h5plain's fallback reader.
HDF5_VERSION = 2


def packb(obj: Any) -> bytes:
    """msgpack bytes of ``obj`` (bytes as bin, str as str)."""
    import msgpack  # lazy: only files that hold msgpack load the package

    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not part of the ckpt format")


def unpack(raw: bytes, path: str, what: str, max_items: int | None = None) -> Any:
    """Decode one msgpack object with every size limit set from what the file can hold.

    Raises:
        CorruptCheckpointError: naming ``path`` and ``what``, for anything msgpack refuses,
            a key given twice, or an extension type.
    """
    import msgpack  # lazy: only files that hold msgpack load the package

    n = len(raw)
    try:
        return msgpack.unpackb(
            raw, raw=False, use_list=True, strict_map_key=True, object_pairs_hook=unique_pairs,
            ext_hook=_no_ext, max_str_len=n, max_bin_len=n,
            max_array_len=n if max_items is None else min(n, max_items), max_map_len=n, max_ext_len=n)
    except (ValueError, msgpack.UnpackException) as exc:  # FormatError, StackError, ExtraData, UTF-8...
        raise CorruptCheckpointError(f"{path}: {what} is not valid msgpack ({type(exc).__name__}: "
                                     f"{exc})") from exc


def encode_strings(arr: np.ndarray) -> tuple[np.ndarray, list[int] | None]:
    """Fixed-width bytes for a string tensor, plus exact lengths when padding would hide NULs."""
    items = [bytes(x) for x in arr.reshape(-1)]
    width = max((len(x) for x in items), default=1) or 1
    fixed = np.array(items, dtype=f"S{width}").reshape(arr.shape) if items else np.empty(arr.shape, f"S{width}")
    lengths = [len(x) for x in items] if any(x.endswith(b"\x00") for x in items) else None
    return _io.c_contiguous(fixed), lengths


def decode_strings(raw: np.ndarray, lengths: list[int] | None) -> list[bytes]:
    """Inverse of encode_strings; ``raw`` is the fixed-width array."""
    width = raw.dtype.itemsize
    flat = raw.reshape(-1)
    if lengths is None:
        return [bytes(x) for x in flat]  # numpy strips the NUL padding
    data = flat.view(np.uint8).reshape(len(flat), width) if len(flat) else np.empty((0, width), np.uint8)
    return [data[i, :n].tobytes() for i, n in enumerate(lengths)]
