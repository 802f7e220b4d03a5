"""How two tensors' values differ (``ValueDiff``): the element arithmetic ``compare`` runs.

A pair of same-shape tensors streams through in matching chunks (each checked against its
checksum), each chunk compared in pieces of ``CHUNK`` elements on two threads; two local raw
tensors of one dtype are read piece by piece instead, each piece of both files by the thread that
compares it, while it is in that core's cache (``ckpt.tools.fused``), with the same bits. NaNs in
the same place are equal. With ``atol``/``rtol``, an element is close when
``|a - b| <= atol + rtol * |b|`` (numpy's isclose, B as the reference).

Example:
    >>> import numpy as np
    >>> compare_values(np.array([1.0, 2.0]), np.array([1.0, 2.5]))
    ValueDiff(count=2, unequal=1, outside=1, max_abs=0.5, max_rel=0.2, rel_l2=0.2236...)
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np

from ckpt import dtypes
from ckpt.saving.reader import CheckpointReader
from ckpt.tools.chunks import OneThread, chunk_elements, paired_chunks
from ckpt.tools.fused import local_layout, piece_bounds, work_paired_pieces
from ckpt.tools.jsonview import jsonable

__all__ = ["CHUNK", "ValueDiff", "compare_values", "tensor_values"]


CHUNK = 1 << 18
DOT = 8192  # elements of one BLAS dot product (OpenBLAS threads only longer ones)
_second = OneThread("ckpt-compare")  # takes half of each chunk's pieces (numpy and BLAS release the GIL)


@dataclass(frozen=True)
class ValueDiff:
    """How two same-shape tensors differ: elements compared, not exactly equal, outside the
    tolerance, the largest absolute and relative differences, and the relative L2 change
    ``||a - b|| / ||a||`` (None for strings).

    ``max_rel`` is ``|a - b| / |b|`` (rtol's measure, B the reference), so a value that moved
    off or onto zero makes it large or infinite; ``rel_l2`` says how far a tensor moved as a
    whole (0 when equal, infinite when A is all zeros and B is not; NaN when both norms pass
    float64's range). Equal NaNs count as equal (a difference of 0), a NaN against a number as
    an infinite difference; ``||a||`` sums A's finite values.
    """

    count: int
    unequal: int
    outside: int
    max_abs: float | None
    max_rel: float | None
    rel_l2: float | None

    def to_json(self) -> dict[str, Any]:
        """The JSON view (an infinite difference as the string "Infinity")."""
        return {k: jsonable(v) for k, v in asdict(self).items()}


_Buffers = dict[tuple[str, str], np.ndarray]  # scratch buffers by name and dtype


class _Tally:
    """A ValueDiff built chunk by chunk, with the scratch buffers its pieces reuse."""

    def __init__(self, scratch: tuple[_Buffers, _Buffers] | None = None) -> None:
        self.count = self.unequal = self.outside = 0
        self.max_abs: float | None = 0.0
        self.max_rel: float | None = 0.0
        self.sum_d2 = self.sum_a2 = 0.0  # sums of |a - b|^2 and of |a|^2 (finite a), float64
        self.piece = -1  # the piece being added, where two threads share a chunk's pieces out
        self.parts: list[tuple[int, float, float]] = []  # then each piece's sums, added in order later
        self.strings = False
        self.seen_unequal_bytes = False
        self._buffers = scratch if scratch is not None else ({}, {})  # this thread's, the second thread's
        self._scratch = self._buffers[0]
        self._helper: _Tally | None = None  # what the second thread adds up (its own buffers)

    def add_sums(self, a2: float, d2: float = 0.0) -> None:
        """Add a piece's sums of |a|^2 and |a - b|^2 (recorded, while pieces are shared out)."""
        if self.piece < 0:
            self.sum_a2 += a2
            self.sum_d2 += d2
        else:
            self.parts.append((self.piece, a2, d2))

    def helper(self) -> _Tally:
        """The tally the second thread fills, merged into this one's result."""
        if self._helper is None:
            self._helper = _Tally((self._buffers[1], {}))
        return self._helper

    def next(self) -> _Tally:
        """A new tally (the next tensor's) that reuses this one's buffers: a tensor's worth of fresh
        scratch memory costs more page faults than its comparison saves."""
        return _Tally(self._buffers)

    def scratch(self, name: str, dtype: np.dtype[Any], n: int) -> np.ndarray:
        """A reused buffer of ``n`` elements (fresh memory costs a page fault per 4 KiB)."""
        buffer = self._scratch.get((name, dtype.str))
        if buffer is None or buffer.size < n:
            buffer = self._scratch[(name, dtype.str)] = np.empty(max(n, CHUNK), dtype)
        return buffer[:n]

    def result(self) -> ValueDiff:
        if self._helper is not None:  # merged in a fixed order: the sums do not depend on timing
            other, self._helper = self._helper, None
            self.unequal += other.unequal
            self.outside += other.outside
            self.max_abs = max(self.max_abs or 0.0, other.max_abs or 0.0)
            self.max_rel = max(self.max_rel or 0.0, other.max_rel or 0.0)
            self.sum_d2 += other.sum_d2
            self.sum_a2 += other.sum_a2
        if self.strings:
            return ValueDiff(self.count, self.unequal, self.outside, None, None, None)
        if self.sum_d2 == 0:
            rel_l2 = 0.0
        else:
            rel_l2 = math.inf if self.sum_a2 == 0 else math.sqrt(self.sum_d2) / math.sqrt(self.sum_a2)
        return ValueDiff(self.count, self.unequal, self.outside, self.max_abs, self.max_rel, rel_l2)


def _words(flat: np.ndarray) -> np.ndarray:
    """A flat array's bytes as 8-byte words where they divide evenly (fewer, wider comparisons)."""
    raw = flat.view(np.uint8)
    return raw.view(np.uint64) if raw.size % 8 == 0 else raw


def _as_number(raw: np.ndarray) -> np.ndarray:
    return raw.astype(np.complex128 if raw.dtype.kind == "c" else np.float64)


def _dot(x: np.ndarray) -> float:
    """x · x in float64 (x float64): BLAS dot products of DOT elements, one ``vecdot`` call for the
    whole rows, added up in order (OpenBLAS spreads longer ones over threads, whose hand-offs cost
    more than the sum on a busy machine)."""
    tail = x.size % DOT
    rows = (x[:-tail] if tail else x).reshape(-1, DOT)
    parts: list[float] = np.vecdot(rows, rows).tolist()
    if tail:
        parts.append(float(np.dot(x[-tail:], x[-tail:])))
    return sum(parts, 0.0)


def _sum_squares(x: np.ndarray) -> float:
    """The sum of squares of a float64 array's finite values."""
    total = _dot(x)
    if math.isfinite(total):
        return total
    finite = x[np.isfinite(x)]  # an Inf or NaN, or an overflow (which stays infinite)
    return _dot(finite)


def _norm_squared(piece: np.ndarray) -> float:
    """The sum of |a|^2 over a piece's finite values, in float64."""
    x = _as_number(piece)
    return _sum_squares(np.abs(x) if x.dtype.kind == "c" else x)


def _fast_dtype(a: np.dtype[Any], b: np.dtype[Any]) -> bool:
    """Whether chunks of these dtypes take the fast path (one builtin float dtype)."""
    return a == b and a.kind == "f" and a.isbuiltin == 1 and a.itemsize <= 8


def _add_exact(tally: _Tally, pa: np.ndarray, pb: np.ndarray, atol: float, rtol: float) -> None:
    """One piece in float64 (or complex128), NaNs and Infs included."""
    xa, xb = _as_number(pa), _as_number(pb)
    both_nan = np.isnan(xa) & np.isnan(xb)
    neq = ((pa != pb) if pa.dtype == pb.dtype else (xa != xb)) & ~both_nan
    d = np.where(neq, np.abs(xa - xb), 0.0)
    d[np.isnan(d)] = np.inf  # NaN against a number (or inf - inf of opposite signs)
    ref = np.abs(xb)
    rel = np.where(d == 0, 0.0, d / ref)
    rel[np.isnan(rel)] = np.inf
    close = ~neq | (np.isfinite(d) & (d <= atol + rtol * ref))
    tally.unequal += int(np.count_nonzero(neq))
    tally.outside += int(np.count_nonzero(~close))
    if d.size:
        tally.max_abs = max(tally.max_abs or 0.0, float(d.max()))
        tally.max_rel = max(tally.max_rel or 0.0, float(rel.max()))
        # |a - b|^2 infinite where a NaN met a number
        tally.add_sums(_sum_squares(np.abs(xa) if xa.dtype.kind == "c" else xa), _dot(d))


class _Work:
    """One thread's buffers for the pieces of one pair of chunks, fetched once (not per piece)."""

    __slots__ = ("a", "absb", "b", "d", "flags", "q", "size")

    def __init__(self, tally: _Tally, size: int, dtype: np.dtype[Any]) -> None:
        f64 = np.dtype(np.float64)
        self.size = size
        self.a, self.b, self.d, self.q = (tally.scratch(name, f64, size) for name in ("a", "b", "d", "ref"))
        self.flags = tally.scratch("flags", np.dtype(np.bool_), size)
        self.absb = tally.scratch("absb", dtype, size)  # |b| in B's dtype (exact)

    def cut(self, buffer: np.ndarray, n: int) -> np.ndarray:
        return buffer if n == self.size else buffer[:n]


def _add_fast(tally: _Tally, work: _Work, pa: np.ndarray, pb: np.ndarray, atol: float, rtol: float) -> bool:
    """One piece of two same-dtype float chunks with no NaN or Inf: _add_exact's float64
    arithmetic in a few passes over reused buffers instead of its dozen over fresh ones. False,
    doing nothing, where the piece holds a NaN or Inf (or an overflowing difference): the caller
    takes the exact path."""
    n = pa.size
    xa, xb = pa, pb
    if pa.dtype != np.float64:  # float16 or float32 -> float64: exact
        xa, xb = work.cut(work.a, n), work.cut(work.b, n)
        np.copyto(xa, pa)
        np.copyto(xb, pb)
    d = work.cut(work.d, n)
    np.subtract(xa, xb, out=d)  # signed: max |d| is max(max d, -min d), and squares drop the sign
    hi, lo = float(np.maximum.reduce(d)), float(np.minimum.reduce(d))  # NaN where a NaN or Inf is in a piece
    if not (math.isfinite(hi) and math.isfinite(lo)):
        return False
    a2 = _dot(xa)
    top = max(hi, -lo)
    if top == 0:
        tally.add_sums(a2)
        return True
    flags = work.cut(work.flags, n)
    unequal = int(np.count_nonzero(np.not_equal(d, 0, out=flags)))  # d == 0 exactly where a == b
    tally.unequal += unequal
    tally.add_sums(a2, _dot(d))
    tally.max_abs = max(tally.max_abs or 0.0, top)
    if atol or rtol:
        ref = work.cut(work.q, n)
        np.abs(xb, out=ref)
        bound = tally.scratch("bound", np.dtype(np.float64), n)
        np.multiply(ref, rtol, out=bound)
        bound += atol
        np.abs(d, out=d)
        tally.outside += int(np.count_nonzero(np.greater(d, bound, out=flags)))
        np.divide(d, ref, out=ref)  # 0 / 0 = NaN where both are zero (a difference of 0): fmax skips it
        tally.max_rel = max(tally.max_rel or 0.0, float(np.fmax.reduce(ref)))
        return True
    tally.outside += unequal
    if not _rel_bounded(tally, top, pb, work.cut(work.absb, n)):
        q = work.cut(work.q, n)
        np.divide(d, xb, out=q)  # |d / b| = |d| / |b|; 0 / 0 = NaN (a difference of 0): fmax skips it
        tally.max_rel = max(tally.max_rel or 0.0, float(np.fmax.reduce(q)), -float(np.fmin.reduce(q)))
    return True


def _rel_bounded(tally: _Tally, top: float, pb: np.ndarray, scratch: np.ndarray) -> bool:
    """Whether no |a - b| / |b| of a piece can pass the largest so far: each is at most
    max |a - b| / min |b| (rounding keeps the order), a cheaper pass than the division."""
    if not tally.max_rel:  # nothing to beat yet
        return False
    if tally.max_rel == math.inf:  # a value moved off zero: nothing can beat it (and min |b| may be 0)
        return True
    smallest = float(np.minimum.reduce(np.abs(pb, out=scratch)))
    return smallest > 0 and top / smallest <= tally.max_rel


def _add_chunk(tally: _Tally, ra: np.ndarray, rb: np.ndarray, atol: float, rtol: float, step: int = CHUNK) -> None:
    """Compare two flat chunks of one length into ``tally``, in pieces of ``step`` elements."""
    tally.count += ra.size
    if dtypes.is_string(ra.dtype) or dtypes.is_string(rb.dtype):
        n = int(np.count_nonzero(ra != rb))
        tally.unequal += n
        tally.outside += n
        tally.strings = True
        return
    fast = _fast_dtype(ra.dtype, rb.dtype)
    if not tally.seen_unequal_bytes and ra.dtype == rb.dtype and ra.dtype.kind in "biufc" and \
            ra.dtype.isbuiltin == 1 and ra.size:
        # bit-identical bytes are equal values (NaNs included): one comparison, and A's norm. Once a
        # tensor's chunk differs its later ones are likely to (a training step moves every value)
        if np.array_equal(_words(ra), _words(rb)):
            with np.errstate(over="ignore", invalid="ignore"):  # squares past float64's range: an inf norm
                for i in range(0, ra.size, step):
                    tally.sum_a2 += _norm_squared(ra[i:i + step])
            return
        tally.seen_unequal_bytes = True
    starts = range(0, ra.size, step)
    if len(starts) < 4:
        _add_pieces(tally, ra, rb, starts, iter(range(len(starts))), step, fast, atol, rtol, False)
        return
    # both threads take the next piece until none is left (neither waits for the other's fixed share
    # when the I/O threads hold up one of them)
    order, helper = iter(range(len(starts))), tally.helper()
    job = _second.get().submit(_add_pieces, helper, ra, rb, starts, order, step, fast, atol, rtol, True)
    try:
        _add_pieces(tally, ra, rb, starts, order, step, fast, atol, rtol, True)
    finally:
        job.result()  # the chunks are reused buffers: the second thread must be done with them
    # the sums as if each thread had taken a fixed half, in order: the same bits whatever the timing
    half = len(starts) // 2
    for k, a2, d2 in sorted(tally.parts + helper.parts):
        into = tally if k < half else helper
        into.sum_a2 += a2
        into.sum_d2 += d2
    tally.parts.clear()
    helper.parts.clear()


def _add_pieces(tally: _Tally, ra: np.ndarray, rb: np.ndarray, starts: range, order: Iterator[int], step: int,
                fast: bool, atol: float, rtol: float, record: bool) -> None:
    """The pieces of two chunks that begin at ``starts[k]`` for each ``k`` this thread takes from
    ``order``, into ``tally`` (on either thread); ``record``: each piece's sums kept apart."""
    work = _Work(tally, min(step, ra.size), ra.dtype) if fast else None
    with np.errstate(invalid="ignore", divide="ignore", over="ignore", under="ignore"):  # per thread
        for k in order:
            if record:
                tally.piece = k
            i = starts[k]
            pa, pb = ra[i:i + step], rb[i:i + step]
            if work is None or not _add_fast(tally, work, pa, pb, atol, rtol):
                _add_exact(tally, pa, pb, atol, rtol)
    tally.piece = -1


def compare_values(a: np.ndarray, b: np.ndarray, atol: float = 0.0, rtol: float = 0.0, *,
                   step: int = CHUNK) -> ValueDiff:
    """Compare two in-memory tensors of one shape element by element (B is the reference for rtol),
    ``step`` elements at a time (bounding the temporaries).

    Example:
        >>> import numpy as np
        >>> compare_values(np.array([1.0, 2.0, np.nan]), np.array([1.0, 2.5, np.nan]), atol=0.1)
        ValueDiff(count=3, unequal=1, outside=1, max_abs=0.5, max_rel=0.2, rel_l2=0.2236...)
    """
    if a.shape != b.shape:
        raise ValueError(f"cannot compare values of shapes {list(a.shape)} and {list(b.shape)}")
    tally = _Tally()
    _add_chunk(tally, a.reshape(-1), b.reshape(-1), atol, rtol, step)
    return tally.result()



def tensor_values(ra: CheckpointReader, rb: CheckpointReader, key: str, atol: float, rtol: float,
                  tally: _Tally, chunk_bytes: int | None = None) -> ValueDiff:
    """Compare one pair of same-shape tensors of two open checkpoints into a new ``tally``: piece by
    piece where both are local raw tensors of one dtype, else streaming through in matching chunks."""
    found = _fused_values(ra, rb, key, atol, rtol, tally, chunk_bytes)
    if found is not None:
        return found
    for ca, cb in paired_chunks(ra, rb, key, chunk_bytes=chunk_bytes):
        _add_chunk(tally, ca, cb, atol, rtol)
    return tally.result()


class _Part(NamedTuple):
    """One piece's share of a ValueDiff; ``equal``: its bytes were the same (None: not looked at)."""

    equal: bool | None
    unequal: int
    outside: int
    max_abs: float
    max_rel: float
    a2: float
    d2: float


class _Pieces:
    """The pieces of one tensor pair (``fused.piece_bounds``) and what the chunked path does with
    each: the chunk it is in, its place there, and how many pieces that chunk has."""

    def __init__(self, count: int, chunk: int) -> None:
        self.bounds = piece_bounds(count, chunk, CHUNK)
        self.chunk_of: list[int] = []
        self.place: list[tuple[int, int]] = []  # (k, pieces of the chunk)
        first = count % chunk or chunk
        for c, start in enumerate([0, *range(first, count, chunk)] if count else []):
            n = -(-(min(start + (chunk if c else first), count) - start) // CHUNK)
            self.chunk_of += [c] * n
            self.place += [(k, n) for k in range(n)]


class _Merge:
    """Pieces' parts added up in piece order exactly as ``_add_chunk`` adds its chunks' sums: a chunk
    whose bytes (and every earlier chunk's) are the same adds A's norms in order; any other adds a
    fixed first half of its pieces (all of them, under 4) into one sum and the rest into another."""

    def __init__(self, pieces: _Pieces, checked: bool) -> None:
        self.pieces, self.equal_so_far = pieces, checked
        self.held: list[_Part] = []  # the current chunk's parts, until its last
        self.unequal = self.outside = 0
        self.max_abs = self.max_rel = 0.0
        self.sums = [0.0, 0.0, 0.0, 0.0]  # a2 and d2 of the first halves, then of the second halves
        self.done = 0

    def __call__(self, part: _Part) -> None:
        self.unequal += part.unequal
        self.outside += part.outside
        self.max_abs, self.max_rel = max(self.max_abs, part.max_abs), max(self.max_rel, part.max_rel)
        self.held.append(part)
        self.equal_so_far = self.equal_so_far and bool(part.equal)
        k, n = self.pieces.place[self.done]
        self.done += 1
        if k + 1 < n:
            return
        for j, p in enumerate(self.held):
            if self.equal_so_far:
                self.sums[0] += p.a2
                continue
            into = 2 if n >= 4 and j >= n // 2 else 0
            self.sums[into] += p.a2
            self.sums[into + 1] += p.d2
        self.held.clear()

    def into(self, tally: _Tally, count: int) -> ValueDiff:
        tally.count, tally.unequal, tally.outside = count, self.unequal, self.outside
        tally.max_abs, tally.max_rel = self.max_abs, self.max_rel
        tally.sum_a2, tally.sum_d2 = self.sums[0] + self.sums[2], self.sums[1] + self.sums[3]
        return tally.result()


def _fused_values(ra: CheckpointReader, rb: CheckpointReader, key: str, atol: float, rtol: float,
                  tally: _Tally, chunk_bytes: int | None) -> ValueDiff | None:
    """The ValueDiff of two local raw tensors of one dtype, each piece of both read by the thread
    that compares it (``ckpt.tools.fused``): the same pieces, passes and bits as the chunked path.
    None where either is not a local raw tensor, or the dtypes differ."""
    la, lb = local_layout(ra, key), local_layout(rb, key)
    if la is None or lb is None or la.dtype != lb.dtype or dtypes.is_string(la.dtype):
        return None
    dtype, count = la.dtype, ra.tensors[key].size
    pieces = _Pieces(count, chunk_elements(dtype.itemsize, dtype.itemsize, chunk_bytes=chunk_bytes))
    checked = dtype.kind in "biufc" and dtype.isbuiltin == 1  # _add_chunk's bit-for-bit look first
    fast = _fast_dtype(dtype, dtype)
    caller = threading.get_ident()
    shared = {"unequal_chunk": len(pieces.bounds), "max_rel": 0.0}  # hints only: racy updates are safe
    own: dict[bool, tuple[_Tally, _Work | None]] = {}

    def work(i: int, pa: np.ndarray, pb: np.ndarray) -> _Part:
        mine = threading.get_ident() == caller
        if mine not in own:  # each thread's scratch buffers, kept across tensors by compare's tally
            t = _Tally((tally._buffers[0 if mine else 1], {}))
            own[mine] = t, _Work(t, CHUNK, dtype) if fast else None
        t, scratch = own[mine]
        t.unequal = t.outside = 0
        t.max_abs, t.max_rel, t.sum_a2, t.sum_d2 = 0.0, shared["max_rel"], 0.0, 0.0
        equal = None
        chunk = pieces.chunk_of[i]
        if checked and chunk <= shared["unequal_chunk"]:  # a later chunk than one that differs: no look
            equal = bool(np.array_equal(_words(pa), _words(pb)))
            if not equal:
                shared["unequal_chunk"] = min(chunk, shared["unequal_chunk"])
        with np.errstate(invalid="ignore", divide="ignore", over="ignore", under="ignore"):  # per thread
            if equal:
                t.sum_a2 = _norm_squared(pa)
            elif scratch is None or not _add_fast(t, scratch, pa, pb, atol, rtol):
                _add_exact(t, pa, pb, atol, rtol)
        max_rel = t.max_rel or 0.0
        shared["max_rel"] = max(max_rel, shared["max_rel"])
        return _Part(equal, t.unequal, t.outside, t.max_abs or 0.0, max_rel, t.sum_a2, t.sum_d2)

    merge = _Merge(pieces, checked)
    work_paired_pieces(la, lb, pieces.bounds, work, merge, _second)
    return merge.into(tally, count)
