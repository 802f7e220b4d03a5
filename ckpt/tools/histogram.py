"""The statistics' histogram: 16 bins of width 2**k on the absolute grid [j * 2**k, (j + 1) * 2**k).

``k`` is the smallest exponent for which the values' [min, max] spans at most 16 bins (so 8 to 16
bins hold values, and the edges are binary numbers a person can read), never below the resolution
of the values (integers: bins of width 1 at least; floats: ``2**k`` at least the dtype's smallest
subnormal and at least ``max|value| * 2**-48``, so every edge is an exact float64; zeros alone get
bins of width 1, not a subnormal's). The first bin is the one holding min.

Built in one streaming pass: each piece of a tensor is binned on the grid of the range seen so
far (or of its own range, where it reaches beyond), and grids merge exactly into the grid of a
wider range, because a bin number on a grid twice as coarse is ``floor(floor(x / w) / 2) =
floor(x / 2w)`` (``j >> 1``). A float piece's bin numbers are ``floor(x * 2**-k)``: multiplying
by a power of two and rounding down are exact in floating point, except that a tiny negative
value can underflow to -0.0 (corrected: it belongs to bin -1); integers bin by an arithmetic
shift. A piece's values span at most 16 bins, so a bin number modulo 16 (its nibble) names its
bin: three nibbles make a 12-bit key and one ``bincount`` of 4096 bins counts the piece (numpy's
counting loop costs about 1 ns per key, so three values per key cost a third of it); pieces on
one grid add their key counts, which are reduced to 16 counts once, at the end.

Example:
    >>> import numpy as np
    >>> h = Histogram(exponent_floor(np.dtype(np.float32)))
    >>> h.add(bin_values(np.array([0.1, 0.7, 1.0], np.float32), 0.1, 1.0, h.floor, Scratch()))
    >>> h.edges[:2], h.edges[-1], h.counts
    ((0.0625, 0.125), 1.0625, (1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1))
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

__all__ = ["BINS", "Histogram", "Scratch", "bin_values", "exponent_floor", "fits", "floor_bin", "grid_exponent"]

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
    try:  # scaling by 2**-k is exact but where it underflows (then the bin is 0 or -1), and cheaper than a ratio
        scaled = math.ldexp(value, -k)
    except OverflowError:
        pass
    else:
        return -1 if scaled == 0 and value < 0 else math.floor(scaled)  # -0.0: a tiny negative value underflowed
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


def fits(lo: float | int, hi: float | int, k: int, floor: int) -> bool:
    """Whether ``grid_exponent(lo, hi, floor) <= k`` (two bin numbers: cheaper than finding the grid)."""
    top = max(abs(lo), abs(hi))
    if isinstance(lo, float) and top:
        floor = max(floor, math.frexp(top)[1] - 1 - _PRECISION)
    return k >= floor and floor_bin(hi, k) - floor_bin(lo, k) < BINS


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


def _keys(index: np.ndarray, scratch: Scratch) -> np.ndarray:
    """How many times each key ``a | b << 4 | c << 8`` occurs, ``a``, ``b``, ``c`` the bin nibbles of
    the first, second and third third of ``index`` (uint8 values below 16): a 4096-count array."""
    third = index.size // 3
    keys, high = scratch.keys[0, :third], scratch.keys[1, :third]
    np.left_shift(index[third:2 * third], 4, out=keys, dtype=np.uint16)
    np.bitwise_or(keys, index[:third], out=keys, dtype=np.uint16)
    np.left_shift(index[2 * third:3 * third], 8, out=high, dtype=np.uint16)
    np.bitwise_or(keys, high, out=keys)
    return np.bincount(keys, minlength=BINS ** 3)


def _nibbles(keys: np.ndarray) -> np.ndarray:
    """Counts per bin nibble from a 4096-count array of ``_keys`` (each key holds three values)."""
    rows = keys.reshape(BINS, BINS * BINS)
    low = np.add.reduce(rows, axis=0).reshape(BINS, BINS)  # [b, a]
    out: np.ndarray = np.add.reduce(rows, axis=1) + np.add.reduce(low, axis=0) + np.add.reduce(low, axis=1)
    return out


_LIMITS: dict[np.dtype, tuple[int, int]] = {}


def _limits(dtype: np.dtype) -> tuple[int, int]:
    """(largest exponent of a finite power of two, exponent of the smallest subnormal) of a float dtype."""
    found = _LIMITS.get(dtype)
    if found is None:
        info = np.finfo(dtype)
        found = _LIMITS[dtype] = (int(info.maxexp) - 1, int(info.minexp) - int(info.nmant))
    return found


def _scale(x: np.ndarray, k: int, out: np.ndarray) -> None:
    """``out = x * 2**-k``, exact (two factors where 2**-k itself is no ``x.dtype`` number)."""
    if -k <= _limits(x.dtype)[0]:
        np.multiply(x, x.dtype.type(math.ldexp(1.0, -k)), out=out)
    else:
        half = -k // 2
        np.multiply(x, x.dtype.type(math.ldexp(1.0, half)), out=out)
        np.multiply(out, x.dtype.type(math.ldexp(1.0, -k - half)), out=out)


class Bins(NamedTuple):
    """A piece's histogram on the grid of width 2**k, by bin nibble (bin number j modulo 16): ``keys``
    (a ``_keys`` array, or None) plus ``extra`` (16 counts). Its values, in [lo, hi], span at most 16
    bins, so a nibble names one bin."""

    k: int
    lo: float | int
    hi: float | int
    keys: np.ndarray | None
    extra: np.ndarray


def bin_values(x: np.ndarray, lo: float | int, hi: float | int, floor: int, scratch: Scratch,
               hint: int | None = None) -> Bins:
    """Bin finite values ``x`` (min ``lo``, max ``hi``) on the grid of their own range, or on the
    coarser grid 2**``hint`` (pieces binned on one grid add up without regridding)."""
    if hint is not None and fits(lo, hi, hint, floor):  # the usual case: the piece lies on the grid so far
        k = hint
    else:
        k = grid_exponent(lo, hi, floor)
        k = k if hint is None else max(k, hint)
    extra = np.zeros(BINS, np.int64)
    if lo == hi:  # one value: one bin
        extra[floor_bin(lo, k) & (BINS - 1)] = x.size
        return Bins(k, lo, hi, None, extra)
    scratch.fit(x.size)
    index = scratch.index[:x.size]
    lost = 0
    if x.dtype.kind in "biu":
        if k:
            shifted = scratch.buffer(x.dtype, x.size)
            np.right_shift(x, k, out=shifted)  # floor(x / 2**k): numpy's shift is arithmetic
            x = shifted
        np.copyto(index, x, casting="unsafe")  # bin numbers modulo 256
    else:
        y = scratch.buffer(x.dtype, x.size)
        _scale(x, k, y)
        np.floor(y, out=y)
        tiny = math.ldexp(1.0, k + _limits(x.dtype)[1])  # a value of |x| below it may underflow to -0.0
        if k >= 1 and lo < 0 and hi > -tiny:  # tiny negative values may be in bin 0 instead of -1
            if hi < 0:
                np.minimum(y, -1, out=y)  # every value is in bin -1 or below
            else:
                lost = int(np.count_nonzero((y == 0) & (x < 0)))
        j0 = floor_bin(lo, k)
        if -128 <= j0 and j0 + BINS - 1 <= 127:
            np.copyto(index.view(np.int8), y, casting="unsafe")  # bin numbers modulo 256
        else:  # minus a multiple of 16 within 31 of them: exact (both large, within a factor of 2)
            np.subtract(y, y.dtype.type(j0 - (j0 & (BINS - 1))), out=y)
            np.copyto(index, y, casting="unsafe")
    np.bitwise_and(index, BINS - 1, out=index)  # the bin nibble
    keys = _keys(index, scratch)
    for nibble in index[3 * (index.size // 3):].tolist():  # at most two values: no numpy call for them
        extra[nibble] += 1
    if lost:  # bin 0 -> bin -1
        extra[0] -= lost
        extra[BINS - 1] += lost
    return Bins(k, lo, hi, keys, extra)


class Histogram:
    """Counts on the grid of the range seen so far: ``add`` each piece's ``bin_values``, in any order."""

    def __init__(self, floor: int) -> None:
        self.floor = floor
        self.k: int | None = None
        self.lo: Any = None
        self.hi: Any = None
        self._keys: np.ndarray | None = None
        self._extra = np.zeros(BINS, np.int64)

    def add(self, bins: Bins) -> None:
        """Merge a piece's counts."""
        if self.k is None:
            self.k, self.lo, self.hi = bins.k, bins.lo, bins.hi
            self._keys = None if bins.keys is None else bins.keys.copy()
            self._extra = bins.extra.copy()
            return
        lo, hi = min(self.lo, bins.lo), max(self.hi, bins.hi)
        # >= both k: the grid of a wider range is coarser (so where self.k fits the range, it is the grid)
        wide = self.k if fits(lo, hi, self.k, self.floor) else grid_exponent(lo, hi, self.floor)
        if wide == self.k == bins.k:  # one grid, still at most 16 bins: nibbles add up
            if bins.keys is not None:
                self._keys = bins.keys.copy() if self._keys is None else np.add(self._keys, bins.keys,
                                                                                out=self._keys)
            self._extra += bins.extra
            self.lo, self.hi = lo, hi
            return
        merged = np.zeros(BINS, np.int64)  # by nibble on the wide grid (j >> d: the bin twice, ... as wide)
        for k, pairs in ((self.k, self._bins()), (bins.k, _bins_of(bins.k, bins.lo, bins.keys, bins.extra))):
            for j, count in pairs:
                merged[(j >> (wide - k)) & (BINS - 1)] += count
        self.k, self.lo, self.hi = wide, lo, hi
        self._keys, self._extra = None, merged

    def _bins(self) -> list[tuple[int, int]]:
        assert self.k is not None
        return _bins_of(self.k, self.lo, self._keys, self._extra)

    @property
    def counts(self) -> tuple[int, ...]:
        if self.k is None:
            return ()
        start = floor_bin(self.lo, self.k)
        counts = [0] * BINS
        for j, count in self._bins():
            counts[j - start] += count
        return tuple(counts)

    @property
    def edges(self) -> tuple[float | int, ...]:
        """The BINS + 1 edges ``(j0 + i) * 2**k``: ints for integer values, else floats (exact; beyond
        float64's range, infinite)."""
        if self.k is None:
            return ()
        k = self.k
        if self.lo == self.hi == 0:  # only zeros: bins of 1 as for integers, not of the smallest subnormal
            k = max(k, 0)
        j0 = floor_bin(self.lo, k)
        if isinstance(self.lo, int):
            return tuple((j0 + i) << k for i in range(BINS + 1))
        return tuple(edge(j0 + i, k) for i in range(BINS + 1))


def _bins_of(k: int, lo: float | int, keys: np.ndarray | None, extra: np.ndarray) -> list[tuple[int, int]]:
    """(bin number, count) of the non-empty bins of nibble counts whose values start at ``lo``."""
    nibbles = extra if keys is None else extra + _nibbles(keys)
    j0 = floor_bin(lo, k)
    return [(j0 + (int(n) - j0) % BINS, int(nibbles[n])) for n in np.flatnonzero(nibbles)]


def edge(j: int, k: int) -> float:
    """``j * 2**k`` as a float (exact; beyond float64's range, an infinity)."""
    try:
        return math.ldexp(float(j), k)
    except OverflowError:
        return math.copysign(math.inf, j)
