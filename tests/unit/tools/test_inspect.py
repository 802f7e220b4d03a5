"""ckpt.tools.inspect: print_tensors_in_checkpoint_file, parameter counts, statistics, the JSON view."""

from __future__ import annotations

import dataclasses
import fractions
import json
import math
import warnings

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from conftest import every_dtype_tensors

import ckpt
from ckpt.tools import inspect, stats
from ckpt.cli import main
from ckpt.formats.base import TensorInfo


@pytest.fixture
def path(tmp_path) -> str:
    variables = {"enc/kernel": ckpt.Variable(np.arange(6, dtype=np.float32).reshape(2, 3)),
                 "enc/bias": ckpt.Variable(np.zeros(3, np.float32)), "step": ckpt.Variable(np.int64(9)),
                 "vocab": ckpt.Variable([b"a", b"b"])}
    return ckpt.Saver(variables).save(tmp_path / "m.msgpack")


def cli_stdout(*args: str) -> str:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0
    return result.stdout


@pytest.mark.parametrize("kwargs, cli_args", [
    (dict(tensor_name="", all_tensors=False), []),
    (dict(tensor_name=None, all_tensors=False), []),
    (dict(tensor_name="enc/kernel", all_tensors=False), ["--tensor", "enc/kernel"]),
    (dict(tensor_name="", all_tensors=True), ["--all-tensors"]),
    (dict(tensor_name="", all_tensors=False, all_tensor_names=True), ["--names-only"]),
    (dict(tensor_name="", all_tensors=False, count_exclude_pattern="^enc/"), ["--exclude", "^enc/"]),
])
def test_prints_what_the_cli_prints(path, capsys, kwargs, cli_args):
    ckpt.print_tensors_in_checkpoint_file(path, **kwargs)
    assert capsys.readouterr().out == cli_stdout("inspect", path, *cli_args)


def test_tensorflow_style_output(path, capsys):
    ckpt.print_tensors_in_checkpoint_file(path, "step", False)
    assert capsys.readouterr().out == "tensor: step (int64) []\n9\n# Total number of params: 12\n"


def test_unknown_tensor_raises_with_the_closest_keys(path):
    with pytest.raises(ckpt.KeyNotFoundError) as info:
        ckpt.print_tensors_in_checkpoint_file(path, "enc/kernl", False)
    assert str(info.value) == f"Tensor enc/kernl not found in checkpoint {path}; closest keys: enc/kernel"


def test_conflicting_views_raise(path):
    with pytest.raises(ValueError, match="choose one of"):
        ckpt.print_tensors_in_checkpoint_file(path, "step", True)
    with pytest.raises(ValueError, match="choose one of"):
        ckpt.print_tensors_in_checkpoint_file(path, "", True, all_tensor_names=True)


def test_missing_checkpoint_raises(tmp_path):
    with pytest.raises(ckpt.CheckpointNotFoundError):
        ckpt.print_tensors_in_checkpoint_file(tmp_path / "none.h5", "", False)


def test_count_params():
    f32 = np.dtype(np.float32)
    infos = {"scalar": TensorInfo("scalar", f32, (), 4), "w": TensorInfo("w", f32, (3, 4), 48),
             "empty": TensorInfo("empty", f32, (0, 7), 0), "s": TensorInfo("s", np.dtype(object), (5,), 20)}
    assert inspect.count_params(infos) == inspect.ParamCount(18)
    assert inspect.count_params(infos, "^(w|s)$") == inspect.ParamCount(1, 2, 17)


def test_dtype_label_falls_back_to_numpy_for_foreign_dtypes():
    import ml_dtypes

    assert inspect.dtype_label(ckpt.dtypes.bfloat16) == "bfloat16"
    assert inspect.dtype_label(np.dtype(ml_dtypes.float8_e4m3fn)) == "float8_e4m3fn"


def test_float_stats_skip_non_finite_values():
    s = stats.array_stats(np.array([[1.0, np.nan], [np.inf, -3.0], [0.0, -np.inf]], np.float16))
    assert (s.kind, s.count, s.nan, s.inf, s.zeros, s.min, s.max) == ("float", 6, 1, 2, 1, -3.0, 1.0)
    assert s.mean == pytest.approx(-2 / 3) and s.std == pytest.approx(np.std([1.0, -3.0, 0.0]))
    assert sum(s.histogram) == 3 and s.nonfinite


def _finite(values: np.ndarray) -> list:
    """The finite values as exact Python numbers (ints stay ints; complex: magnitudes)."""
    if values.dtype.kind in "biu":
        return [int(v) for v in values.reshape(-1).tolist()]
    if values.dtype.kind == "O":
        return [len(v) for v in values.reshape(-1)]
    mags = np.abs(values) if values.dtype.kind == "c" else values
    as64 = mags.astype(np.float64).reshape(-1)
    return as64[np.isfinite(as64)].tolist()


def _resolution(values: np.ndarray) -> int:
    """The smallest bin exponent for a dtype: 0 for integers, the smallest subnormal's for floats."""
    import ml_dtypes

    if values.dtype.kind in "biuO":
        return 0
    dtype = np.abs(values).dtype if values.dtype.kind == "c" else values.dtype
    return math.frexp(float(ml_dtypes.finfo(dtype).smallest_subnormal))[1] - 1


def _expected_histogram(values: np.ndarray) -> tuple[list[int], list]:
    """The histogram by brute force from its definition, in exact arithmetic: the smallest k (at least
    the dtype's resolution; for floats at least exponent(max|x|) - 48; for zeros only, 0) for which
    [min, max] spans at most 16 bins of [j * 2**k, (j + 1) * 2**k); counts by exact comparison with
    the edges."""
    finite = _finite(values)
    exact = [fractions.Fraction(x) for x in finite]
    lo, hi = min(exact), max(exact)
    k = _resolution(values)
    if values.dtype.kind not in "biuO" and max(abs(lo), abs(hi)):
        k = max(k, math.frexp(float(max(abs(lo), abs(hi))))[1] - 1 - 48)
    if lo == hi == 0:
        k = max(k, 0)
    while math.floor(hi / fractions.Fraction(2) ** k) - math.floor(lo / fractions.Fraction(2) ** k) >= 16:
        k += 1
    width = fractions.Fraction(2) ** k
    j0 = math.floor(lo / width)
    edges = [(j0 + i) * width for i in range(17)]
    counts = [sum(1 for x in exact if edges[i] <= x < edges[i + 1]) for i in range(16)]
    return counts, edges


def _check_histogram(s: stats.TensorStats, values: np.ndarray) -> None:
    counts, edges = _expected_histogram(values)
    assert list(s.histogram) == counts and sum(counts) == len(_finite(values))
    for got, want in zip(s.histogram_edges, edges, strict=True):
        if math.isfinite(got):
            assert fractions.Fraction(got) == want
        else:  # beyond float64's range: an infinity of the edge's sign
            assert abs(want) >= 2 ** 1024 and (got > 0) == (want > 0)
    if values.dtype.kind not in "biuO" and all(math.isfinite(e) for e in s.histogram_edges):
        as64 = np.array(_finite(values))  # numpy agrees, given the same edges
        assert list(s.histogram) == np.histogram(as64, bins=np.array(s.histogram_edges))[0].tolist()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ckpt.dtypes.bfloat16, np.int16, np.uint8])
def test_chunked_stats_match_numpy(dtype):
    rng = np.random.default_rng(1)
    values = (rng.standard_normal(100) * 50).astype(dtype) if np.dtype(dtype).kind != "u" else \
        rng.integers(0, 255, 100).astype(dtype)
    s = stats.array_stats(values, piece=7)  # many pieces, the last one short
    as64 = values.astype(np.float64)
    assert (s.min, s.max) == (as64.min(), as64.max())
    assert s.mean == pytest.approx(as64.mean(), rel=1e-12)
    assert s.std == pytest.approx(as64.std(), rel=1e-9)
    assert list(s.histogram) == np.histogram(as64, bins=np.array(s.histogram_edges, np.float64))[0].tolist()
    _check_histogram(s, values)
    assert s.zeros == np.count_nonzero(as64 == 0)


def test_histogram_bins_are_powers_of_two_on_the_absolute_grid():
    s = stats.array_stats(np.array([0.3, -0.2, 1.9], np.float32))
    width = s.histogram_edges[1] - s.histogram_edges[0]
    assert width == 0.25 and s.histogram_edges[0] == -0.25 and s.histogram_edges[-1] == 3.75
    assert s.histogram == (1, 0, 1, 0, 0, 0, 0, 0, 1) + (0,) * 7  # -0.2 in [-0.25, 0), 0.3 in [0.25, 0.5)
    i = stats.array_stats(np.array([5, 100, 37], np.int32))
    assert i.histogram_edges[:3] == (0, 8, 16) and i.histogram_edges[-1] == 128 and i.histogram[0] == 1
    assert stats.array_stats(np.arange(16, dtype=np.uint8)).histogram == (1,) * 16  # width 1: one value a bin
    assert stats.array_stats(np.arange(17, dtype=np.uint8)).histogram == (2,) * 8 + (1,) + (0,) * 7


DTYPES = [np.float32, np.float64, np.float16, ckpt.dtypes.bfloat16, "float8_e4m3fn", "float8_e5m2", np.int8,
          np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64, np.bool_, np.complex64,
          np.complex128]


def _as(dtype) -> np.dtype:
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, dtype)) if isinstance(dtype, str) else np.dtype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: _as(d).name)
@pytest.mark.parametrize("piece", [5, 64, 1 << 17])
def test_histogram_on_and_beside_the_edges_of_every_dtype(dtype, piece):
    """Values on the grid's edges and on their neighbours (either side, in the tensor's own dtype)
    land where exact arithmetic puts them, in pieces of any size merged in any grid."""
    dtype = _as(dtype)
    rng = np.random.default_rng(7)
    if dtype.kind == "b":
        values = rng.random(300) > 0.3
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        grid = np.array([info.min, info.max, 0, 1, -1, 15, 16, 17, 255, 256, -256, 4096], dtype=object)
        grid = np.array([g for g in grid if info.min <= g <= info.max] * 3, dtype=object)
        values = np.concatenate([grid, rng.integers(info.min, info.max, 200, dtype=dtype, endpoint=True)])
        values = values.astype(dtype)
    else:
        real = np.float32 if dtype.kind == "c" and dtype.itemsize == 8 else dtype
        real = np.float64 if dtype.kind == "c" and dtype.itemsize == 16 else real
        edges = np.array([j * 2.0 ** k for k in (-3, 0, 2) for j in range(-9, 10)])
        near = np.concatenate([edges, np.nextafter(edges.astype(real), np.inf).astype(np.float64),
                               np.nextafter(edges.astype(real), -np.inf).astype(np.float64)])
        near = near[np.isfinite(near.astype(real).astype(np.float64))]
        values = np.concatenate([near, rng.standard_normal(200)]).astype(real)
        if dtype.kind == "c":
            values = (values + 1j * values[::-1]).astype(dtype)
    values = rng.permutation(values)
    s = stats.array_stats(values, piece=piece)
    _check_histogram(s, values)
    whole = stats.array_stats(values, piece=1 << 18)  # one piece: the same figures
    assert dataclasses.replace(whole, mean=0, std=0) == dataclasses.replace(s, mean=0, std=0)
    assert whole.mean == pytest.approx(s.mean, rel=1e-12, abs=1e-300)


@pytest.mark.parametrize("values", [
    np.array([-1e-45, 1000.0, 0.0, -0.0, 5e-45], np.float32),  # tiny negatives underflow to -0.0 when scaled
    np.array([-1e-45, -1000.0, -3e-45], np.float32),  # ... and every value negative
    np.array([-5e-324, 1e300, 5e-324, -0.0]),
    np.array([-4.9e-324, -1e-310]),  # subnormals only
    np.array([1e-40, 3e-40, 1.1754942e-38], np.float32),  # subnormal float32 and the smallest normal
    np.array([-0.0, 0.0, -0.0], np.float32),  # one value (-0.0 == 0.0)
    np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max], np.float32),
    np.array([1.0, np.nextafter(1.0, 2.0)]),  # a range of one ulp of float64: bins no finer than 2**-48
    np.array([1.0, np.nextafter(np.float32(1), np.float32(2))], np.float32),
    np.array([3e38, 3.4e38, np.inf, np.nan], np.float32),
    np.full(7, 0.1),
    np.full(3, -2.5e-8, np.float16),
    np.array([6.0e-8, -6.0e-8, 0.0], np.float16),  # float16's smallest subnormal
    np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max, -1, 0]),
    np.array([0, 2 ** 64 - 1, 2 ** 63], np.uint64),
    np.array([-128, 127], np.int8),
], ids=lambda v: f"{v.dtype}-{v[:2]}")
def test_histogram_of_awkward_ranges(values):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = stats.array_stats(values, piece=2)  # a grid per piece, merged
    _check_histogram(s, values)
    assert s.histogram_edges[0] <= s.min < s.histogram_edges[1] and s.max < s.histogram_edges[-1]
    assert json.dumps(s.to_json(), allow_nan=False)


def test_a_range_of_float64_extremes_has_infinite_outer_edges():
    big = np.finfo(np.float64).max
    s = stats.array_stats(np.array([-big, 0.0, big]))
    assert s.histogram_edges[0] == -math.inf and s.histogram_edges[-1] == math.inf  # -2**1024 and 2**1024
    assert s.histogram == (1,) + (0,) * 7 + (1,) + (0,) * 6 + (1,)
    assert s.to_json()["histogram_edges"][0] == "-Infinity"


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(DTYPES), st.integers(1, 9), st.data())
def test_histogram_matches_its_definition(dtype, piece, data):
    """Random values of every dtype, in random pieces: the brute-force histogram, and numpy's given the edges."""
    dtype = _as(dtype)
    if dtype.kind == "b":
        elements = st.booleans()
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        elements = st.integers(int(info.min), int(info.max))
    else:
        width = 64 if dtype.kind == "c" or dtype.itemsize >= 8 else 32 if dtype.itemsize == 4 else 16
        elements = st.floats(width=min(width, 64), allow_nan=True, allow_infinity=True) if dtype.itemsize > 1 \
            else st.floats(-400, 400)
    raw = data.draw(st.lists(elements, min_size=1, max_size=40))
    with np.errstate(over="ignore", invalid="ignore"):
        values = np.array(raw, dtype=np.float64 if dtype.kind in "fc" else object).astype(dtype)
    s = stats.array_stats(values, piece=piece)
    if not _finite(values):
        assert s.histogram == () and s.histogram_edges == ()
        return
    _check_histogram(s, values)


def test_histogram_is_one_pass_over_chunks_and_skips_non_finite_values():
    rng = np.random.default_rng(4)
    values = (rng.standard_normal(5000) * 3).astype(np.float32)
    values[[5, 700, 4000]] = [np.nan, -np.inf, np.inf]
    chunks = [values[:1234], values[1234:3000], values[3000:]]
    seen = []

    def once():
        seen.append(1)  # the statistics ask for the chunks once: the histogram needs no second read
        return iter(chunks)

    s = stats._stats_of_chunks("float", values.size, values.dtype, once, piece=64)
    whole = stats.array_stats(values, piece=64)
    assert seen == [1]
    assert s.mean == pytest.approx(whole.mean, rel=1e-12) and s.std == pytest.approx(whole.std, rel=1e-12)
    assert dataclasses.replace(s, mean=0, std=0) == dataclasses.replace(whole, mean=0, std=0)
    _check_histogram(s, values)
    assert (s.nan, s.inf, s.count) == (1, 2, 5000)


def test_a_narrow_first_chunk_then_wide_ones_merge_exactly():
    """The grid widens as chunks come (from 2**-20 to 2**7 here): counts move into coarser bins exactly."""
    first = np.linspace(1.0, 1.0 + 2 ** -17, 40, dtype=np.float32)
    values = np.concatenate([first, np.array([-3.0, 1000.0, 1.5], np.float32), -first])
    s = stats._stats_of_chunks("float", values.size, values.dtype,
                               lambda: iter([values[:40], values[40:43], values[43:]]), piece=16)
    _check_histogram(s, values)
    backwards = stats.array_stats(values[::-1].copy(), piece=16)  # wide first, then narrow: the same counts and edges
    assert (backwards.histogram, backwards.histogram_edges) == (s.histogram, s.histogram_edges)


@pytest.mark.parametrize("offset", [0.0, 1e6, -3e9])
def test_mean_and_std_far_from_zero_keep_their_digits(offset):
    """Sums are taken about the mean where it is far from 0: a spread of 1e-3 around 1e6 is not lost."""
    values = offset + np.random.default_rng(6).standard_normal(5000) * 1e-3
    s = stats.array_stats(values, piece=100)
    exact = [fractions.Fraction(x) for x in values.tolist()]  # the exact mean and std of these doubles
    mean = sum(exact) / len(exact)
    std = math.sqrt(sum((x - mean) ** 2 for x in exact) / len(exact))
    assert s.mean == pytest.approx(float(mean), rel=1e-15, abs=1e-15)
    assert s.std == pytest.approx(std, rel=1e-9)  # numpy's own np.std is 5e-9 off at -3e9
    constant = stats.array_stats(np.full(1000, 0.1), piece=100)
    assert (constant.std, constant.mean, constant.histogram[0]) == (0.0, pytest.approx(0.1, rel=1e-15), 1000)


def test_integer_extremes_are_exact():
    s = stats.array_stats(np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max], np.int64))
    assert (s.min, s.max) == (-(2 ** 63), 2 ** 63 - 1)
    s = stats.array_stats(np.array([0, 2 ** 64 - 1], np.uint64))
    assert s.max == 2 ** 64 - 1 and s.lines()[0].startswith("  min 0  max 18446744073709551615  mean ")


def test_bool_complex_string_and_empty_stats():
    b = stats.array_stats(np.array([True, False, True, True]))
    assert (b.kind, b.zeros, b.mean) == ("bool", 1, 0.75)
    assert b.lines() == ["  true 75.0%  false 25.0%"]
    c = stats.array_stats(np.array([3 + 4j, 0j, complex(np.nan, 1)], np.complex64))
    assert (c.kind, c.min, c.max, c.nan, c.zeros) == ("complex", 0.0, 5.0, 1, 1)
    assert c.lines()[0].startswith("  magnitudes: min 0  max 5  mean 2.5")
    s = stats.array_stats(np.array([b"", b"abc", b"abcdef"], dtype=object))
    assert (s.kind, s.min, s.max, s.zeros, s.mean, s.std) == ("string", 0, 6, 1, None, None)
    assert s.lines()[0] == "  lengths: min 0  max 6  empty 33.3%"
    e = stats.array_stats(np.zeros((0, 3), np.float32))
    assert e.count == 0 and e.lines() == ["  empty: no values"]


def test_extreme_ranges_neither_crash_nor_warn():
    big = np.finfo(np.float64).max
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = stats.array_stats(np.array([-big, 0.0, big]))
    assert (s.min, s.max, s.histogram[0], s.histogram[-1], s.std) == (-big, big, 1, 1, math.inf)
    assert sum(s.histogram) == 3
    assert json.dumps(s.to_json(), allow_nan=False)


def test_all_nan_tensor():
    s = stats.array_stats(np.full(4, np.nan, np.float32))
    assert s.min is None and s.nan == 4 and s.histogram == ()
    assert s.lines() == ["  no finite values  zeros 0.0%  nan 4  inf 0  <- NaN/Inf"]
    assert json.dumps(s.to_json(), allow_nan=False)


def test_stats_of_every_dtype_are_valid_json():
    for key, value in every_dtype_tensors():
        doc = stats.array_stats(value).to_json()
        json.dumps(doc, allow_nan=False)
        assert doc["count"] == value.size, key


def test_histogram_bars():
    assert stats._bars([0, 1, 8, 4]) == " ▁█▄"
    assert stats._bars([1]) == "█"


def test_jsonable():
    assert inspect.jsonable(np.array([1.5, np.nan, np.inf, -np.inf])) == [1.5, "NaN", "Infinity", "-Infinity"]
    assert inspect.jsonable(np.array([1 + 2j], np.complex64)) == [[1.0, 2.0]]
    assert inspect.jsonable(np.array([b"ok", b"\xff\x00"], object)) == ["ok", "\\xff\x00"]
    assert inspect.jsonable(np.array([1.5], ckpt.dtypes.bfloat16)) == [1.5]
    assert inspect.jsonable({"a": np.int64(3), "b": (np.float32(0.5),)}) == {"a": 3, "b": [0.5]}


def test_inspect_report_matches_the_reader(path):
    with ckpt.load_checkpoint(path) as reader:
        doc = inspect.inspect_report(reader, tensor_name="enc/kernel", stats=True)
    (entry,) = doc["tensors"]
    assert entry["values"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert entry["stats"]["mean"] == 2.5 and entry["stats"]["std"] == pytest.approx(math.sqrt(35 / 12))
    assert doc["nonfinite_tensors"] == [] and doc["params"]["total"] == 12


def test_inspect_lines_passes_read_tensors_through_progress(path):
    seen = []

    def progress(infos):
        seen.extend(info.key for info in infos)
        return infos

    with ckpt.load_checkpoint(path) as reader:
        list(inspect.inspect_lines(reader, progress=progress))
        assert seen == []  # a listing reads nothing
        list(inspect.inspect_lines(reader, stats=True, progress=progress))
    assert seen == ["enc/bias", "enc/kernel", "step", "vocab"]
