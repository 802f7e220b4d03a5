"""Helpers for sharded-checkpoint tests: block layouts, global test tensors, and running one
function per simulated rank (threads) or per MPI process (mpiexec, see mpi_child.py)."""

from __future__ import annotations

import threading
from typing import Any
from collections.abc import Callable

import numpy as np

import ckpt
from ckpt import distributed


def layout(kind: str, shape: tuple[int, ...], rank: int, size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, block shape) of ``rank``'s block of a tensor of ``shape`` split ``kind``-wise:
    "rows", "cols", "uneven" (rows, the first rank taking most, the last rank an empty block
    when there are 3+ ranks), or "grid" (rows x cols over 4 ranks)."""
    if not shape:
        return (), ()
    if kind in ("rows", "cols"):
        axis = 0 if kind == "rows" or len(shape) == 1 else 1
        parts = np.array_split(np.arange(shape[axis]), size)[rank]
        start = int(parts[0]) if len(parts) else shape[axis]
        offset = [0] * len(shape)
        block = list(shape)
        offset[axis], block[axis] = start, len(parts)
        return tuple(offset), tuple(block)
    if kind == "uneven":
        n = shape[0]
        cuts = [0] + [min(n, (n * 3) // 4 + i) for i in range(size - 1)] + [n]
        if size >= 3:
            cuts[-2] = n  # the last rank holds an empty block
        lo, hi = cuts[rank], cuts[rank + 1]
        return (lo,) + (0,) * (len(shape) - 1), (hi - lo,) + tuple(shape[1:])
    raise ValueError(kind)


def global_tensors() -> dict[str, np.ndarray]:
    """The tensors resharding tests save: every dtype (2-d), plus an embedding and a scalar."""
    rng = np.random.default_rng(7)
    out: dict[str, np.ndarray] = {}
    for name in ckpt.dtypes.NAMES:
        dtype = ckpt.dtypes.as_dtype(name)
        if name == "string":
            value = np.array([[b"a" * i + b"\x00" for i in range(j, j + 4)] for j in range(7)], dtype=object)
        elif name == "bool":
            value = rng.random((7, 4)) > 0.5
        elif name.startswith(("int", "uint")):
            value = rng.integers(0, 100, (7, 4)).astype(dtype)
        elif name.startswith("complex"):
            value = (rng.standard_normal((7, 4)) + 1j * rng.standard_normal((7, 4))).astype(dtype)
        else:
            value = rng.standard_normal((7, 4)).astype(dtype)
        out[f"dtypes/{name}"] = value
    out["emb"] = rng.standard_normal((37, 5)).astype(np.float32)
    out["empty"] = np.zeros((0, 3), np.float32)
    return out


def make_variables(tensors: dict[str, np.ndarray], kind: str, rank: int, size: int,
                   zero: bool = False) -> dict[str, ckpt.Variable]:
    """One sharded variable per tensor holding ``rank``'s block (zeros with ``zero``), and a
    replicated scalar "step"."""
    out = {}
    for key, value in tensors.items():
        offset, block = layout(kind, value.shape, rank, size)
        part = value[tuple(slice(o, o + n) for o, n in zip(offset, block))]
        if zero:
            part = np.zeros_like(part) if part.dtype.kind != "O" else np.full(part.shape, b"", dtype=object)
        out[key] = ckpt.Variable(part, name=key.replace("/", "_"), dtype=value.dtype,
                                 shard=ckpt.Shard(value.shape, offset))
    out["step"] = ckpt.Variable(np.int64(0 if zero else 42), name="step")
    return out


def run_ranks(size: int, fn: Callable[[Any], Any]) -> list[Any]:
    """Run ``fn(comm)`` on ``size`` simulated ranks (threads); return each rank's result or
    the exception it raised."""
    comms = distributed.threads(size)
    results: list[Any] = [None] * size

    def run(comm: Any) -> None:
        try:
            results[comm.rank] = fn(comm)
        except BaseException as exc:
            results[comm.rank] = exc

    workers = [threading.Thread(target=run, args=(c,)) for c in comms]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    return results
