"""Comparing two checkpoints: ``compare``, what ``ckpt diff`` reports.

Keys, dtypes, shapes, values and metadata. Values are compared wherever shapes match (also
across numeric dtypes, float32 against float16), a pair of tensors streaming through in
bounded chunks, each checked against its checksum. NaNs in the same place are equal. With
``atol``/``rtol``, an element is close when ``|a - b| <= atol + rtol * |b|`` (numpy's
isclose, B as the reference).

Example:
    >>> import ckpt, numpy as np, tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> a, b = os.path.join(d, "a.msgpack"), os.path.join(d, "b.h5")
    >>> _ = ckpt.Saver({"w": ckpt.Variable([1.0, 2.0]), "v": ckpt.Variable([0])}).save(a)
    >>> _ = ckpt.Saver({"w": ckpt.Variable([1.0, 2.5])}).save(b)
    >>> result = ckpt.compare(a, b)
    >>> result.same, result.only_in_a, result.differ
    (False, ['v'], ['w'])
    >>> result.tensor("w").values
    ValueDiff(count=2, unequal=1, outside=1, max_abs=0.5, max_rel=0.2, rel_l2=0.2236...)
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ckpt import dtypes
from ckpt.tools.chunks import OneThread, paired_chunks, reusing_buffers
from ckpt.tools.jsonview import jsonable
from ckpt.tools.sources import Checkpoint, Keys, opened, select_keys
from ckpt.storage.urls import StorageOptions
from ckpt.errors import KeyNotFoundError

__all__ = ["ValueDiff", "TensorChange", "MetadataChange", "Comparison", "compare", "compare_values", "CHANGES"]

#: Elements compared per vectorized step: bounds the temporaries for huge tensors.
CHUNK = 1 << 16
DOT = 8192  # elements of one BLAS dot product (OpenBLAS threads only longer ones)
_second = OneThread("ckpt-compare")  # takes half of each chunk's pieces (numpy and BLAS release the GIL)
#: What can happen to a key, in the order the counts are reported.
CHANGES = ("only in A", "only in B", "changed dtype or shape", "differ", "within tolerance", "identical",
           "metadata")
#: The changes that make two checkpoints different.
DIFFERENT = ("only in A", "only in B", "changed dtype or shape", "differ", "metadata")


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


@dataclass(frozen=True)
class TensorChange:
    """What happened to one key from A to B.

    ``change`` is one of CHANGES (not "metadata"); ``a`` and ``b`` are the TensorInfos (dtype,
    shape, nbytes) on each side (None where the key is missing); ``values`` says how the
    values differ, for keys present on both sides with one shape (None otherwise).
    """

    key: str
    change: str
    a: Any
    b: Any
    values: ValueDiff | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"key": self.key, "change": self.change}
        for side, info in (("a", self.a), ("b", self.b)):
            if info is not None:
                doc[side] = {"dtype": dtypes.dtype_label(info.dtype), "shape": list(info.shape)}
        if self.a is not None and self.b is not None:
            doc["values"] = None if self.values is None else self.values.to_json()
        return doc


_MISSING: Any = object()


@dataclass(frozen=True)
class MetadataChange:
    """A metadata key whose value differs: ``a`` and ``b`` hold the values (``has_a``/``has_b``
    say whether the key exists on that side)."""

    key: str
    a: Any = None
    b: Any = None
    has_a: bool = True
    has_b: bool = True

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"key": self.key, "change": "metadata"}
        doc.update({side: jsonable(value) for side, value, has in (("a", self.a, self.has_a),
                                                                   ("b", self.b, self.has_b)) if has})
        return doc


@dataclass(frozen=True)
class Comparison:
    """The result of :func:`compare`: every key of A and B with what happened to it.

    ``tensors`` lists every tensor key of either side, sorted; ``metadata`` the metadata keys
    whose values differ. ``same`` is True when nothing differs beyond the tolerance.
    """

    a: str
    b: str
    tensors: list[TensorChange] = field(default_factory=list)
    metadata: list[MetadataChange] = field(default_factory=list)

    def _keys(self, change: str) -> list[str]:
        return [t.key for t in self.tensors if t.change == change]

    @property
    def only_in_a(self) -> list[str]:
        """Keys only A holds."""
        return self._keys("only in A")

    @property
    def only_in_b(self) -> list[str]:
        """Keys only B holds."""
        return self._keys("only in B")

    @property
    def changed(self) -> list[str]:
        """Keys whose dtype or shape differs."""
        return self._keys("changed dtype or shape")

    @property
    def differ(self) -> list[str]:
        """Keys whose values differ beyond the tolerance."""
        return self._keys("differ")

    @property
    def within_tolerance(self) -> list[str]:
        """Keys whose values differ, all within the tolerance."""
        return self._keys("within tolerance")

    @property
    def identical(self) -> list[str]:
        """Keys with the same dtype, shape and values."""
        return self._keys("identical")

    @property
    def counts(self) -> dict[str, int]:
        """How many keys had each change, in the order of CHANGES."""
        counts = dict.fromkeys(CHANGES, 0)
        for t in self.tensors:
            counts[t.change] += 1
        counts["metadata"] = len(self.metadata)
        return counts

    @property
    def same(self) -> bool:
        """True when no key differs beyond the tolerance (metadata included)."""
        counts = self.counts
        return not any(counts[c] for c in DIFFERENT)

    def tensor(self, key: str) -> TensorChange:
        """The TensorChange of ``key``."""
        for t in self.tensors:
            if t.key == key:
                return t
        raise KeyNotFoundError(f"{key!r} is in neither {self.a} nor {self.b}")

    def to_json(self) -> dict[str, Any]:
        """The JSON view ``ckpt diff --json`` prints: "a", "b", "same", "counts", "changes"."""
        return {"a": self.a, "b": self.b, "same": self.same, "counts": self.counts,
                "changes": [t.to_json() for t in self.tensors] + [m.to_json() for m in self.metadata]}


def _shown(value: Any) -> str:
    return json.dumps(value, sort_keys=True, allow_nan=True, default=repr)


def metadata_changes(ma: dict[str, Any], mb: dict[str, Any]) -> list[MetadataChange]:
    """The metadata keys whose values (or their types) differ, sorted.

    Example:
        >>> [(c.key, c.has_a, c.has_b) for c in metadata_changes({"step": 1, "lr": 0.1}, {"step": 2, "x": 0})]
        [('lr', True, False), ('step', True, True), ('x', False, True)]
    """
    changes = []
    for key in sorted(set(ma) | set(mb)):
        if key not in mb:
            changes.append(MetadataChange(key, a=ma[key], has_b=False))
        elif key not in ma:
            changes.append(MetadataChange(key, b=mb[key], has_a=False))
        elif _shown(ma[key]) != _shown(mb[key]) or type(ma[key]) is not type(mb[key]):
            changes.append(MetadataChange(key, ma[key], mb[key]))
    return changes


def _compare_tensor(ra: Any, rb: Any, key: str, atol: float, rtol: float, tally: _Tally,
                    chunk_bytes: int | None = None) -> ValueDiff:
    """Stream one pair of same-shape tensors through in matching chunks into a new ``tally``."""
    for ca, cb in paired_chunks(ra, rb, key, chunk_bytes=chunk_bytes):
        _add_chunk(tally, ca, cb, atol, rtol)
    return tally.result()


def compare(a: Checkpoint, b: Checkpoint, *, atol: float = 0.0, rtol: float = 0.0, keys: Keys = None,
            progress: Callable[[int], None] | None = None,
            storage_options: StorageOptions | None = None, chunk_bytes: int | None = None) -> Comparison:
    """Compare two checkpoints: keys, dtypes, shapes, values and metadata.

    Args:
        a, b: checkpoint files, directories (their latest checkpoints), URLs or open
            ``CheckpointReader``s.
        atol, rtol: tolerances: values within them count as "within tolerance", not "differ".
        keys: None for every key, a regular expression (``re.search``), or a list of keys
            (each must be in A or B); metadata is compared only when ``keys`` is None.
        progress: called with the number of bytes of A compared, as the work goes on.
        storage_options: for URLs, options for the store's fsspec filesystem.
        chunk_bytes: about this many bytes of a tensor are read at a time (None: 8 MiB).

    Returns:
        A Comparison: ``same``, the keys by change, each tensor's ValueDiff.

    Raises:
        CorruptCheckpointError: a tensor fails its checksum.
        KeyNotFoundError: ``keys`` names a key in neither checkpoint, or matches none.
        ValueError: a negative tolerance.
    """
    if atol < 0 or rtol < 0:
        raise ValueError(f"tolerances cannot be negative (atol={atol}, rtol={rtol})")
    with opened(a, storage_options) as ra, opened(b, storage_options) as rb, reusing_buffers():
        ta, tb = ra.tensors, rb.tensors
        union = sorted(set(ta) | set(tb))
        chosen = select_keys(union, keys, f"{ra.path} and {rb.path}")
        changes = []
        tally = _Tally()  # each tensor's is tally.next(): they share scratch buffers
        for key in chosen:
            ia, ib = ta.get(key), tb.get(key)
            if ib is None:
                changes.append(TensorChange(key, "only in A", ia, None))
                continue
            if ia is None:
                changes.append(TensorChange(key, "only in B", None, ib))
                continue
            values = None
            # values are compared wherever shapes match, also across numeric dtypes (float32 -> float16)
            if ia.shape == ib.shape and dtypes.is_string(ia.dtype) == dtypes.is_string(ib.dtype):
                tally = tally.next()
                values = _compare_tensor(ra, rb, key, atol, rtol, tally, chunk_bytes)
                if progress is not None:
                    progress(ia.nbytes)
            if ia.dtype != ib.dtype or ia.shape != ib.shape:
                change = "changed dtype or shape"
            elif values is None:  # unreachable: equal shapes and kinds were compared above
                raise AssertionError(key)
            else:
                change = "differ" if values.outside else "within tolerance" if values.unequal else "identical"
            changes.append(TensorChange(key, change, ia, ib, values))
        metadata = metadata_changes(ra.metadata, rb.metadata) if keys is None else []
        return Comparison(ra.path, rb.path, changes, metadata)

