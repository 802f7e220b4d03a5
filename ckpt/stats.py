"""Summary statistics of tensors: ``tensor_stats`` over a checkpoint, ``array_stats`` of an array.

What ``ckpt inspect --stats`` prints: min, max, mean, std, zeros, NaN and Inf counts and a
16-bin histogram between min and max. Checkpoint tensors are read in bounded chunks (memory
holds a chunk, not a tensor), each checked against the tensor's checksum as it streams.

The statistics are computed in one pass over the chunks, vectorized per piece of
``PIECE`` elements (small enough to stay in the CPU cache across the few numpy reductions
each piece needs). The histogram's bins depend on min and max, which are only known at the
end, so a tensor larger than one chunk is read a second time for its histogram (bins
between the exact min and max, as numpy's ``histogram`` draws them; a fixed-range histogram
would have been one pass but would have changed what the command prints); a tensor that
fits in one chunk is binned from memory.

Example:
    >>> import numpy as np
    >>> s = array_stats(np.array([0.0, 1.0, 2.0, 3.0, np.nan], dtype=np.float32))
    >>> s.min, s.max, s.mean, s.nan, s.zeros, s.histogram[0]
    (0.0, 3.0, 1.5, 1, 1, 1)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from . import dtypes
from ._json import jsonable
from ._sources import Checkpoint, Keys, opened, select_keys
from ._urls import StorageOptions

__all__ = ["TensorStats", "array_stats", "tensor_stats", "HISTOGRAM_BINS"]

HISTOGRAM_BINS = 16
#: Elements handled per vectorized step (a piece of a chunk: its float64 copy stays in cache).
PIECE = 1 << 17
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
    to max (empty when there are no finite values).
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


class _Accumulator:
    """Statistics of a tensor fed in flat chunks: ``add`` each chunk (pass 1), then, when
    ``binning`` says so, ``bin`` each chunk again (pass 2), then ``result``."""

    def __init__(self, kind: str, count: int) -> None:
        self.kind, self.count = kind, count
        self.zeros = self.nan = self.n = 0
        self.lo: Any = None
        self.hi: Any = None
        self.mean = self.m2 = 0.0
        self.hist = np.zeros(HISTOGRAM_BINS, dtype=np.int64)
        self._scratch = np.empty(0, dtype=np.float64)

    def _floats(self, raw: np.ndarray) -> np.ndarray:
        """``raw`` as float64 (magnitudes for complex), in a reused buffer."""
        if raw.dtype.kind == "c":
            magnitudes: np.ndarray = np.abs(raw).astype(np.float64, copy=False)
            return magnitudes
        if self._scratch.size < raw.size:
            self._scratch = np.empty(max(raw.size, PIECE), dtype=np.float64)
        out = self._scratch[:raw.size]
        np.copyto(out, raw, casting="unsafe")
        return out

    def add(self, chunk: np.ndarray) -> None:
        """Pass 1 over one flat chunk (numbers; string tensors are fed their lengths)."""
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):  # huge values: inf std, no warning
            for start in range(0, chunk.size, PIECE):
                self._add_piece(chunk[start:start + PIECE])

    def _add_piece(self, raw: np.ndarray) -> None:
        exact = raw.dtype.kind in "biu"  # integer min/max are reported exactly, not through float64
        if raw.dtype.kind == "f" and not raw.dtype.isbuiltin:  # bfloat16, float8: numpy's loops are slow
            raw = raw.astype(np.float32)
        if exact or raw.dtype.kind == "f":
            c_lo, c_hi = raw.min(), raw.max()  # NaN propagates: both finite means all are
            if exact or (math.isfinite(c_lo) and math.isfinite(c_hi)):
                self.zeros += raw.size - int(np.count_nonzero(raw))
                x = self._floats(raw)
                self._merge(x, int(c_lo) if exact else float(c_lo), int(c_hi) if exact else float(c_hi))
                return
        x = self._floats(raw)
        self.zeros += int(np.count_nonzero(x == 0))
        finite = np.isfinite(raw) if raw.dtype.kind == "c" else np.isfinite(x)
        self.nan += int(np.count_nonzero(np.isnan(raw if raw.dtype.kind == "c" else x)))
        if not finite.all():
            x = x[finite]
        if x.size:
            self._merge(x, float(x.min()), float(x.max()))

    def _merge(self, x: np.ndarray, c_lo: Any, c_hi: Any) -> None:
        """Fold a piece's finite values (float64, overwritten) into the running figures."""
        self.lo = c_lo if self.lo is None else min(self.lo, c_lo)
        self.hi = c_hi if self.hi is None else max(self.hi, c_hi)
        # merge this piece's mean and sum of squared deviations into the running ones (Chan et al.)
        c_mean = float(x.sum()) / x.size
        x -= c_mean
        c_m2 = float(np.einsum("i,i->", x, x))
        total = self.n + x.size
        delta = c_mean - self.mean
        self.mean += delta * x.size / total
        self.m2 += c_m2 + delta * delta * self.n * x.size / total
        self.n = total

    @property
    def binning(self) -> bool:
        """Whether ``bin`` must see the values again (there are finite values to bin)."""
        return self.lo is not None

    def bin(self, chunk: np.ndarray) -> None:
        """Pass 2 over one flat chunk: count its finite values into the histogram."""
        lo, hi = float(self.lo), float(self.hi)
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):
            for start in range(0, chunk.size, PIECE):
                raw = chunk[start:start + PIECE]
                if raw.dtype.kind == "f" and not raw.dtype.isbuiltin:
                    raw = raw.astype(np.float32)
                x = self._floats(raw)
                if self.nan or self.n != self.count:  # some values are not finite: leave them out
                    x = x[np.isfinite(x)]
                self.hist += _bin_counts(x, lo, hi)

    def result(self) -> TensorStats:
        inf = self.count - self.n - self.nan
        if self.lo is None:
            return TensorStats(self.kind, self.count, self.zeros, self.nan, inf, None, None, None, None, ())
        return TensorStats(self.kind, self.count, self.zeros, self.nan, inf, self.lo, self.hi, self.mean,
                           math.sqrt(self.m2 / self.n), tuple(int(c) for c in self.hist))


def _bin_counts(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Histogram counts over [lo, hi]; values are scaled first so ranges like ±1e308 cannot overflow."""
    bins = HISTOGRAM_BINS
    if lo == hi:
        counts = np.zeros(bins, dtype=np.int64)
        counts[bins // 2] = x.size
        return counts
    if math.isfinite(hi - lo):  # x is a scratch copy: scaled in place, as numpy's histogram does
        np.subtract(x, lo, out=x)
        np.divide(x, hi - lo, out=x)
        np.multiply(x, bins, out=x)
    else:  # a range like ±1e308: scaled first so nothing overflows
        x = (x / bins - lo / bins) / (hi / bins - lo / bins) * bins
    np.minimum(x, bins - 1, out=x)  # hi itself lands in the last bin; nothing is below lo
    return np.bincount(x.astype(np.intp), minlength=bins)


def _string_lengths(flat: np.ndarray) -> np.ndarray:
    return np.fromiter((len(x) for x in flat), dtype=np.int64, count=flat.size)


def _stats_of_chunks(kind: str, count: int, chunks: Callable[[], Iterable[np.ndarray]]) -> TensorStats:
    """Statistics from ``chunks()`` (flat chunks in order): one pass, and a second one for the
    histogram unless the values came in one chunk (binned from memory)."""
    acc = _Accumulator(kind, count)
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
    return _stats_of_chunks(_kind(arr.dtype), flat.size, lambda: [flat])


def stats_of(reader: Any, key: str) -> TensorStats:
    """The statistics of one tensor of an open CheckpointReader, read in bounded chunks."""
    from ._chunks import tensor_chunks

    info = reader.tensors[key]
    return _stats_of_chunks(_kind(info.dtype), info.size, lambda: tensor_chunks(reader, key))


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
