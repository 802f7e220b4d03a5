"""Summary statistics of tensors: ``tensor_stats`` over a checkpoint, ``array_stats`` of an array.

What ``ckpt inspect --stats`` prints: min, max, mean, std, zeros, NaN and Inf counts and a
16-bin histogram between min and max. Checkpoint tensors are read in bounded chunks (memory
holds a chunk, not a tensor), each checked against the tensor's checksum as it streams.

Pass 1 goes over the chunks once, vectorized per piece of ``PIECE`` elements (small enough to
stay in the CPU cache across the few numpy calls each piece needs), the pieces of a chunk
shared between this thread and a second one (numpy and BLAS release the GIL in their loops):
min, max, zeros and NaN/Inf counts in the tensor's own dtype (or float32, exact for every
16-bit and smaller dtype: numpy's float16 loops are slow, bfloat16/float8 have none); the
sum and sum of squares of each piece in float64 from one matrix-vector product (its float64
copy next to a row of ones), about a shift that keeps them free of cancellation (0, or the
first piece's mean where it is far from 0 against the spread; a piece far from it is summed
again about its own mean), merged in order with Chan et al.'s formula: the mean and std agree
with exact arithmetic to about 1e-15 and 1e-12 relative, whatever the thread timing.

The histogram's bins depend on min and max, which are only known at the end of pass 1, so a
tensor larger than one chunk is read a second time (pass 2; no exact histogram between a min
and a max that are not yet known can be built in one pass with memory bounded by a chunk); a
tensor of one chunk is binned from memory. Pass 2 counts the values below each of the 15
inner edges of ``np.histogram(values, 16, range=(min, max))`` (float64 edges; for float32
values each edge rounded up to float32, which splits float32 values exactly as the float64
edge does), skipping edges outside a piece's own range: the counts are numpy's, values on
an edge included.

Example:
    >>> import numpy as np
    >>> s = array_stats(np.array([0.0, 1.0, 2.0, 3.0, np.nan], dtype=np.float32))
    >>> s.min, s.max, s.mean, s.nan, s.zeros, s.histogram[0]
    (0.0, 3.0, 1.5, 1, 1, 1)
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np

from . import dtypes
from ._chunks import OneThread
from ._json import jsonable
from ._sources import Checkpoint, Keys, opened, select_keys
from ._urls import StorageOptions

__all__ = ["TensorStats", "array_stats", "tensor_stats", "HISTOGRAM_BINS"]

HISTOGRAM_BINS = 16
#: Elements handled per vectorized step (a piece of a chunk: its copies stay in cache).
PIECE = 1 << 17
T = TypeVar("T")
_BARS = "▁▂▃▄▅▆▇█"


def _num(x: float | int | None) -> str:
    return str(x) if isinstance(x, int) else f"{x:.6g}"


def _bars(counts: Sequence[int]) -> str:
    """Counts as block characters; an empty bin is a space, any non-empty bin is visible."""
    top = max(counts, default=0)
    return "".join(" " if not c else _BARS[min(len(_BARS) - 1, (len(_BARS) * c - 1) // top)] for c in counts)


@dataclass(frozen=True)
class TensorStats:
    """Summary statistics of one tensor.

    ``kind`` is "float", "int", "bool", "complex" (summarised by magnitude) or "string"
    (summarised by length in bytes; no mean). min, max, mean, std and the histogram cover
    the finite values; ``nan`` and ``inf`` count the others; ``zeros`` counts zeros, False
    or empty strings. ``histogram`` holds HISTOGRAM_BINS counts of equal-width bins from min
    to max, exactly ``np.histogram(finite values, HISTOGRAM_BINS, range=(min, max))[0]`` (empty
    when there are no finite values). min, max and the counts are exact; mean and std come from
    float64 sums (about 1e-15 and 1e-12 relative of exact arithmetic).
    """

    kind: str
    count: int
    zeros: int
    nan: int
    inf: int
    min: float | int | None
    max: float | int | None
    mean: float | None
    std: float | None
    histogram: tuple[int, ...]

    @property
    def nonfinite(self) -> bool:
        """True when the tensor holds a NaN or an infinity."""
        return bool(self.nan or self.inf)

    def lines(self) -> list[str]:
        """The text view: a line of numbers, then a histogram line between min and max."""
        if not self.count:
            return ["  empty: no values"]

        def share(n: int) -> str:
            return f"{100 * n / self.count:.1f}%"

        if self.kind == "bool":
            return [f"  true {share(self.count - self.zeros)}  false {share(self.zeros)}"]
        parts = ["no finite values"] if self.min is None else [f"min {_num(self.min)}", f"max {_num(self.max)}"]
        if self.mean is not None:
            parts += [f"mean {_num(self.mean)}", f"std {_num(self.std)}"]
        parts.append(f"{'empty' if self.kind == 'string' else 'zeros'} {share(self.zeros)}")
        if self.kind in ("float", "complex"):
            parts += [f"nan {self.nan}", f"inf {self.inf}"] + (["<- NaN/Inf"] if self.nonfinite else [])
        of = {"complex": "magnitudes: ", "string": "lengths: "}.get(self.kind, "")
        head = f"  {of}{'  '.join(parts)}"
        if self.min is None:
            return [head]
        return [head, f"  histogram {_num(self.min)} |{_bars(self.histogram)}| {_num(self.max)}"]

    def to_json(self) -> dict[str, Any]:
        """The JSON view (non-finite floats as the strings "NaN", "Infinity", "-Infinity")."""
        return {"kind": self.kind, "count": self.count, "zeros": self.zeros, "nan": self.nan, "inf": self.inf,
                "min": jsonable(self.min), "max": jsonable(self.max),
                "mean": jsonable(self.mean), "std": jsonable(self.std),
                "histogram": list(self.histogram)}


def _kind(dtype: np.dtype) -> str:
    if dtypes.is_string(dtype):
        return "string"
    return {"c": "complex", "b": "bool", "i": "int", "u": "int"}.get(dtype.kind, "float")


_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)


def _domain(dtype: np.dtype) -> np.dtype:
    """The float dtype a tensor's values are compared and binned in: float32 where every value converts
    to it exactly (and its comparisons against float32-rounded edges equal float64's), float64 otherwise."""
    if dtype.kind == "c":
        return _F32 if dtype.itemsize <= 8 else _F64  # magnitudes: abs of complex64 is float32
    if dtype.kind == "O":
        return _F64  # string lengths
    return _F32 if dtype.itemsize <= 2 or dtype == _F32 else _F64


def _inner_edges(lo: float, hi: float, domain: np.dtype) -> np.ndarray:
    """The 15 inner edges numpy's ``histogram(x, 16, range=(lo, hi))`` draws, as ``domain`` values that
    split ``domain`` values as the float64 edges split them (float32: each edge rounded up)."""
    bins = HISTOGRAM_BINS
    if math.isfinite(hi - lo):
        edges = np.linspace(lo, hi, bins + 1)[1:-1]  # what np.histogram computes its edges with
    else:  # a range like ±1e308: scaled first so nothing overflows
        edges = np.array([lo / bins * (bins - k) + hi / bins * k for k in range(1, bins)])
    if domain == _F64:
        return edges
    # x < e (float64) <=> x < the smallest float32 >= e, for every float32 x
    rounded = edges.astype(np.float32)
    return np.where(rounded.astype(np.float64) < edges, np.nextafter(rounded, np.float32(np.inf)), rounded)


class _Scratch:
    """One worker's reused buffers for a piece: its float64 copy (next to a row of ones, so one
    matrix-vector product gives the sum and the sum of squares), a domain copy and a mask."""

    def __init__(self) -> None:
        self.rows = np.ones((2, PIECE), dtype=np.float64)
        self.mask = np.empty(PIECE, dtype=bool)
        self.values: dict[np.dtype, np.ndarray] = {}

    def fit(self) -> None:
        if self.rows.shape[1] != PIECE:  # PIECE was changed (tests): follow it
            self.rows, self.mask = np.ones((2, PIECE), dtype=np.float64), np.empty(PIECE, dtype=bool)
            self.values.clear()

    def domain_copy(self, raw: np.ndarray, domain: np.dtype) -> np.ndarray:
        """``raw`` as ``domain`` values (magnitudes for complex), in a reused buffer where one is needed."""
        if raw.dtype == domain:
            return raw
        buffer = self.values.get(domain)
        if buffer is None:
            buffer = self.values[domain] = np.empty(PIECE, dtype=domain)
        out = buffer[:raw.size]
        if raw.dtype.kind == "c":
            np.abs(raw, out=out)
        else:
            np.copyto(out, raw, casting="unsafe")
        return out

    def zeros(self, x: np.ndarray) -> int:
        mask = self.mask[:x.size]
        np.equal(x, 0, out=mask)
        return int(np.count_nonzero(mask))

    def moments(self, x: np.ndarray, shift: float) -> tuple[float, float]:
        """Sum and sum of squares of ``x - shift``, in float64."""
        n = x.size
        row = self.rows[1, :n]
        if shift:
            np.subtract(x, np.float64(shift), out=row, casting="unsafe")
        else:
            np.copyto(row, x, casting="unsafe")
        s1, s2 = np.dot(self.rows[:, :n], row)
        return float(s1), float(s2)

    def below(self, x: np.ndarray, edges: np.ndarray, known: tuple[float, float] | None,
              counts: np.ndarray) -> None:
        """Add to ``counts[k]`` how many of ``x`` are below ``edges[k]`` (``known``: all of x lie in it)."""
        mask = self.mask[:x.size]
        for k, edge in enumerate(edges):
            if known is not None and edge <= known[0]:  # nothing of this piece is below the edge
                continue
            if known is not None and edge > known[1]:  # all of it is
                counts[k] += x.size
                continue
            np.less(x, edge, out=mask)
            counts[k] += int(np.count_nonzero(mask))


class _Piece:
    """One piece's figures from pass 1 (merged in order, so results do not depend on threads)."""

    __slots__ = ("hi", "lo", "m2", "n", "nan", "neginf", "offset", "ranged", "shift", "zeros")

    def __init__(self) -> None:
        self.n = self.zeros = self.nan = self.neginf = 0
        self.lo: Any = None
        self.hi: Any = None
        self.shift = self.offset = self.m2 = 0.0  # the mean is shift + offset (apart: no digits lost)
        self.ranged = False  # every value is finite and in [lo, hi]: pass 2 may skip edges outside it


def _first_pass(raw: np.ndarray, scratch: _Scratch, domain: np.dtype, shift: float) -> _Piece:
    """A piece's count, range, zeros, NaN and -Inf counts, mean and sum of squared deviations."""
    p = _Piece()
    exact = raw.dtype.kind in "biu"  # integer min/max are reported exactly, not through float64
    if raw.dtype.kind == "c":
        x = scratch.domain_copy(raw, domain)
        finite: np.ndarray | None = np.isfinite(raw)
        p.nan = int(np.count_nonzero(np.isnan(raw)))
    else:
        x = raw if exact or raw.dtype in (_F32, _F64) else scratch.domain_copy(raw, domain)
        lo, hi = np.minimum.reduce(x), np.maximum.reduce(x)  # NaN propagates: both finite means all are
        finite = None if exact or (math.isfinite(lo) and math.isfinite(hi)) else np.isfinite(x)
        if finite is None:
            p.lo, p.hi = (int(lo), int(hi)) if exact else (float(lo), float(hi))
            p.zeros = scratch.zeros(x) if p.lo <= 0 <= p.hi else 0
            p.ranged = True
        else:
            p.nan = int(np.count_nonzero(np.isnan(x)))
            p.neginf = int(np.count_nonzero(x == -np.inf))
    if finite is not None:  # some values are not finite (or complex): leave them out
        p.zeros = scratch.zeros(x)
        if not finite.all():
            x = x[finite]
        if not x.size:
            return p
        p.lo, p.hi = float(x.min()), float(x.max())
    p.n = x.size
    s1, s2 = scratch.moments(x, shift)
    m2 = s2 - s1 * s1 / p.n
    if math.isfinite(s1) and math.isfinite(m2) and not s1 * s1 <= 16 * p.n * m2:
        shift += s1 / p.n  # the mean is far from the shift (or all values are equal): again, about the mean
        s1, s2 = scratch.moments(x, shift)
        m2 = s2 - s1 * s1 / p.n
    p.shift, p.offset, p.m2 = shift, s1 / p.n, max(m2, 0.0)
    return p


_second = OneThread("ckpt-stats")  # takes half of each chunk's pieces (numpy and BLAS release the GIL in loops)

_local = threading.local()


def _scratch() -> _Scratch:
    scratch: _Scratch | None = getattr(_local, "scratch", None)
    if scratch is None:
        scratch = _local.scratch = _Scratch()
    scratch.fit()
    return scratch


def _on_both(chunk: np.ndarray, work: Callable[[int, np.ndarray], T]) -> list[T]:
    """``work(i, piece)`` on each piece of ``chunk``, results in order; the second half of the pieces
    runs on the second thread meanwhile."""
    pieces = [chunk[s:s + PIECE] for s in range(0, chunk.size, PIECE)]
    half = (len(pieces) + 1) // 2
    if len(pieces) < 2:
        return [work(i, p) for i, p in enumerate(pieces)]
    job = _second.get().submit(lambda: [work(half + i, p) for i, p in enumerate(pieces[half:])])
    try:
        first = [work(i, p) for i, p in enumerate(pieces[:half])]
    finally:
        rest = job.result()  # the chunk's buffer must not be reused while the second thread reads it
    return first + rest


class _Accumulator:
    """Statistics of a tensor fed in flat chunks: ``add`` each chunk (pass 1), then, when
    ``binning`` says so, ``bin`` each chunk again (pass 2), then ``result``."""

    def __init__(self, kind: str, count: int, dtype: np.dtype) -> None:
        self.kind, self.count, self.domain = kind, count, _domain(dtype)
        self.zeros = self.nan = self.neginf = self.n = 0
        self.lo: Any = None
        self.hi: Any = None
        self.ref: float | None = None  # the shift of the sums; self.mean is the mean minus it
        self.mean = self.m2 = 0.0
        self.ranges: list[tuple[float, float] | None] = []  # each piece's [lo, hi] when all its values are finite
        self.below = np.zeros(HISTOGRAM_BINS - 1, dtype=np.int64)  # values below each inner edge
        self._edges: np.ndarray | None = None
        self._piece = 0

    def add(self, chunk: np.ndarray) -> None:
        """Pass 1 over one flat chunk (numbers; string tensors are fed their lengths)."""
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):  # huge values: inf std, no warning
            if self.ref is None and chunk.size:  # the first piece sets the shift every other piece's sums use
                first = _first_pass(chunk[:PIECE], _scratch(), self.domain, 0.0)
                self.ref = first.shift  # 0, or that piece's mean where 0 is far from it against the spread
                self._merge(first)
                chunk = chunk[PIECE:]
            ref = self.ref
            pieces = _on_both(chunk, lambda i, raw: _first_pass(raw, _scratch(), self.domain, ref or 0.0))
        for p in pieces:
            self._merge(p)

    def _merge(self, p: _Piece) -> None:
        self.zeros += p.zeros
        self.nan += p.nan
        self.neginf += p.neginf
        self.ranges.append((float(p.lo), float(p.hi)) if p.ranged else None)
        if not p.n:
            return
        self.lo = p.lo if self.lo is None else min(self.lo, p.lo)
        self.hi = p.hi if self.hi is None else max(self.hi, p.hi)
        total = self.n + p.n  # Chan et al.'s merge of two means and sums of squared deviations
        delta = (p.shift - (self.ref or 0.0)) + p.offset - self.mean  # means kept relative to ref
        self.mean += delta * p.n / total
        self.m2 += p.m2 + delta * delta * self.n * p.n / total
        self.n = total

    @property
    def binning(self) -> bool:
        """Whether ``bin`` must see the values again (there are finite values, not all equal)."""
        return self.lo is not None and self.lo != self.hi

    def bin(self, chunk: np.ndarray) -> None:
        """Pass 2 over one flat chunk: count its values below each inner bin edge."""
        if self._edges is None:
            self._edges = _inner_edges(float(self.lo), float(self.hi), self.domain)
        edges, first = self._edges, self._piece
        self._piece += -(-chunk.size // PIECE)

        def count(i: int, raw: np.ndarray) -> np.ndarray:
            scratch = _scratch()
            x = scratch.domain_copy(raw, self.domain)
            counts = np.zeros(len(edges), dtype=np.int64)
            known = self.ranges[first + i] if first + i < len(self.ranges) else None
            scratch.below(x, edges, known, counts)
            return counts

        with np.errstate(invalid="ignore"):
            for counts in _on_both(chunk, count):
                self.below += counts

    def result(self) -> TensorStats:
        inf = self.count - self.n - self.nan
        if self.lo is None:
            return TensorStats(self.kind, self.count, self.zeros, self.nan, inf, None, None, None, None, ())
        hist = np.zeros(HISTOGRAM_BINS, dtype=np.int64)
        if self.lo == self.hi:
            hist[HISTOGRAM_BINS // 2] = self.n  # as numpy draws it: a range of one value is widened by 0.5 each side
        else:
            below = self.below - self.neginf  # -Inf is below every edge: it is no finite value
            hist[0], hist[1:-1], hist[-1] = below[0], np.diff(below), self.n - below[-1]
        return TensorStats(self.kind, self.count, self.zeros, self.nan, inf, self.lo, self.hi,
                           (self.ref or 0.0) + self.mean, math.sqrt(self.m2 / self.n), tuple(int(c) for c in hist))


def _string_lengths(flat: np.ndarray) -> np.ndarray:
    return np.fromiter((len(x) for x in flat), dtype=np.int64, count=flat.size)


def _stats_of_chunks(kind: str, count: int, dtype: np.dtype,
                     chunks: Callable[[], Iterable[np.ndarray]]) -> TensorStats:
    """Statistics from ``chunks()`` (flat chunks in order): one pass, and a second one for the
    histogram unless the values came in one chunk (binned from memory)."""
    acc = _Accumulator(kind, count, dtype)
    only: np.ndarray | None = None
    n_chunks = 0
    for chunk in chunks():
        if kind == "string":
            chunk = _string_lengths(chunk)
        acc.add(chunk)
        only, n_chunks = chunk, n_chunks + 1
    if acc.binning:
        again: Iterable[np.ndarray] = [only] if n_chunks == 1 and only is not None else chunks()
        for chunk in again:
            acc.bin(_string_lengths(chunk) if kind == "string" and chunk is not only else chunk)
    result = acc.result()
    return replace(result, mean=None, std=None) if kind == "string" else result  # no mean of strings


def array_stats(arr: np.ndarray) -> TensorStats:
    """Compute an in-memory tensor's statistics (bounded extra memory: one piece's float64 copy).

    Example:
        >>> import numpy as np
        >>> s = array_stats(np.array([[1, 2], [3, 0]], dtype=np.int32))
        >>> s.kind, s.min, s.max, s.mean, s.zeros
        ('int', 0, 3, 1.5, 1)
    """
    flat = arr.reshape(-1)
    return _stats_of_chunks(_kind(arr.dtype), flat.size, arr.dtype, lambda: [flat])


def stats_of(reader: Any, key: str) -> TensorStats:
    """The statistics of one tensor of an open CheckpointReader, read in bounded chunks."""
    from ._chunks import tensor_chunks

    info = reader.tensors[key]
    return _stats_of_chunks(_kind(info.dtype), info.size, info.dtype, lambda: tensor_chunks(reader, key))


def tensor_stats(checkpoint: Checkpoint, keys: Keys = None, *, progress: Callable[[int], None] | None = None,
                 storage_options: StorageOptions | None = None) -> dict[str, TensorStats]:
    """Compute the statistics of a checkpoint's tensors, reading each in bounded chunks.

    Args:
        checkpoint: a checkpoint file, a directory (its latest checkpoint), a URL, or an open
            ``CheckpointReader``.
        keys: None for every tensor, a regular expression (``re.search``), or a list of keys.
        progress: called with the number of bytes read, as the work goes on.
        storage_options: for a URL, options for the store's fsspec filesystem.

    Returns:
        key -> TensorStats, in the checkpoint's order.

    Raises:
        KeyNotFoundError: a listed key is not in the checkpoint, or the pattern matches nothing.
        CorruptCheckpointError: a tensor fails its checksum (no statistics are returned).

    Example:
        >>> import ckpt, numpy as np, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "m.msgpack")
        >>> _ = ckpt.Saver({"w": ckpt.Variable([1.0, -1.0, 0.0, 4.0])}).save(path)
        >>> s = ckpt.tensor_stats(path)["w"]
        >>> s.min, s.max, s.mean, s.zeros
        (-1.0, 4.0, 1.0, 1)
    """
    from ._chunks import reusing_buffers

    with opened(checkpoint, storage_options) as reader, reusing_buffers():
        out: dict[str, TensorStats] = {}
        for key in select_keys(reader.tensors, keys, reader.path):
            out[key] = stats_of(reader, key)
            if progress is not None:
                progress(reader.tensors[key].nbytes)
        return out
