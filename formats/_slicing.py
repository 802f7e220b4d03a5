"""Reading a block of a tensor: turning ``np.s_[...]`` into a box of (start, stop) per dimension.

Example:
    >>> box((slice(1, 3), 0), (4, 5, 6))
    ([(1, 3), (0, 1), (0, 6)], (2, 6))
"""

from __future__ import annotations

import operator
from typing import Any
from collections.abc import Sequence

from ckpt.errors import MismatchError


def box(index: Any, shape: tuple[int, ...]) -> tuple[list[tuple[int, int]], tuple[int, ...]]:
    """The (start, stop) per dimension an index of slices (step 1) and ints selects, and the
    shape of the result (an int drops its dimension, as numpy does).

    Raises:
        IndexError: steps other than 1, Ellipsis, None, arrays, or more indices than dimensions.
    """
    items = index if isinstance(index, tuple) else (index,)
    if len(items) > len(shape):
        raise IndexError(f"{len(items)} indices for a tensor of {len(shape)} dimensions")
    out, result = [], []
    for d, dim in enumerate(shape):
        item = items[d] if d < len(items) else slice(None)
        if isinstance(item, slice):
            start, stop, step = item.indices(dim)
            if step != 1:  # a block is read, not a strided view: step the block with numpy
                raise IndexError(f"index: slices with step 1 only (dimension {d} has step {step}); "
                                 f"read the block, then step it: get_slice(key, np.s_[a:b])[::{step}]")
            stop = max(stop, start)
            out.append((start, stop))
            result.append(stop - start)
            continue
        try:
            i = operator.index(item)
        except TypeError:
            raise IndexError(f"unsupported index {item!r}; use ints and slices") from None
        if not -dim <= i < dim:
            raise IndexError(f"index {i} is out of bounds for dimension {d} of size {dim}")
        i %= dim
        out.append((i, i + 1))
    return out, tuple(result)


def check_box(info: Any, offset: Sequence[int], shape: Sequence[int], path: str) -> list[tuple[int, int]]:
    """The (start, stop) per dimension of the block ``[offset, offset + shape)`` of a tensor, or
    MismatchError when it does not lie inside the tensor."""
    bounds = [(int(o), int(o) + int(n)) for o, n in zip(offset, shape)]
    if len(offset) != len(info.shape) or len(shape) != len(info.shape) or \
            any(a < 0 or b > d for (a, b), d in zip(bounds, info.shape)):
        raise MismatchError(f"{path}: tensor {info.key!r} is {list(info.shape)}; the block at {list(offset)} of "
                            f"shape {list(shape)} does not lie inside it", path=path, key=info.key)
    return bounds
