"""The base of lazy tensor sources: tensors handed to a format writer that are read only when the
writer writes them (a conversion's tensors, a sharded save's blocks), and that may stream.

Example:
    >>> import numpy as np
    >>> from ckpt.lazy import LazySource
    >>> class Ones(LazySource):
    ...     dtype, shape = np.dtype(np.int8), (3,)
    ...     def __array__(self, dtype=None, copy=None): return np.ones(3, np.int8)
    >>> Ones().chunks() is None, np.asarray(Ones()).tolist()
    (True, [1, 1, 1])
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["LazySource"]


class LazySource:
    """A tensor handed to a writer that is read only when the writer writes it: ``dtype``,
    ``shape``, ``__array__()``, and ``chunks()``, its C-order bytes in pieces for writers that
    stream (default None: it does not stream).

    Any object with ``dtype``, ``shape`` and ``__array__`` (an h5py dataset, say) may be handed
    to a writer; subclass this to stream. ``chunks()`` yields flat byte buffers in order, each
    valid until the next is asked for; the writer checks that they add up to ``dtype`` x ``shape``.
    """

    __slots__ = ()

    dtype: np.dtype
    shape: tuple[int, ...]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        raise NotImplementedError

    def chunks(self) -> Iterator[Any] | None:
        """The tensor's bytes in pieces, or None (the default) when it does not stream."""
        return None

    def checked_crc32c(self, block_bytes: int) -> tuple[int, bytes | None] | None:
        """The crc32c of the tensor's C-order bytes and of each block of ``block_bytes`` (packed
        little-endian uint32s; None for one block), as ``chunks()`` checks them while they stream,
        or None (the default) when the source does not know them.

        A writer may store these instead of computing them again, but only once ``chunks()`` has
        been read to its end without an error (the stream's own check passed).
        """
        return None
