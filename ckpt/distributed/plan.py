"""Planning a sharded save: what each rank holds, checking that the ranks agree, who writes what.

Every rank sends a small plan: its path and step, a *static* part that must be the same on
every rank (per key, sorted: key, dtype, global shape, sharded or replicated) as one byte
string, and its blocks' offsets and shapes as int64 arrays in the same key order. Rank 0
compares the static parts as bytes (one comparison per rank, whatever the number of keys),
then checks the blocks of every key with array operations; only when something is wrong
does it look key by key, to name the keys and ranks. Replicated tensors are written once,
each by one rank, spread so every rank writes about as many bytes: so every rank also sends
the crc32c of each replicated tensor it holds (4 bytes a key, in the same message), and rank 0
refuses a save whose ranks hold different values under one replicated key.

Example:
    >>> from ckpt.distributed import plan
    >>> a = plan.local_plan("m", 1, None, [("w", "float32", (4,), (0,), (2,))])
    >>> b = plan.local_plan("m", 1, None, [("w", "float32", (4,), (2,), (2,))])
    >>> plan.problems([a, b]) is None
    True
    >>> b = plan.local_plan("m", 1, None, [("w", "float32", (4,), (1,), (2,))])
    >>> print(plan.problems([a, b]))
    w: the blocks of rank 0 and rank 1 overlap (both hold element (1,))
    >>> c = plan.local_plan("m", 1, None, [("b", "float32", (2,), None, (2,))], {"b": 7})
    >>> d = plan.local_plan("m", 1, None, [("b", "float32", (2,), None, (2,))], {"b": 9})
    >>> print(plan.problems([c, c, d]).splitlines()[0])
    b: replicated (no Shard), but the ranks hold different values: crc32c 00000007 on ranks 0, 1; 00000009 on rank 2
"""

from __future__ import annotations

from typing import Any
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from .. import boxes, dtypes
from ..formats import _io  # the crc32c every format uses
from .comm import decode, encode

__all__ = ["local_plan", "Layout", "problems", "layout", "replicated_writers", "digest"]

_SHOWN = 5  # problems listed in one error before "... and more"


def local_plan(path: str, step: int | None, error: str | None,
               specs: Sequence[tuple[str, str, Sequence[int], Sequence[int] | None, Sequence[int]]],
               digests: Mapping[str, int] | None = None) -> dict[str, Any]:
    """A rank's plan message from ``(key, dtype name, global shape, offset or None, block shape)``
    and the ``digest`` of each replicated (offset None) key's value (0 where not given)."""
    ordered = sorted(specs, key=lambda s: s[0])
    static = encode([[k, d, list(g), o is not None] for k, d, g, o, _ in ordered])
    offsets = [v for _, _, g, o, _ in ordered for v in (o if o is not None else [0] * len(g))]
    shapes = [v for _, _, _, _, s in ordered for v in s]
    replicas = [(digests or {}).get(k, 0) for k, _, _, o, _ in ordered if o is None]
    return {"path": path, "step": step, "error": error, "static": static,
            "offsets": np.asarray(offsets, "<i8").tobytes(), "shapes": np.asarray(shapes, "<i8").tobytes(),
            "digests": np.asarray(replicas, "<u4").tobytes()}


def digest(value: np.ndarray) -> int:
    """The crc32c of a tensor's bytes (of its elements, msgpack-encoded, for byte strings): what
    the ranks compare for each replicated tensor. One pass over memory (several GB/s)."""
    if dtypes.is_string(value.dtype):
        return int(_io.crc32c(encode([bytes(x) for x in value.reshape(-1)])))
    arr = _io.c_contiguous(value)
    if arr.dtype.byteorder == ">":  # one byte order on every rank, whatever each one's buffer uses
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return int(_io.crc32c(_io.byte_view(arr)))


def _ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class Layout:
    """The agreed plan: per key (sorted) its static entry, and every rank's blocks.

    Attributes:
        keys: ``[key, dtype, global shape, sharded]`` per key.
        offsets, shapes: (ranks, total axes) int64 arrays; key i's axes are ``columns[i]``.
    """

    def __init__(self, plans: Sequence[dict[str, Any]]) -> None:
        self.keys: list[list[Any]] = decode(plans[0]["static"], "plan")
        self.offsets = np.stack([np.frombuffer(p["offsets"], "<i8") for p in plans])
        self.shapes = np.stack([np.frombuffer(p["shapes"], "<i8") for p in plans])
        self.columns: list[slice] = []
        at = 0
        for spec in self.keys:
            self.columns.append(slice(at, at + len(spec[2])))
            at += len(spec[2])


def layout(plans: Sequence[dict[str, Any]]) -> Layout:
    """The Layout of plans that ``problems`` accepted."""
    return Layout(plans)


def problems(plans: Sequence[dict[str, Any]]) -> str | None:
    """Everything the ranks disagree on, one line each (None when they agree)."""
    out = [f"rank {r}: {p['error']}" for r, p in enumerate(plans) if p.get("error")]
    for field in ("path", "step"):
        values: dict[Any, list[int]] = {}
        for r, p in enumerate(plans):
            values.setdefault(p[field], []).append(r)
        if len(values) > 1:
            out.append(f"the ranks save with different {field}s: " +
                       "; ".join(f"{v!r} on {_ranks(rs)}" for v, rs in values.items()))
    if out:
        return "\n".join(out)
    if any(p["static"] != plans[0]["static"] for p in plans):
        return _static_problems(plans)
    lay = Layout(plans)
    return _block_problems(lay) or _value_problems(lay, plans)


def _static_problems(plans: Sequence[dict[str, Any]]) -> str:
    """Name the keys whose dtype, global shape or sharding differs between ranks."""
    by_key: dict[str, list[tuple[int, list[Any]]]] = {}
    for r, p in enumerate(plans):
        for spec in decode(p["static"], "plan"):
            by_key.setdefault(spec[0], []).append((r, spec))
    size, out = len(plans), []
    for key, held in by_key.items():
        if len(held) != size:
            have = {r for r, _ in held}
            out.append(f"{key}: only on {_ranks(have)}, not on {_ranks([r for r in range(size) if r not in have])} "
                       "(every rank saves the same keys)")
            continue
        for field, what in ((1, "dtype"), (2, "global shape"), (3, "sharding")):
            values: dict[str, list[int]] = {}
            for r, spec in held:
                shown = str(tuple(spec[2])) if field == 2 else str(spec[field])
                if field == 3:
                    shown = "a block of a sharded tensor" if spec[3] else "replicated (no Shard)"
                values.setdefault(shown, []).append(r)
            if len(values) > 1:
                if field == 3:
                    out.append(f"{key}: " + ", ".join(f"{v} on {_ranks(rs)}" for v, rs in values.items()))
                else:
                    out.append(f"{key}: the ranks hold different {what}s: " +
                               "; ".join(f"{v} on {_ranks(rs)}" for v, rs in values.items()))
                break
        if len(out) > _SHOWN:
            break
    return _join(out) or "the ranks' plans differ"


def _block_problems(lay: Layout) -> str | None:
    """Check every key's blocks: replicated ones whole, sharded ones tiling the global shape."""
    out: list[str] = []
    cache: dict[bytes, str | None] = {}  # layers of one shape share a layout: check it once
    owners = [f"rank {r}" for r in range(len(lay.offsets))]
    for spec, cols in zip(lay.keys, lay.columns):
        key, _, gshape, is_sharded = spec
        shapes = lay.shapes[:, cols]
        if not is_sharded:
            if (shapes != np.asarray(gshape, np.int64)).any():
                out.append(f"{key}: replicated, but its shape differs from rank to rank")
        else:
            offsets = lay.offsets[:, cols]
            signature = np.asarray(gshape, np.int64).tobytes() + offsets.tobytes() + shapes.tobytes()
            if signature not in cache:
                cache[signature] = boxes.tiling_problem_arrays(gshape, offsets, shapes, owners)
            if cache[signature]:
                out.append(f"{key}: {cache[signature]}")
        if len(out) > _SHOWN:
            break
    return _join(out) or None


def _value_problems(lay: Layout, plans: Sequence[dict[str, Any]]) -> str | None:
    """Name the replicated keys whose value (its digest) differs between ranks, and the ranks."""
    held = np.stack([np.frombuffer(p["digests"], "<u4") for p in plans])  # (ranks, replicated keys)
    differ = np.flatnonzero((held != held[0]).any(axis=0))
    if not len(differ):
        return None
    keys = [spec[0] for spec in lay.keys if not spec[3]]
    out = []
    for column in differ[:_SHOWN + 1].tolist():
        values: dict[int, list[int]] = {}
        for r, value in enumerate(held[:, column].tolist()):
            values.setdefault(value, []).append(r)
        out.append(f"{keys[column]}: replicated (no Shard), but the ranks hold different values: crc32c " +
                   "; ".join(f"{v:08x} on {_ranks(rs)}" for v, rs in values.items()))
    return _join(out) + ("\n(a variable without a Shard is written by one rank for all: make the ranks agree "
                         "before saving, or give a per-rank value a Shard of a tensor with one row per rank)")


def _join(lines: list[str]) -> str:
    return "\n".join(lines[:_SHOWN]) + ("\n... and more" if len(lines) > _SHOWN else "")


def _itemsize(name: str) -> int:
    return dtypes.as_dtype(name).itemsize or 8  # strings: a guess is enough for balancing


def replicated_writers(lay: Layout) -> dict[str, int]:
    """Pick one rank to write each replicated key: the largest first, each to the rank with the
    fewest bytes so far (sharded blocks counted); ties go to the lowest rank. Every rank
    computes the same answer from the same (agreed) plans.

    Example:
        >>> a = local_plan("m", 1, None, [("a", "float32", (4,), None, (4,)), ("b", "float32", (2,), None, (2,))])
        >>> replicated_writers(Layout([a, a]))
        {'a': 0, 'b': 1}
    """
    size = len(lay.shapes)
    loads = np.zeros(size, np.int64)
    sized = []
    for spec, cols in zip(lay.keys, lay.columns):
        if spec[3]:
            loads += lay.shapes[:, cols].prod(axis=1) * _itemsize(spec[1])
        else:
            sized.append((-boxes.volume(spec[2]) * _itemsize(spec[1]), spec[0]))
    out = {}
    for negative, key in sorted(sized):
        rank = int(np.argmin(loads))  # the first of the least loaded
        out[key] = rank
        loads[rank] -= negative
    return out
