"""ckpt.average_checkpoints and `ckpt average`: weighted means of float tensors in float64,
written in each dtype; equal non-float tensors copied; mismatches refused before writing."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import assert_bit_exact, data_offset, every_dtype_tensors

import ckpt
from ckpt.cli.main import main as cli

FLOATS = ["float16", "bfloat16", "float32", "float64", "complex64", "complex128"]


def _inputs(tmp_path, count: int = 3, exts=(".h5", ".msgpack", ".h5")) -> tuple[list[str], list[dict]]:
    """``count`` checkpoints of every dtype: float tensors differ, the others are equal."""
    rng = np.random.default_rng(1)
    base = dict(every_dtype_tensors())
    paths, contents = [], []
    for i in range(count):
        tensors = dict(base)
        for key, value in base.items():
            if ckpt.dtypes.kind(value.dtype) in ("f", "c") and value.size:
                noise = rng.standard_normal(value.shape) * (1 + 1j if value.dtype.kind == "c" else 1)
                tensors[key] = (value.astype(np.complex128 if value.dtype.kind == "c" else np.float64)
                                + noise).astype(value.dtype)
        paths.append(ckpt.save_file(tensors, tmp_path / f"in{i}{exts[i % len(exts)]}"))
        contents.append(tensors)
    return paths, contents


def _numpy_mean(values: list[np.ndarray], weights: list[float]) -> np.ndarray:
    wide = np.complex128 if values[0].dtype.kind == "c" else np.float64
    shares = [w / sum(weights) for w in weights]
    total = shares[0] * values[0].astype(wide)
    for share, value in zip(shares[1:], values[1:]):
        total = total + share * value.astype(wide)
    return total.astype(values[0].dtype)


@pytest.mark.parametrize("out_ext", [".h5", ".msgpack", ".safetensors"])
@pytest.mark.parametrize("weights", [None, [0.2, 0.3, 0.5]])
def test_every_float_dtype_is_averaged_as_numpy_does_and_the_rest_is_copied(tmp_path, out_ext, weights):
    paths, contents = _inputs(tmp_path)
    if out_ext == ".safetensors":  # safetensors stores neither strings nor complex numbers
        contents = [{k: v for k, v in c.items() if v.dtype.kind not in "Oc"} for c in contents]
        paths = [ckpt.save_file(c, tmp_path / f"st{i}.msgpack") for i, c in enumerate(contents)]
    out = ckpt.average_checkpoints(paths, tmp_path / f"avg{out_ext}", weights)
    got = ckpt.load_file(out)
    assert sorted(got) == sorted(contents[0])
    for key, first in contents[0].items():
        values = [c[key] for c in contents]
        if ckpt.dtypes.dtype_name(first.dtype) in FLOATS:
            assert_bit_exact(_numpy_mean(values, weights or [1, 1, 1]), got[key])
        else:
            assert_bit_exact(first, got[key])


def test_tensors_of_many_chunks_in_different_formats_stream_and_average(tmp_path):
    rng = np.random.default_rng(2)
    values = [rng.standard_normal(3 << 20).astype(np.float32) for _ in range(3)]  # 12 MiB: several chunks
    small = [rng.standard_normal((5, 7)).astype(ckpt.dtypes.bfloat16) for _ in range(3)]
    paths = [ckpt.save_file({"big": v, "small": s}, tmp_path / f"in{i}{ext}")
             for i, (v, s, ext) in enumerate(zip(values, small, [".h5", ".msgpack", ".safetensors"]))]
    out = ckpt.average_checkpoints(paths, tmp_path / "avg.msgpack", [1, 2, 1])
    got = ckpt.load_file(out)
    assert_bit_exact(_numpy_mean(values, [1, 2, 1]), got["big"])
    assert_bit_exact(_numpy_mean(small, [1, 2, 1]), got["small"])


def test_an_integer_tensor_that_differs_is_named_with_its_files_and_nothing_is_written(tmp_path):
    a = ckpt.save_file({"w": np.ones(3, np.float32), "step": np.int64(7)}, tmp_path / "a.h5")
    b = ckpt.save_file({"w": np.ones(3, np.float32), "step": np.int64(8)}, tmp_path / "b.h5")
    with pytest.raises(ckpt.MismatchError, match=r"tensor 'step' is not a floating-point tensor and differs "
                                                 r"between .*a\.h5 and .*b\.h5") as info:
        ckpt.average_checkpoints([a, b], tmp_path / "avg.h5")
    assert info.value.key == "step"
    assert sorted(os.listdir(tmp_path)) == ["a.h5", "b.h5"]  # no output, no temporary file left


def test_keys_shapes_and_dtypes_that_differ_are_listed_in_one_error_before_writing(tmp_path):
    a = ckpt.save_file({"w": np.ones(3, np.float32), "b": np.ones(2, np.float32), "only_a": np.ones(1)},
                       tmp_path / "a.h5")
    b = ckpt.save_file({"w": np.ones(4, np.float32), "b": np.ones(2, np.float64)}, tmp_path / "b.msgpack")
    with pytest.raises(ckpt.MismatchError) as info:
        ckpt.average_checkpoints([a, b], tmp_path / "avg.h5")
    message = str(info.value)
    assert f"tensor 'only_a' is missing from {b}" in message
    assert f"tensor 'w' differs ({a}: float32[3]; {b}: float32[4])" in message
    assert f"tensor 'b' differs ({a}: float32[2]; {b}: float64[2])" in message
    assert not os.path.exists(tmp_path / "avg.h5")


def test_a_damaged_input_fails_its_checksum_and_nothing_is_written(tmp_path):
    value = np.arange(1000, dtype=np.float32)
    a = ckpt.save_file({"w": value}, tmp_path / "a.msgpack")
    b = ckpt.save_file({"w": value}, tmp_path / "b.msgpack")
    offset = data_offset(b, value)
    with open(b, "r+b") as f:
        f.seek(offset + 40)
        f.write(b"\x7f")
    with pytest.raises(ckpt.CorruptCheckpointError, match="b.msgpack"):
        ckpt.average_checkpoints([a, b], tmp_path / "avg.h5")
    assert not os.path.exists(tmp_path / "avg.h5")


def test_bad_weights_and_an_existing_output_are_refused(tmp_path):
    a = ckpt.save_file({"w": np.ones(3, np.float32)}, tmp_path / "a.h5")
    for weights, message in [([1.0], "1 weights for 2 checkpoints"), ([1, -1], "non-negative"),
                             ([0, 0], "not all zero"), ([1, float("nan")], "finite")]:
        with pytest.raises(ValueError, match=message):
            ckpt.average_checkpoints([a, a], tmp_path / "avg.h5", weights)
    with pytest.raises(ValueError, match="at least one"):
        ckpt.average_checkpoints([], tmp_path / "avg.h5")
    with pytest.raises(ckpt.CheckpointWriteError, match="exists; pass overwrite=True"):
        ckpt.average_checkpoints([a, a], a)
    assert ckpt.average_checkpoints([a, a], a, overwrite=True) == str(a)


def test_inputs_and_output_may_be_urls_and_directories(tmp_path):
    root = f"memory://avg-{time.time_ns()}"
    saver = ckpt.Saver([w := ckpt.Variable(np.zeros(4, np.float32), name="w")], max_to_keep=None)
    for step in (1, 2, 3):
        w.assign(np.full(4, step, np.float32))
        saver.save(f"{root}/run/model.msgpack", global_step=step)
    local = ckpt.save_file({"w": np.full(4, 10, np.float32)}, tmp_path / "ten.h5")
    out = ckpt.average_checkpoints([f"{root}/run/model-1.msgpack", f"{root}/run", local], f"{root}/avg.h5")
    np.testing.assert_array_equal(ckpt.load_variable(out, "w"), np.full(4, (1 + 3 + 10) / 3, np.float32))


def test_cli_average(tmp_path):
    a = ckpt.save_file({"w": np.zeros(2, np.float32)}, tmp_path / "a.h5")
    b = ckpt.save_file({"w": np.ones(2, np.float32)}, tmp_path / "b.msgpack")
    out = str(tmp_path / "avg.h5")
    done = CliRunner().invoke(cli, ["average", a, b, "-o", out, "--weights", "1,3"])
    assert done.exit_code == 0, done.output
    assert done.output == f"{out}: the average of 2 checkpoints (weights 1,3)\n"
    np.testing.assert_array_equal(ckpt.load_variable(out, "w"), [0.75, 0.75])
    again = CliRunner().invoke(cli, ["average", a, b, "-o", out])
    assert again.exit_code == 2 and "exists; pass --force" in again.output
    bad = CliRunner().invoke(cli, ["average", a, b, "-o", out, "--force", "--weights", "1"])
    assert bad.exit_code == 2 and "1 weights for 2 checkpoints" in bad.output
    c = ckpt.save_file({"w": np.zeros(3, np.float32)}, tmp_path / "c.h5")
    failed = CliRunner().invoke(cli, ["average", a, c, "-o", str(tmp_path / "x.h5")])
    assert failed.exit_code == 1 and "tensor 'w' differs" in failed.output and "Traceback" not in failed.output


@pytest.mark.parametrize("dtype", FLOATS)
def test_chunks_split_between_two_threads_average_every_float_dtype_as_numpy_does(tmp_path, dtype):
    # 300,001 elements: one chunk of several blocks (split between the threads) and a short last block
    rng = np.random.default_rng(3)
    wide = np.complex128 if "complex" in dtype else np.float64
    values = [(rng.standard_normal(300_001) * (1 + 1j if "complex" in dtype else 1)).astype(wide)
              .astype(ckpt.dtypes.bfloat16 if dtype == "bfloat16" else dtype) for _ in range(3)]
    paths = [ckpt.save_file({"w": v}, tmp_path / f"in{i}{ext}")
             for i, (v, ext) in enumerate(zip(values, [".msgpack", ".h5", ".msgpack"]))]
    out = ckpt.average_checkpoints(paths, tmp_path / "avg.msgpack", [3, 1, 2])
    assert_bit_exact(_numpy_mean(values, [3, 1, 2]), ckpt.load_file(out)["w"])
