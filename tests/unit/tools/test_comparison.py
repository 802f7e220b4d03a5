"""ckpt.compare_values / ckpt.compare: the values measured, checked against a plain float64 oracle."""

from __future__ import annotations

import math

import numpy as np
import pytest

import ckpt
from ckpt.tools.valuediff import CHUNK, DOT, _dot, _Tally, compare_values


def oracle(a: np.ndarray, b: np.ndarray, atol: float, rtol: float) -> dict[str, float]:
    """What ValueDiff means, element by element in float64 (no chunks, no fast paths)."""
    xa, xb = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    with np.errstate(all="ignore"):
        neq = (xa != xb) & ~(np.isnan(xa) & np.isnan(xb))
        d = np.where(neq, np.abs(xa - xb), 0.0)
        d[np.isnan(d)] = np.inf
        rel = np.where(d == 0, 0.0, d / np.abs(xb))
        rel[np.isnan(rel)] = np.inf
        close = ~neq | (np.isfinite(d) & (d <= atol + rtol * np.abs(xb)))
    norm_d = math.sqrt(math.fsum((d * d).tolist()))
    norm_a = math.sqrt(math.fsum((xa[np.isfinite(xa)] ** 2).tolist()))
    rel_l2 = 0.0 if norm_d == 0 else math.inf if norm_a == 0 else norm_d / norm_a
    return {"unequal": int(neq.sum()), "outside": int((~close).sum()), "max_abs": float(d.max(initial=0.0)),
            "max_rel": float(rel.max(initial=0.0)), "rel_l2": rel_l2}


def noisy_pair(rng: np.random.Generator, n: int, dtype: type, special: bool) -> tuple[np.ndarray, np.ndarray]:
    """A and B = A plus a small step, with zeros, subnormals and (``special``) NaNs and Infs sprinkled in."""
    a = rng.standard_normal(n).astype(dtype)
    b = (a + rng.standard_normal(n) * 1e-3).astype(dtype)
    idx = rng.choice(n, 64, replace=False)
    tiny = np.finfo(dtype).smallest_subnormal
    b[idx[:8]] = 0.0  # moved onto zero: an infinite relative difference
    a[idx[8:16]] = b[idx[8:16]] = 0.0
    b[idx[16:24]] = tiny * 3
    a[idx[24:32]] = b[idx[24:32]]  # equal values
    big = np.finfo(dtype).max if dtype != np.float64 else 1e150  # float64: squares stay finite
    a[idx[32:34]] = big
    b[idx[32:34]] = -big  # a difference beyond float16's and float32's range
    if special:
        a[idx[40:44]] = b[idx[40:44]] = np.nan  # equal NaNs
        a[idx[44:46]] = np.nan
        b[idx[46:48]] = np.inf
        a[idx[48:50]] = b[idx[48:50]] = -np.inf
    return a, b


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("atol, rtol", [(0.0, 0.0), (1e-3, 0.0), (1e-4, 1e-2)])
def test_values_agree_with_a_float64_oracle(dtype, special, atol, rtol):
    rng = np.random.default_rng(29)
    a, b = noisy_pair(rng, 5 * CHUNK + 123, dtype, special)  # pieces on both threads, an odd end
    vd = compare_values(a, b, atol=atol, rtol=rtol)
    want = oracle(a, b, atol, rtol)
    assert vd.count == a.size
    assert (vd.unequal, vd.outside, vd.max_abs, vd.max_rel) == (
        want["unequal"], want["outside"], want["max_abs"], want["max_rel"])
    assert vd.rel_l2 == pytest.approx(want["rel_l2"], rel=1e-12)


def test_values_of_a_step_that_moves_every_value():
    rng = np.random.default_rng(7)
    a = rng.standard_normal(6 * CHUNK).astype(np.float32)
    b = a + np.float32(1e-3)
    vd = compare_values(a, b)
    want = oracle(a, b, 0.0, 0.0)
    assert vd.unequal == vd.outside == a.size
    assert (vd.max_abs, vd.max_rel) == (want["max_abs"], want["max_rel"])
    assert vd.rel_l2 == pytest.approx(want["rel_l2"], rel=1e-12)
    assert vd.rel_l2 == pytest.approx(1e-3, rel=1e-2)  # each value moved 1e-3, values of std 1


def test_relative_l2_change():
    assert compare_values(np.array([3.0, 4.0]), np.array([3.0, 4.0])).rel_l2 == 0.0
    assert compare_values(np.array([3.0, 4.0]), np.array([3.0, 4.5])).rel_l2 == pytest.approx(0.1)
    assert compare_values(np.zeros(3), np.zeros(3)).rel_l2 == 0.0
    assert compare_values(np.zeros(3), np.array([0.0, 1.0, 0.0])).rel_l2 == math.inf  # from nothing
    assert compare_values(np.array([1.0, np.nan]), np.array([1.0, np.nan])).rel_l2 == 0.0
    assert compare_values(np.array([1.0, np.nan]), np.array([1.0, 2.0])).rel_l2 == math.inf
    assert compare_values(np.array([1 + 1j]), np.array([1 - 1j])).rel_l2 == pytest.approx(2 / math.sqrt(2))
    assert compare_values(np.array([3, 4], np.int32), np.array([3, 5], np.int32)).rel_l2 == pytest.approx(0.2)
    assert compare_values(np.array([b"x"], object), np.array([b"y"], object)).rel_l2 is None


def test_compare_reports_relative_l2_per_tensor(tmp_path):
    a, b = str(tmp_path / "a.h5"), str(tmp_path / "b.msgpack")
    ckpt.Saver({"w": ckpt.Variable(np.array([3.0, 4.0], np.float32))}).save(a)
    ckpt.Saver({"w": ckpt.Variable(np.array([3.0, 4.5], np.float32))}).save(b)
    values = ckpt.compare(a, b).tensor("w").values
    assert values is not None and values.rel_l2 == pytest.approx(0.1)
    assert values.to_json()["rel_l2"] == pytest.approx(0.1)


@pytest.mark.parametrize("changed", [slice(-1000, None), slice(0, 1000)])
def test_relative_l2_over_chunks_that_agree_and_chunks_that_differ(tmp_path, changed):
    """A 12 MiB tensor streams in two chunks: the norm of A counts the chunk that agrees bit for bit too."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal(3 << 20).astype(np.float32)
    b = a.copy()
    b[changed] += np.float32(0.5)
    pa, pb = str(tmp_path / "a.msgpack"), str(tmp_path / "b.h5")
    ckpt.Saver({"w": ckpt.Variable(a)}).save(pa)
    ckpt.Saver({"w": ckpt.Variable(b)}).save(pb)
    values = ckpt.compare(pa, pb).tensor("w").values
    want = oracle(a, b, 0.0, 0.0)
    assert values is not None and (values.unequal, values.max_abs, values.max_rel) == (
        want["unequal"], want["max_abs"], want["max_rel"])
    assert values.rel_l2 == pytest.approx(want["rel_l2"], rel=1e-12)


def test_sums_of_squares_are_the_blockwise_dot_products_added_in_order():
    """_dot's vecdot over rows gives the bits of DOT-element np.dot calls added one after another."""
    rng = np.random.default_rng(11)
    order = np.zeros(9 * DOT)
    order[::DOT] = 2.0 ** -27  # 1 + 2 ** -54 + ... rounds to 1 at each step in order (fsum: 1 + 2 ** -51)
    order[0] = 1.0
    cases = [rng.standard_normal(n) * 10.0 ** rng.integers(-20, 20, n) for n in (0, 5, DOT, 3 * DOT, 8 * DOT + 77)]
    for x in cases + [order]:
        n = x.size
        want = 0.0
        for i in range(0, n, DOT):
            want += float(np.dot(x[i:i + DOT], x[i:i + DOT]))
        assert _dot(x) == want


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_pieces_whose_relative_difference_is_bounded_are_skipped_without_losing_the_max(dtype):
    """Pieces in order on one thread: the first sets max rel; the second cannot pass it (its min |b| is
    large) and is skipped; the third holds a small |b| that beats it; the fourth a value moved onto 0."""
    step = 1024
    rng = np.random.default_rng(5)
    a = (rng.uniform(1, 2, 4 * step) * rng.choice([-1, 1], 4 * step)).astype(dtype)
    b = a.copy()
    b[:step] += dtype(0.25)  # piece 0: max rel about 0.25
    b[step:2 * step] -= dtype(0.125)  # piece 1: bound 0.125 / min |b| < 0.25
    b[2 * step + 7] = dtype(2.0 ** -10)  # piece 2: max rel about 2 ** 11
    b[2 * step + 9] = -b[2 * step + 9]
    want = oracle(a, b, 0.0, 0.0)
    vd = compare_values(a, b, step=step)
    assert (vd.unequal, vd.outside, vd.max_abs, vd.max_rel) == (
        want["unequal"], want["outside"], want["max_abs"], want["max_rel"])
    b[3 * step + 1] = 0.0  # piece 3: an infinite relative difference
    vd = compare_values(a, b, step=step)
    assert vd.max_rel == math.inf == oracle(a, b, 0.0, 0.0)["max_rel"]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_signed_zeros_and_subnormals_on_the_fast_path(dtype):
    tiny = np.finfo(dtype).smallest_subnormal
    a = np.array([0.0, -0.0, tiny, 2 * tiny, -tiny, 1.0, tiny, 0.0] * 512, dtype)
    b = np.array([-0.0, 0.0, tiny, tiny, tiny, 1.0, 0.0, -tiny] * 512, dtype)
    want = oracle(a, b, 0.0, 0.0)
    for atol, rtol in ((0.0, 0.0), (0.0, 0.5)):
        vd = compare_values(a, b, atol, rtol, step=1024)
        want = oracle(a, b, atol, rtol)
        assert (vd.unequal, vd.outside, vd.max_abs, vd.max_rel) == (
            want["unequal"], want["outside"], want["max_abs"], want["max_rel"])
        assert vd.unequal == 4 * 512  # -0.0 == 0.0
        assert vd.max_rel == math.inf
        assert vd.rel_l2 == pytest.approx(want["rel_l2"], rel=1e-12)


def test_a_float64_difference_past_the_range_takes_the_exact_path():
    a = np.full(3000, 1e308)
    b = np.full(3000, 1.0)
    b[1234] = -1e308  # 2e308 overflows: an infinite difference
    vd = compare_values(a, b, step=1024)
    with np.errstate(over="ignore"):  # the oracle's squares overflow too
        want = oracle(a, b, 0.0, 0.0)
    assert (vd.unequal, vd.max_abs, vd.max_rel) == (want["unequal"], math.inf, want["max_rel"])


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.uint16, np.int64, "bfloat16"])
def test_integer_and_bfloat16_values_agree_with_the_oracle(dtype):
    rng = np.random.default_rng(17)
    dtype = ckpt.dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    a = rng.integers(0, 100, 5 * 1024).astype(dtype)
    b = a.copy()
    b[::3] = b[::3] + dtype.type(1)
    b[5] = 0
    vd = compare_values(a, b, step=1024)
    want = oracle(a, b, 0.0, 0.0)
    assert (vd.unequal, vd.outside, vd.max_abs, vd.max_rel) == (
        want["unequal"], want["outside"], want["max_abs"], want["max_rel"])
    assert vd.rel_l2 == pytest.approx(want["rel_l2"], rel=1e-12)


def test_the_next_tensors_tally_reuses_the_scratch_buffers_and_each_thread_keeps_its_own():
    f64 = np.dtype(np.float64)
    first = _Tally()
    second = first.next()
    assert np.shares_memory(first.scratch("d", f64, 10), second.scratch("d", f64, 10))
    assert np.shares_memory(first.helper().scratch("d", f64, 10), second.helper().scratch("d", f64, 10))
    assert not np.shares_memory(second.scratch("d", f64, 10), second.helper().scratch("d", f64, 10))
    assert (second.count, second.max_rel, second.sum_d2) == (0, 0.0, 0.0)  # nothing of the first carried over


def test_compare_of_several_tensors_gives_each_its_own_figures(tmp_path):
    rng = np.random.default_rng(23)
    big = [rng.standard_normal(5 * CHUNK).astype(np.float32) for _ in range(3)]
    moved = [big[0] + np.float32(1e-3), big[1].copy(), big[2] * np.float32(2)]
    moved[1][77] = 0.0
    a, b = str(tmp_path / "a.h5"), str(tmp_path / "b.msgpack")
    ckpt.Saver({f"t{i}": ckpt.Variable(x) for i, x in enumerate(big)}).save(a)
    ckpt.Saver({f"t{i}": ckpt.Variable(x) for i, x in enumerate(moved)}).save(b)
    result = ckpt.compare(a, b)
    for i in range(3):
        values = result.tensor(f"t{i}").values
        assert values == compare_values(big[i], moved[i])


def test_relative_l2_has_the_bits_of_each_thread_summing_a_fixed_half_in_order():
    """The two threads take pieces as they come; the sums are still added as a fixed half each (piece
    order), so rel_l2 has the same bits on every run whatever the timing."""
    step, pieces = 1024, 37
    rng = np.random.default_rng(31)
    scale = np.repeat(10.0 ** rng.uniform(-8, 8, pieces), step)  # the order of the additions shows in the bits
    a = (rng.standard_normal(step * pieces) * scale).astype(np.float32)
    b = (a + rng.standard_normal(a.size) * scale * 1e-3).astype(np.float32)
    xa, d = a.astype(np.float64), a.astype(np.float64) - b.astype(np.float64)
    sums = {"a": [0.0, 0.0], "d": [0.0, 0.0]}
    for k in range(pieces):
        part = slice(k * step, (k + 1) * step)
        sums["a"][k >= pieces // 2] += _dot(xa[part])
        sums["d"][k >= pieces // 2] += _dot(d[part])
    want = math.sqrt(sums["d"][0] + sums["d"][1]) / math.sqrt(sums["a"][0] + sums["a"][1])
    for _ in range(5):
        assert compare_values(a, b, step=step).rel_l2 == want


def test_values_across_dtypes_agree_with_the_oracle():
    """float32 against float16 of one shape: compared in float64 element by element (no fast path)."""
    rng = np.random.default_rng(43)
    a, _ = noisy_pair(rng, 5 * 1024 + 7, np.float32, special=True)
    with np.errstate(over="ignore"):  # float32's largest values are float16's infinities
        b = a.astype(np.float16)
        want = oracle(a, b, 0.0, 0.0)
    vd = compare_values(a, b, step=1024)
    assert (vd.unequal, vd.outside, vd.max_abs, vd.max_rel) == (
        want["unequal"], want["outside"], want["max_abs"], want["max_rel"])
    assert vd.rel_l2 == pytest.approx(want["rel_l2"], rel=1e-12)
