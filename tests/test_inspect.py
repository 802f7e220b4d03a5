"""ckpt.inspect: print_tensors_in_checkpoint_file, parameter counts, statistics, the JSON view."""

from __future__ import annotations

import dataclasses
import fractions
import json
import math
import warnings

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import every_dtype_tensors

import ckpt
from ckpt import inspect, stats
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


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ckpt.dtypes.bfloat16, np.int16, np.uint8])
def test_chunked_stats_match_numpy(monkeypatch, dtype):
    monkeypatch.setattr(stats, "PIECE", 7)  # many chunks, the last one short
    rng = np.random.default_rng(1)
    values = (rng.standard_normal(100) * 50).astype(dtype) if np.dtype(dtype).kind != "u" else \
        rng.integers(0, 255, 100).astype(dtype)
    s = stats.array_stats(values)
    as64 = values.astype(np.float64)
    assert (s.min, s.max) == (as64.min(), as64.max())
    assert s.mean == pytest.approx(as64.mean(), rel=1e-12)
    assert s.std == pytest.approx(as64.std(), rel=1e-9)
    assert list(s.histogram) == np.histogram(as64, bins=16, range=(as64.min(), as64.max()))[0].tolist()
    assert s.zeros == np.count_nonzero(as64 == 0)


def _numpy_histogram(values: np.ndarray) -> list[int]:
    as64 = values.astype(np.float64)
    as64 = as64[np.isfinite(as64)]
    return np.histogram(as64, bins=16, range=(as64.min(), as64.max()))[0].tolist()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ckpt.dtypes.bfloat16, np.int32, np.int64,
                                   np.uint16])
def test_histogram_is_numpys_even_on_the_bin_edges(monkeypatch, dtype):
    """Values on numpy's bin edges and on their neighbours land where np.histogram puts them."""
    monkeypatch.setattr(stats, "PIECE", 5)  # many pieces: both threads, the pieces' own ranges
    lo, hi = (-3.0, 7.1) if np.dtype(dtype).kind == "f" else (0, 4099)
    edges = np.linspace(lo, hi, 17)
    near = np.concatenate([edges, np.nextafter(edges, -np.inf), np.nextafter(edges, np.inf)])
    as_dtype = near.astype(dtype)
    if np.dtype(dtype).kind == "f" and np.dtype(dtype) != np.float64:  # this dtype's own neighbours of the edges
        wide = near.astype(np.float32)
        as_dtype = np.concatenate([as_dtype, np.nextafter(wide, -np.inf).astype(dtype),
                                   np.nextafter(wide, np.inf).astype(dtype)])
    values = np.clip(as_dtype.astype(np.float64), lo, hi).astype(dtype)
    values = np.random.default_rng(3).permutation(values)
    s = stats.array_stats(values)
    assert list(s.histogram) == _numpy_histogram(values)


def test_histogram_streams_in_two_passes_and_skips_non_finite_values(monkeypatch):
    monkeypatch.setattr(stats, "PIECE", 64)
    rng = np.random.default_rng(4)
    values = (rng.standard_normal(5000) * 3).astype(np.float32)
    values[[5, 700, 4000]] = [np.nan, -np.inf, np.inf]
    chunks = [values[:1234], values[1234:3000], values[3000:]]
    s = stats._stats_of_chunks("float", values.size, values.dtype, lambda: iter(chunks))
    whole = stats.array_stats(values)
    assert s.mean == pytest.approx(whole.mean, rel=1e-12) and s.std == pytest.approx(whole.std, rel=1e-12)
    assert dataclasses.replace(s, mean=0, std=0) == dataclasses.replace(whole, mean=0, std=0)
    assert list(s.histogram) == _numpy_histogram(values)
    assert (s.nan, s.inf, s.count) == (1, 2, 5000)


@pytest.mark.parametrize("offset", [0.0, 1e6, -3e9])
def test_mean_and_std_far_from_zero_keep_their_digits(monkeypatch, offset):
    """Sums are taken about the mean where it is far from 0: a spread of 1e-3 around 1e6 is not lost."""
    monkeypatch.setattr(stats, "PIECE", 100)
    values = offset + np.random.default_rng(6).standard_normal(5000) * 1e-3
    s = stats.array_stats(values)
    exact = [fractions.Fraction(x) for x in values.tolist()]  # the exact mean and std of these doubles
    mean = sum(exact) / len(exact)
    std = math.sqrt(sum((x - mean) ** 2 for x in exact) / len(exact))
    assert s.mean == pytest.approx(float(mean), rel=1e-15, abs=1e-15)
    assert s.std == pytest.approx(std, rel=1e-9)  # numpy's own np.std is 5e-9 off at -3e9
    constant = stats.array_stats(np.full(1000, 0.1))
    assert (constant.std, constant.mean, constant.histogram[8]) == (0.0, pytest.approx(0.1, rel=1e-15), 1000)


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
