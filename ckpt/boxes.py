"""Geometry of blocks of n-d tensors: intersections, exact tilings, and the byte runs of a sub-block.

A block is ``(offset, shape)``: the elements ``[offset, offset + shape)`` of a global tensor.
Sharded saves check that the blocks of a key tile its global shape; restores intersect the
blocks a process wants with the blocks that were saved, and read the byte runs of each
intersection inside a saved block (C order).

Example:
    >>> from ckpt import boxes
    >>> boxes.intersect((0, 0), (4, 6), (2, 3), (4, 4))
    ((2, 3), (2, 3))
    >>> boxes.tiling_problem((4,), [((0,), (2,), "rank 0"), ((2,), (2,), "rank 1")]) is None
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["Block", "volume", "intersect", "tiling_problem", "tiling_problem_arrays", "byte_runs", "touched_ranges"]

Block = tuple[tuple[int, ...], tuple[int, ...]]
_MAX_CELLS = 1 << 22  # beyond this many grid cells, overlap is checked pairwise


def volume(shape: Sequence[int]) -> int:
    """Number of elements of ``shape`` (1 for a scalar)."""
    n = 1
    for d in shape:
        n *= d
    return n


def intersect(a_off: Sequence[int], a_shape: Sequence[int], b_off: Sequence[int],
              b_shape: Sequence[int]) -> Block | None:
    """The common part of two blocks, or None when they share no element."""
    off, shape = [], []
    for ao, an, bo, bn in zip(a_off, a_shape, b_off, b_shape):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        off.append(lo)
        shape.append(hi - lo)
    return tuple(off), tuple(shape)


def _fmt(offset: Sequence[int], shape: Sequence[int]) -> str:
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(offset, shape)) + "]"


def tiling_problem(global_shape: Sequence[int], blocks: Sequence[tuple[Sequence[int], Sequence[int], str]],
                   ) -> str | None:
    """Why ``blocks`` (offset, shape, owner) do not tile ``global_shape`` exactly, or None.

    Empty blocks cover nothing and are allowed anywhere inside the bounds.
    """
    ndim = len(global_shape)
    full = []
    for offset, shape, owner in blocks:
        if len(offset) != ndim or len(shape) != ndim:
            return f"{owner}'s block has {len(shape)} axes, the global shape {tuple(global_shape)} has {ndim}"
        if any(o < 0 or o + n > g for o, n, g in zip(offset, shape, global_shape)):
            return f"{owner}'s block {_fmt(offset, shape)} lies outside the global shape {tuple(global_shape)}"
        if volume(shape):
            full.append((tuple(offset), tuple(shape), owner))
    total = volume(global_shape)
    covered = sum(volume(s) for _, s, _ in full)
    if ndim == 0:
        return None if len(full) == 1 else (
            "no block holds it" if not full else f"{full[0][2]} and {full[1][2]} both hold it")
    cuts = [sorted({0, g, *(o[a] for o, _, _ in full), *(o[a] + s[a] for o, s, _ in full)})
            for a, g in enumerate(global_shape)]
    cells = volume([len(c) - 1 for c in cuts])
    if total and cells <= _MAX_CELLS:
        count = np.zeros([len(c) - 1 for c in cuts], np.int32)
        index = [{v: i for i, v in enumerate(c)} for c in cuts]
        where = []
        for offset, shape, _ in full:
            box = tuple(slice(index[a][o], index[a][o + n]) for a, (o, n) in enumerate(zip(offset, shape)))
            count[box] += 1
            where.append(box)
        if (count == 1).all():
            return None
        over = np.argwhere(count > 1)
        if len(over):
            cell = tuple(over[0])
            owners = [owner for (_, _, owner), box in zip(full, where)
                      if all(b.start <= c < b.stop for b, c in zip(box, cell))]
            point = tuple(int(cuts[a][c]) for a, c in enumerate(cell))
            return f"the blocks of {' and '.join(owners[:2])} overlap (both hold element {point})"
        cell = tuple(np.argwhere(count == 0)[0])
        point = tuple(int(cuts[a][c]) for a, c in enumerate(cell))
        return f"element {point} is in no block (the blocks leave a gap)"
    for i, (ao, an, aw) in enumerate(full):  # huge irregular grids: pairwise, rare
        for bo, bn, bw in full[i + 1:]:
            both = intersect(ao, an, bo, bn)
            if both is not None:
                return f"the blocks of {aw} and {bw} overlap (both hold element {both[0]})"
    if covered != total:
        return f"the blocks hold {covered} of the {total} elements (they leave a gap)"
    return None


def byte_runs(block_shape: Sequence[int], itemsize: int, start: Sequence[int],
              shape: Sequence[int]) -> tuple[np.ndarray, int]:
    """Byte offsets of the contiguous runs holding sub-block ``[start, start + shape)`` of a
    C-ordered block, and the length in bytes of each run.

    Example:
        >>> starts, n = byte_runs((4, 6), 4, (1, 2), (2, 3))
        >>> starts.tolist(), n
        ([32, 56], 12)
    """
    ndim = len(block_shape)
    k = ndim  # axes k.. are covered whole: they merge into one run
    while k > 0 and start[k - 1] == 0 and shape[k - 1] == block_shape[k - 1]:
        k -= 1
    strides = [itemsize] * ndim
    for a in range(ndim - 2, -1, -1):
        strides[a] = strides[a + 1] * block_shape[a + 1]
    if k == 0:
        return np.zeros(1, np.int64), volume(shape) * itemsize
    run = shape[k - 1] * strides[k - 1]
    starts = np.zeros((), np.int64) + start[k - 1] * strides[k - 1]
    for a in range(k - 1):
        starts = np.add.outer(starts, np.arange(start[a], start[a] + shape[a], dtype=np.int64) * strides[a])
    return starts.reshape(-1) if starts.ndim else starts.reshape(1), run


def touched_ranges(starts: np.ndarray, run: int, block_bytes: int, total: int) -> list[tuple[int, int]]:
    """The byte ranges ``[lo, hi)`` of whole checksum blocks that runs ``(starts, run)`` touch,
    consecutive blocks merged; ``total`` is the tensor's size in bytes.

    Example:
        >>> touched_ranges(np.array([10, 5000]), 100, 1024, 8192)
        [(0, 1024), (4096, 5120)]
    """
    if run == 0 or len(starts) == 0:
        return []
    nblocks = -(-total // block_bytes)
    first = starts // block_bytes
    last = (starts + run - 1) // block_bytes
    mark = np.zeros(nblocks + 1, np.int64)
    np.add.at(mark, first, 1)
    np.add.at(mark, last + 1, -1)
    touched = np.cumsum(mark[:-1]) > 0
    edges = np.flatnonzero(np.diff(np.concatenate(([False], touched, [False])).astype(np.int8)))
    return [(int(lo) * block_bytes, min(int(hi) * block_bytes, total)) for lo, hi in zip(edges[::2], edges[1::2])]


def tiling_problem_arrays(global_shape: Sequence[int], offsets: np.ndarray, shapes: np.ndarray,
                          owners: Sequence[str]) -> str | None:
    """``tiling_problem`` for blocks given as (B, ndim) int arrays; the common layouts (blocks
    split along one axis) are checked with a sort, the rest by ``tiling_problem``.

    Example:
        >>> print(tiling_problem_arrays((6, 2), np.array([[3, 0], [0, 0]]), np.array([[3, 2], [3, 2]]), ["a", "b"]))
        None
    """
    g = np.asarray(global_shape, np.int64)
    ndim = len(g)
    if offsets.shape != (len(owners), ndim) or shapes.shape != offsets.shape:
        return "malformed block offsets or shapes"
    if ndim and len(owners) and (offsets.min() < 0 or shapes.min() < 0 or ((offsets + shapes) > g).any()):
        return tiling_problem(global_shape, list(zip(offsets.tolist(), shapes.tolist(), owners)))
    keep = shapes.prod(axis=1) > 0 if ndim else np.ones(len(owners), bool)
    o, s = offsets[keep], shapes[keep]
    if ndim and len(o) and 0 not in global_shape:
        split = np.flatnonzero(~((o == 0) & (s == g)).all(axis=0))
        if len(split) == 0 and len(o) == 1:
            return None
        if len(split) == 1:
            a = int(split[0])
            order = np.argsort(o[:, a], kind="stable")
            start, end = o[order, a], o[order, a] + s[order, a]
            if start[0] == 0 and end[-1] == g[a] and (start[1:] == end[:-1]).all():
                return None
    return tiling_problem(global_shape, list(zip(offsets.tolist(), shapes.tolist(), owners)))
