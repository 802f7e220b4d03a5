"""ckpt.Shard: which block of a global tensor a variable holds (TensorFlow 1's SaveSliceInfo).

A variable created with ``shard=Shard(global_shape, offset)`` holds the block
``[offset, offset + variable.shape)`` of the global tensor saved under its key. The blocks
of one key, over all the processes of a sharded save, must tile its global shape exactly;
any layout (rows, columns, uneven, empty blocks) is allowed.

Example:
    >>> import numpy as np, ckpt
    >>> s = ckpt.Shard(global_shape=(1000, 64), offset=(250, 0))
    >>> v = ckpt.Variable(np.zeros((250, 64), np.float32), name="emb", shard=s)
    >>> v.shard.box(v.shape)
    (slice(250, 500, None), slice(0, 64, None))
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from collections.abc import Sequence

__all__ = ["Shard"]


def _ints(values: Sequence[int], what: str) -> tuple[int, ...]:
    try:
        out = tuple(operator.index(v) for v in values)
    except TypeError:
        raise TypeError(f"Shard {what} must be a sequence of ints, got {values!r}") from None
    if any(v < 0 for v in out):
        raise ValueError(f"Shard {what} must be non-negative, got {out}")
    return out


@dataclass(frozen=True)
class Shard:
    """The block ``[offset, offset + shape)`` of a global tensor of shape ``global_shape``.

    Args:
        global_shape: the shape of the whole tensor, as saved in the checkpoint.
        offset: where this block starts, one int per axis.

    Example:
        >>> import ckpt
        >>> ckpt.Shard((4, 6), (0, 3))
        Shard(global_shape=(4, 6), offset=(0, 3))
    """

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]

    def __post_init__(self) -> None:
        shape = _ints(self.global_shape, "global_shape")
        offset = _ints(self.offset, "offset")
        if len(shape) != len(offset):
            raise ValueError(f"Shard offset {offset} has {len(offset)} axes, global_shape {shape} has "
                             f"{len(shape)}")
        object.__setattr__(self, "global_shape", shape)
        object.__setattr__(self, "offset", offset)

    def check(self, shape: tuple[int, ...], name: str) -> None:
        """Raise ValueError unless a block of ``shape`` at this offset lies inside the global shape."""
        if len(shape) != len(self.global_shape):
            raise ValueError(f"variable {name!r}: shape {shape} and the shard's global_shape "
                             f"{self.global_shape} differ in rank")
        for axis, (o, n, g) in enumerate(zip(self.offset, shape, self.global_shape)):
            if o + n > g:
                raise ValueError(f"variable {name!r}: the block [{o}, {o + n}) on axis {axis} lies outside "
                                 f"the global shape {self.global_shape}")

    def box(self, shape: tuple[int, ...]) -> tuple[slice, ...]:
        """The slices of the global tensor a block of ``shape`` at this offset covers."""
        return tuple(slice(o, o + n) for o, n in zip(self.offset, shape))
