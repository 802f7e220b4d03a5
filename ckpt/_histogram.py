"""The statistics' histogram: 16 bins of width 2**k on the absolute grid [j * 2**k, (j + 1) * 2**k).

``k`` is the smallest exponent for which the values' [min, max] spans at most 16 bins (so 8 to 16
bins hold values, and the edges are binary numbers a person can read), never below the resolution
of the values (integers: bins of width 1 at least; floats: ``2**k`` at least the dtype's smallest
subnormal and at least ``max|value| * 2**-48``, so every edge is an exact float64). The first bin
is the one holding min.

Built in one streaming pass: each piece of a tensor is binned on the grid of its own range, and
grids merge exactly into the grid of a wider range, because a bin index on a grid twice as coarse
is ``floor(floor(x / w) / 2) = floor(x / 2w)`` (``j >> 1``). A float piece's bin indices are
``floor(x * 2**-k)``: multiplying by a power of two and rounding down are exact in floating point,
except that a tiny negative value can underflow to -0.0 (corrected: it belongs to bin -1).
Integers bin by an arithmetic shift. The 16 counts of a piece come from one ``bincount`` of 12-bit
keys packing three bin indices each (numpy's counting loop costs about 1 ns per key, so three
values per key cost a third of it).

Example:
    >>> import numpy as np
    >>> h = Histogram(exponent_floor(np.dtype(np.float32)))
    >>> h.add(*bin_values(np.array([0.1, 0.7, 1.0], np.float32), 0.1, 1.0, h.floor, Scratch()))
    >>> h.edges[:2], h.edges[-1], h.counts
    ((0.0625, 0.125), 1.0625, (1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1))
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["BINS", "Histogram", "Scratch", "bin_values", "exponent_floor", "floor_bin", "grid_exponent"]

BINS = 16
_PRECISION = 48  # bins are at least max|value| * 2**-48 wide: bin numbers below 2**49, exact float64 edges


def exponent_floor(dtype: np.dtype) -> int:
    """The smallest k a tensor of ``dtype`` bins with: 0 for integers, bools and string lengths; for
    floats (and complex magnitudes) the exponent of the smallest positive subnormal.

    Example:
        >>> exponent_floor(np.dtype(np.float32)), exponent_floor(np.dtype(np.int8))
        (-149, 0)
    """
    if dtype.kind == "c":
        dtype = np.dtype(np.float32) if dtype.itemsize <= 8 else np.dtype(np.float64)
    elif dtype.kind in "biuOSUT":  # integers; string tensors are binned by length
        return 0
    finfo: Any = ml_dtypes.finfo  # knows bfloat16 and the float8 types (untyped)
    return math.frexp(float(finfo(dtype).smallest_subnormal))[1] - 1


def floor_bin(value: float | int, k: int) -> int:
    """``floor(value / 2**k)``, exactly (Python integers; no rounding, no underflow)."""
    if isinstance(value, int):
        return value >> k if k >= 0 else value << -k
    num, den = value.as_integer_ratio()
    return num // (den << k) if k >= 0 else (num << -k) // den


def grid_exponent(lo: float | int, hi: float | int, floor: int) -> int:
    """The smallest k >= ``floor`` (and, for floats, >= exponent(max|value|) - 48) for which [lo, hi]
    spans at most BINS bins of width 2**k.

    Example:
        >>> grid_exponent(-1.0, 1.0, -149), grid_exponent(0, 15, 0), grid_exponent(0, 16, 0)
        (-2, 0, 1)
    """
    top = max(abs(lo), abs(hi))
    if isinstance(lo, float) and top:
        floor = max(floor, math.frexp(top)[1] - 1 - _PRECISION)
    if lo == hi:
        return floor
    if isinstance(lo, int) and isinstance(hi, int):
        bits = (hi - lo).bit_length()  # hi - lo < 2**bits
    else:
        bits = math.frexp(hi - lo)[1] if math.isfinite(hi - lo) else math.frexp(hi / 2 - lo / 2)[1] + 1
    k = max(floor, bits - 5)  # a guess near the answer: 16 to 32 bins
    while floor_bin(hi, k) - floor_bin(lo, k) >= BINS:
        k += 1
    while k > floor and floor_bin(hi, k - 1) - floor_bin(lo, k - 1) < BINS:
        k -= 1
    return k


class Scratch:
    """Reused buffers for binning one piece of at most ``size`` values."""

    def __init__(self) -> None:
        self.size = 0
        self.index = np.empty(0, np.uint8)
        self.keys = np.empty((2, 0), np.uint16)
        self.values: dict[np.dtype, np.ndarray] = {}

    def fit(self, size: int) -> None:
        if size > self.size:
            self.size = size
            self.index = np.empty(size, np.uint8)
            self.keys = np.empty((2, size // 3 + 1), np.uint16)
            self.values.clear()

    def buffer(self, dtype: np.dtype, n: int) -> np.ndarray:
        out = self.values.get(dtype)
        if out is None or out.size < n:
            out = self.values[dtype] = np.empty(max(n, self.size), dtype)
        return out[:n]


def _count(index: np.ndarray, scratch: Scratch) -> np.ndarray:
    """How many of ``index`` (uint8 values below 16) equal 0, 1, ... 15."""
    third = index.size // 3
    keys, high = scratch.keys[0, :third], scratch.keys[1, :third]
    np.left_shift(index[third:2 * third], 4, out=keys, dtype=np.uint16)  # key = a | b << 4 | c << 8
    np.bitwise_or(keys, index[:third], out=keys, dtype=np.uint16)
    np.left_shift(index[2 * third:3 * third], 8, out=high, dtype=np.uint16)
    np.bitwise_or(keys, high, out=keys)
    cube = np.bincount(keys, minlength=BINS ** 3).reshape(BINS, BINS, BINS)
    counts: np.ndarray = cube.sum(axis=(0, 1)) + cube.sum(axis=(0, 2)) + cube.sum(axis=(1, 2))
    if index.size > 3 * third:
        counts += np.bincount(index[3 * third:], minlength=BINS)
    return counts


def _scale(x: np.ndarray, k: int, out: np.ndarray) -> None:
    """``out = x * 2**-k``, exact (two factors where 2**-k itself is no ``x.dtype`` number)."""
    info = np.finfo(x.dtype)
    if -k <= info.maxexp - 1:
        np.multiply(x, x.dtype.type(math.ldexp(1.0, -k)), out=out)
    else:
        half = -k // 2
        np.multiply(x, x.dtype.type(math.ldexp(1.0, half)), out=out)
        np.multiply(out, x.dtype.type(math.ldexp(1.0, -k - half)), out=out)


def bin_values(x: np.ndarray, lo: float | int, hi: float | int, floor: int,
               scratch: Scratch) -> tuple[int, int, np.ndarray, float | int, float | int]:
    """Bin finite values ``x`` (min ``lo``, max ``hi``) on the grid of their own range:
    ``(k, j0, counts, lo, hi)``, ``counts[i]`` holding the values in bin ``j0 + i``."""
    k = grid_exponent(lo, hi, floor)
    j0 = floor_bin(lo, k)
    if lo == hi:  # one value: one bin
        counts = np.zeros(BINS, np.int64)
        counts[0] = x.size
        return k, j0, counts, lo, hi
    scratch.fit(x.size)
    index = scratch.index[:x.size]
    if x.dtype.kind in "biu":
        if k:
            shifted = scratch.buffer(x.dtype, x.size)
            np.right_shift(x, k, out=shifted)  # floor(x / 2**k): numpy's shift is arithmetic
            x = shifted
        np.copyto(index, x, casting="unsafe")  # bin numbers modulo 256 ...
        np.subtract(index, np.uint8(j0 & 0xFF), out=index)  # ... minus j0 modulo 256: 0..15 exactly
        return k, j0, _count(index, scratch), lo, hi
    y = scratch.buffer(x.dtype, x.size)
    _scale(x, k, y)
    np.floor(y, out=y)
    lost = 0
    tiny = math.ldexp(1.0, k + np.finfo(x.dtype).minexp - np.finfo(x.dtype).nmant)  # |x| below it may underflow
    if k >= 1 and lo < 0 and hi > -tiny:  # tiny negative values may have become -0.0 (bin 0): they are in bin -1
        if hi < 0:
            np.minimum(y, -1, out=y)  # every value is in bin -1 or below
        else:
            lost = int(np.count_nonzero((y == 0) & (x < 0)))
    if -128 <= j0 and j0 + BINS - 1 <= 127:
        np.copyto(index.view(np.int8), y, casting="unsafe")
        np.subtract(index, np.uint8(j0 & 0xFF), out=index)
    else:  # bin numbers and j0 within a factor of 2 (|j0| > 111): the float subtraction is exact
        np.subtract(y, y.dtype.type(j0), out=y)
        np.copyto(index, y, casting="unsafe")
    counts = _count(index, scratch)
    if lost:
        counts[-j0] -= lost
        counts[-1 - j0] += lost
    return k, j0, counts, lo, hi


class Histogram:
    """Counts on the grid of the range seen so far: ``add`` each piece's ``bin_values``, in any order."""

    def __init__(self, floor: int) -> None:
        self.floor = floor
        self.k: int | None = None
        self.j0 = 0
        self.lo: Any = None
        self.hi: Any = None
        self._counts = np.zeros(BINS, np.int64)

    def add(self, k: int, j0: int, counts: np.ndarray, lo: float | int, hi: float | int) -> None:
        """Merge a piece's counts (bins ``j0 ...`` of width 2**k; values in [lo, hi])."""
        if self.k is None:
            self.k, self.j0, self.lo, self.hi = k, j0, lo, hi
            self._counts = counts.astype(np.int64, copy=True)
            return
        self.lo, self.hi = min(self.lo, lo), max(self.hi, hi)
        wide = grid_exponent(self.lo, self.hi, self.floor)  # >= both k: the grid of a wider range is coarser
        start = floor_bin(self.lo, wide)
        merged = np.zeros(BINS, np.int64)
        for old_k, old_j0, old in ((self.k, self.j0, self._counts), (k, j0, counts)):
            for i in np.flatnonzero(old):
                merged[((old_j0 + int(i)) >> (wide - old_k)) - start] += old[i]
        self.k, self.j0, self._counts = wide, start, merged

    @property
    def counts(self) -> tuple[int, ...]:
        return () if self.k is None else tuple(int(c) for c in self._counts)

    @property
    def edges(self) -> tuple[float | int, ...]:
        """The BINS + 1 edges ``(j0 + i) * 2**k``: ints for integer values, else floats (exact; beyond
        float64's range, infinite)."""
        if self.k is None:
            return ()
        if isinstance(self.lo, int):
            return tuple((self.j0 + i) << self.k for i in range(BINS + 1))
        return tuple(edge(self.j0 + i, self.k) for i in range(BINS + 1))


def edge(j: int, k: int) -> float:
    """``j * 2**k`` as a float (exact; beyond float64's range, an infinity)."""
    try:
        return math.ldexp(float(j), k)
    except OverflowError:
        return math.copysign(math.inf, j)
