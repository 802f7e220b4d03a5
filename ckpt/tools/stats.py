"""Summary statistics of tensors: ``tensor_stats`` over a checkpoint, ``array_stats`` of an array.

What ``ckpt inspect --stats`` prints: min, max, mean, std, zeros, NaN and Inf counts and a
16-bin histogram with power-of-two bin widths. Checkpoint tensors are read once, in bounded
chunks (memory holds a chunk, not a tensor), each checked against the tensor's checksum as it
streams; a tensor stored raw in a local file is read piece by piece by the threads that compute on
it, while the piece is in their cache (``ckpt.tools.fused``: the same pieces, the same bits).

Each chunk is handled in pieces of ``PIECE`` elements (small enough to stay in the CPU cache across
the numpy calls each piece needs), shared between this thread and a second one, each taking the next
piece as it finishes one (numpy and BLAS release the GIL in their loops): min, max, zeros and
NaN/Inf counts in the tensor's own dtype (or float32, exact for every 16-bit and smaller dtype:
numpy's float16 loops are slow, bfloat16/float8 have none); the histogram (``ckpt.tools.histogram``:
16 bins of width 2**k on the absolute grid [j * 2**k, (j + 1) * 2**k), k the smallest for which
[min, max] spans at most 16 bins), each piece binned on the grid of the range seen so far or of its
own, grids merged exactly as the range widens; the sum and sum of squares in float64 (the piece's
float64 copy, numpy's pairwise sum and BLAS dot products of 8192 elements, which OpenBLAS keeps on
the calling thread), about a shift that keeps them free of cancellation (0, or the first piece's
mean where it is far from 0 against the spread; a piece far from it is summed again about its own
mean). Pieces are merged in order (means by Chan et al.'s formula): the results do not depend on
thread timing, and the mean and std agree with exact arithmetic to about 1e-15 and 1e-12 relative.

Example:
    >>> import numpy as np
    >>> s = array_stats(np.array([0.0, 1.0, 2.0, 3.0, np.nan], dtype=np.float32))
    >>> s.min, s.max, s.mean, s.nan, s.zeros, s.histogram[:4], s.histogram_edges[:2]
    (0.0, 3.0, 1.5, 1, 1, (1, 0, 0, 0), (0.0, 0.25))
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np

from ckpt import dtypes
from ckpt.tools.histogram import BINS, Bins, Histogram, Scratch, bin_values, exponent_floor
from ckpt.tools.chunks import OneThread, chunk_elements, reusing_buffers, tensor_chunks
from ckpt.tools.fused import Layout, local_layout, piece_bounds, work_pieces
from ckpt.tools.jsonview import jsonable
from ckpt.tools.sources import Checkpoint, Keys, opened, select_keys
from ckpt.storage.urls import StorageOptions

__all__ = ["TensorStats", "array_stats", "tensor_stats", "HISTOGRAM_BINS"]

HISTOGRAM_BINS = BINS
#: Elements handled per vectorized step (a piece of a chunk: its copies stay in cache).
PIECE = 1 << 18
DOT = 8192  # elements of one BLAS dot product (OpenBLAS threads only longer ones)
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
    or empty strings. ``histogram`` holds HISTOGRAM_BINS counts of the finite values in bins of
    width 2**k on the grid of its multiples, the first bin holding min; ``histogram_edges`` are the
    HISTOGRAM_BINS + 1 edges (ints for integer tensors; exact floats, infinite only beyond
    float64's range). k is the smallest for which min and max fall in at most 16 bins (so 8 to 16
    bins hold values), and bins are never narrower than the values' resolution (1 for integers; for
    floats the dtype's smallest subnormal and max|value| * 2**-48): the counts are exactly
    ``np.histogram(finite values, bins=histogram_edges)[0]`` (max is always below the last edge).
    Both are empty without finite values. min, max and the counts are exact; mean and std
    come from float64 sums (about 1e-15 and 1e-12 relative of exact arithmetic).
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
    histogram_edges: tuple[float | int, ...] = ()

    @property
    def nonfinite(self) -> bool:
        """True when the tensor holds a NaN or an infinity."""
        return bool(self.nan or self.inf)

    def lines(self) -> list[str]:
        """The text view: a line of numbers, then the histogram's bars between its first and last edges."""
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
        edges = self.histogram_edges
        return [head, f"  histogram {_num(edges[0])} |{_bars(self.histogram)}| {_num(edges[-1])}"]

    def to_json(self) -> dict[str, Any]:
        """The JSON view (non-finite floats as the strings "NaN", "Infinity", "-Infinity")."""
        return {"kind": self.kind, "count": self.count, "zeros": self.zeros, "nan": self.nan, "inf": self.inf,
                "min": jsonable(self.min), "max": jsonable(self.max),
                "mean": jsonable(self.mean), "std": jsonable(self.std),
                "histogram": list(self.histogram), "histogram_edges": [jsonable(e) for e in self.histogram_edges]}


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


class _Scratch:
    """One worker's reused buffers for a piece: its float64 copy, a domain copy, a mask and the
    histogram's buffers."""

    def __init__(self, piece: int = PIECE) -> None:
        self.row = np.empty(piece, dtype=np.float64)
        self.mask = np.empty(piece, dtype=bool)
        self.values: dict[np.dtype, np.ndarray] = {}
        self.bins = Scratch()

    def fit(self, piece: int) -> None:
        """Make room for pieces of ``piece`` elements (buffers are used sliced to a piece's size)."""
        if self.row.size < piece:
            self.row, self.mask = np.empty(piece, dtype=np.float64), np.empty(piece, dtype=bool)
            self.values.clear()

    def domain_copy(self, raw: np.ndarray, domain: np.dtype) -> np.ndarray:
        """``raw`` as ``domain`` values (magnitudes for complex), in a reused buffer where one is needed."""
        if raw.dtype == domain:
            return raw
        buffer = self.values.get(domain)
        if buffer is None:
            buffer = self.values[domain] = np.empty(self.row.size, dtype=domain)
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
        row = self.row[:n]
        if shift:
            np.subtract(x, np.float64(shift), out=row, casting="unsafe")
        else:
            np.copyto(row, x, casting="unsafe")
        # the squares by dot products of DOT elements: BLAS runs those on this thread (a longer one may
        # wake its own threads, which then spin on the core the other half of the work needs)
        whole = n - n % DOT
        rows = row[:whole].reshape(-1, DOT)
        s2 = float(np.add.reduce(np.vecdot(rows, rows)))
        if whole < n:
            s2 += float(np.dot(row[whole:], row[whole:]))
        return float(np.add.reduce(row)), s2


class _Piece:
    """One piece's figures from pass 1 (merged in order, so results do not depend on threads)."""

    __slots__ = ("bins", "hi", "lo", "m2", "n", "nan", "offset", "shift", "zeros")

    def __init__(self) -> None:
        self.n = self.zeros = self.nan = 0
        self.lo: Any = None
        self.hi: Any = None
        self.shift = self.offset = self.m2 = 0.0  # the mean is shift + offset (apart: no digits lost)
        self.bins: Bins | None = None  # the histogram of the piece's finite values


def _first_pass(raw: np.ndarray, scratch: _Scratch, domain: np.dtype, shift: float, floor: int,
                hint: int | None = None) -> _Piece:
    """A piece's count, range, zeros, NaN count, histogram (bins of 2**k, k >= ``floor`` and >= ``hint``),
    mean and sum of squared deviations."""
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
        else:
            p.nan = int(np.count_nonzero(np.isnan(x)))
    if finite is not None:  # some values are not finite (or complex): leave them out
        p.zeros = scratch.zeros(x)
        if not finite.all():
            x = x[finite]
        if not x.size:
            return p
        p.lo, p.hi = float(x.min()), float(x.max())
    p.n = x.size
    p.bins = bin_values(x, p.lo, p.hi, floor, scratch.bins, hint)
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


def _scratch(piece: int) -> _Scratch:
    scratch: _Scratch | None = getattr(_local, "scratch", None)
    if scratch is None:
        scratch = _local.scratch = _Scratch(max(piece, PIECE))
    scratch.fit(piece)
    return scratch


def _on_both(chunk: np.ndarray, piece: int, work: Callable[[Iterable[np.ndarray]], list[T]]) -> list[T]:
    """``work(pieces)`` over the ``piece``-element pieces of ``chunk`` on this thread and the second one,
    results in order. Each thread takes the next piece as it finishes one (not half each: where the
    reads take a core from one thread for a while, the other one does not wait for it at the end)."""
    pieces = [chunk[s:s + piece] for s in range(0, chunk.size, piece)]
    if len(pieces) < 2:
        return work(pieces)
    results: list[Any] = [None] * len(pieces)
    lock, counter = threading.Lock(), itertools.count()

    def share() -> None:
        taken: list[int] = []

        def take() -> Iterator[np.ndarray]:
            while True:
                with lock:
                    i = next(counter)
                if i >= len(pieces):
                    return
                taken.append(i)
                yield pieces[i]

        for i, result in zip(taken, work(take())):  # work consumes take() before zip reads taken
            results[i] = result

    job = _second.get().submit(share)
    try:
        share()
    finally:
        job.result()  # the chunk's buffer must not be reused while the second thread reads it
    return results


class _Accumulator:
    """Statistics of a tensor fed in flat chunks, in one pass: ``add`` each chunk, then ``result``."""

    def __init__(self, kind: str, count: int, dtype: np.dtype, piece: int = PIECE) -> None:
        self.kind, self.count, self.domain, self.piece = kind, count, _domain(dtype), piece
        self.zeros = self.nan = self.n = 0
        self.lo: Any = None
        self.hi: Any = None
        self.ref: float | None = None  # the shift of the sums; self.mean is the mean minus it
        self.mean = self.m2 = 0.0
        floor = exponent_floor(np.dtype(np.int64) if kind == "string" else dtype)
        self.histogram = Histogram(floor)

    def add(self, chunk: np.ndarray) -> None:
        """One flat chunk (numbers; string tensors are fed their lengths)."""
        floor = self.histogram.floor

        def work(pieces: Iterable[np.ndarray], shift: float) -> list[_Piece]:
            hint = self.histogram.k  # the grid so far (fixed while a chunk is binned): pieces on it add up
            scratch = _scratch(self.piece)
            with np.errstate(over="ignore", invalid="ignore", under="ignore"):  # per thread: huge values, inf std
                return [_first_pass(raw, scratch, self.domain, shift, floor, hint) for raw in pieces]

        if self.ref is None and chunk.size:  # the first piece sets the shift every other piece's sums use
            first = work([chunk[:self.piece]], 0.0)[0]
            self.ref = first.shift  # 0, or that piece's mean where 0 is far from it against the spread
            self._merge(first)
            chunk = chunk[self.piece:]
        ref = self.ref or 0.0
        for p in _on_both(chunk, self.piece, lambda pieces: work(pieces, ref)):
            self._merge(p)

    def _merge(self, p: _Piece) -> None:
        self.zeros += p.zeros
        self.nan += p.nan
        if not p.n or p.bins is None:
            return
        self.histogram.add(p.bins)
        self.lo = p.lo if self.lo is None else min(self.lo, p.lo)
        self.hi = p.hi if self.hi is None else max(self.hi, p.hi)
        total = self.n + p.n  # Chan et al.'s merge of two means and sums of squared deviations
        delta = (p.shift - (self.ref or 0.0)) + p.offset - self.mean  # means kept relative to ref
        self.mean += delta * p.n / total
        self.m2 += p.m2 + delta * delta * self.n * p.n / total
        self.n = total

    def result(self) -> TensorStats:
        inf = self.count - self.n - self.nan
        if self.lo is None:
            return TensorStats(self.kind, self.count, self.zeros, self.nan, inf, None, None, None, None, ())
        return TensorStats(self.kind, self.count, self.zeros, self.nan, inf, self.lo, self.hi,
                           (self.ref or 0.0) + self.mean, math.sqrt(self.m2 / self.n), self.histogram.counts,
                           self.histogram.edges)


def _string_lengths(flat: np.ndarray) -> np.ndarray:
    return np.fromiter((len(x) for x in flat), dtype=np.int64, count=flat.size)


def _stats_of_chunks(kind: str, count: int, dtype: np.dtype, chunks: Callable[[], Iterable[np.ndarray]],
                     piece: int = PIECE) -> TensorStats:
    """Statistics from ``chunks()`` (flat chunks in order), in one pass, in pieces of ``piece`` elements."""
    acc = _Accumulator(kind, count, dtype, piece)
    for chunk in chunks():
        acc.add(_string_lengths(chunk) if kind == "string" else chunk)
    result = acc.result()
    return replace(result, mean=None, std=None) if kind == "string" else result  # no mean of strings


def array_stats(arr: np.ndarray, *, piece: int = PIECE) -> TensorStats:
    """Compute an in-memory tensor's statistics (bounded extra memory: one piece's float64 copy).

    ``piece``: elements handled per vectorized step (the figures do not depend on it, but for
    the last digits of mean and std).

    Example:
        >>> import numpy as np
        >>> s = array_stats(np.array([[1, 2], [3, 0]], dtype=np.int32))
        >>> s.kind, s.min, s.max, s.mean, s.zeros
        ('int', 0, 3, 1.5, 1)
    """
    flat = arr.reshape(-1)
    return _stats_of_chunks(_kind(arr.dtype), flat.size, arr.dtype, lambda: [flat], piece)


def _stats_of_layout(layout: Layout, kind: str, count: int, chunk_bytes: int | None) -> TensorStats | None:
    """Statistics of a tensor of a local file, each piece read by the thread that works on it (still
    in its cache: ckpt.tools.fused), cut where the chunked path cuts (the same bits); None where
    that path would cut otherwise (a ``chunk_bytes`` that is not a whole number of 4 MiB pieces)."""
    item = max(layout.dtype.itemsize, 1)
    chunk = chunk_elements(item, chunk_bytes=chunk_bytes)
    if count * item > chunk * item and (chunk * item) % (4 << 20):
        return None
    acc = _Accumulator(kind, count, layout.dtype)
    floor = acc.histogram.floor

    def work(i: int, raw: np.ndarray) -> _Piece:
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):  # per thread: huge values, inf std
            return _first_pass(raw, _scratch(acc.piece), acc.domain, acc.ref or 0.0, floor, acc.histogram.k)

    def merge(p: _Piece) -> None:
        if acc.ref is None:  # the first piece sets the shift every other piece's sums use
            acc.ref = p.shift
        acc._merge(p)

    work_pieces(layout, piece_bounds(count, chunk, acc.piece), work, merge, _second)
    return acc.result()


def stats_of(reader: Any, key: str, *, chunk_bytes: int | None = None) -> TensorStats:
    """The statistics of one tensor of an open CheckpointReader, read in chunks of about
    ``chunk_bytes`` (None: ckpt.tools.chunks.CHUNK_BYTES)."""
    info = reader.tensors[key]
    layout = local_layout(reader, key)
    if layout is not None:
        found = _stats_of_layout(layout, _kind(info.dtype), info.size, chunk_bytes)
        if found is not None:
            return found
    return _stats_of_chunks(_kind(info.dtype), info.size, info.dtype,
                            lambda: tensor_chunks(reader, key, chunk_bytes=chunk_bytes))


def tensor_stats(checkpoint: Checkpoint, keys: Keys = None, *, progress: Callable[[int], None] | None = None,
                 storage_options: StorageOptions | None = None,
                 chunk_bytes: int | None = None) -> dict[str, TensorStats]:
    """Compute the statistics of a checkpoint's tensors, reading each in bounded chunks.

    Args:
        checkpoint: a checkpoint file, a directory (its latest checkpoint), a URL, or an open
            ``CheckpointReader``.
        keys: None for every tensor, a regular expression (``re.search``), or a list of keys.
        progress: called with the number of bytes read, as the work goes on.
        storage_options: for a URL, options for the store's fsspec filesystem.
        chunk_bytes: about this many bytes of a tensor are read at a time (None: 8 MiB).

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
    with opened(checkpoint, storage_options) as reader, reusing_buffers():
        out: dict[str, TensorStats] = {}
        for key in select_keys(reader.tensors, keys, reader.path):
            out[key] = stats_of(reader, key, chunk_bytes=chunk_bytes)
            if progress is not None:
                progress(reader.tensors[key].nbytes)
        return out
