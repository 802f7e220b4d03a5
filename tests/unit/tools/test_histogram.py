"""ckpt.tools.histogram: the exact bin arithmetic behind the statistics' histogram; how the statistics
share a chunk's pieces between two threads."""

from __future__ import annotations

import fractions
import math
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.tools import stats
from ckpt.tools.histogram import fits, floor_bin, grid_exponent

TINY, BIG = 5e-324, 1.7976931348623157e308


def exact_floor_bin(value: float | int, k: int) -> int:
    return math.floor(fractions.Fraction(value) / fractions.Fraction(2) ** k)


@pytest.mark.parametrize(("value", "k", "expected"), [
    (-TINY, 1, -1),  # scaling underflows to -0.0: still bin -1
    (-TINY, 2000, -1), (TINY, 2000, 0), (-0.0, 5, 0), (0.0, -1074, 0),
    (-1e-310, 3, -1), (1e-310, 3, 0),  # subnormal after scaling
    (BIG, -1074, int(BIG) << 1074), (-BIG, -60, -(int(BIG) << 60)),  # past float64's range: exact integers
    (-3.5, 1, -2), (3.5, 1, 1), (-4.0, 2, -1), (2.0 ** 60 + 2.0 ** 8, 8, 2 ** 52 + 1),
])
def test_floor_bin_is_exact_where_scaling_underflows_or_overflows(value, k, expected):
    assert floor_bin(value, k) == expected == exact_floor_bin(value, k)


@settings(max_examples=300, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False), st.integers(-1100, 1100))
def test_floor_bin_of_any_float_is_the_exact_floor(value, k):
    assert floor_bin(value, k) == exact_floor_bin(value, k)


def _ranges() -> st.SearchStrategy[tuple[float, float, int]]:
    floats = st.floats(allow_nan=False, allow_infinity=False)
    return st.tuples(floats, floats, st.sampled_from([-1074, -149, -24, 0])).map(
        lambda t: (min(t[0], t[1]), max(t[0], t[1]), t[2]))


@settings(max_examples=300, deadline=None)
@given(_ranges(), st.integers(-1100, 1100))
def test_fits_says_whether_the_grid_is_at_most_k(lohi_floor, k):
    lo, hi, floor = lohi_floor
    assert fits(lo, hi, k, floor) == (grid_exponent(lo, hi, floor) <= k)


@settings(max_examples=200, deadline=None)
@given(st.integers(-2 ** 64, 2 ** 64), st.integers(-2 ** 64, 2 ** 64), st.integers(0, 70))
def test_fits_of_integer_ranges(a, b, k):
    lo, hi = min(a, b), max(a, b)
    assert fits(lo, hi, k, 0) == (grid_exponent(lo, hi, 0) <= k)


def test_pieces_shared_by_two_threads_come_back_in_order_once_each():
    """stats._on_both: each thread takes the next piece as it finishes one; results stay in piece order."""
    chunk = np.arange(1000, dtype=np.float32)

    def work(pieces):
        return [(int(p[0]), p.size, threading.get_ident()) for p in pieces]

    got = stats._on_both(chunk, 7, work)
    assert [(first, size) for first, size, _ in got] == [(s, min(7, 1000 - s)) for s in range(0, 1000, 7)]
    assert stats._on_both(chunk[:5], 7, work)[0][:2] == (0, 5)  # one piece: this thread alone
