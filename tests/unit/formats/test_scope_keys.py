"""Keys that are both a tensor and a scope of other keys (TF1's slot and shadow names:
"dense/kernel" beside "dense/kernel/Adam"): every writable format stores them, HDF5 in the layout
docs/formats.md describes, and they convert between formats bit-exact."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

import ckpt
from ckpt.cli import main
from ckpt.formats import base

WRITABLE = [".h5", ".msgpack", ".safetensors"]


def slots() -> dict[str, np.ndarray]:
    """A TF1 Adam model's names: a tensor that is a scope, two levels deep, in several dtypes."""
    rng = np.random.default_rng(27)
    return {
        "dense/kernel": rng.standard_normal((3, 4)).astype(np.float32),
        "dense/kernel/Adam": rng.standard_normal((3, 4)).astype(np.float32),
        "dense/kernel/Adam_1": rng.standard_normal((3, 4)).astype(np.float32),
        "dense/kernel/ExponentialMovingAverage": rng.standard_normal((3, 4)).astype(np.float32),
        "dense/bias": rng.standard_normal(4).astype(ckpt.dtypes.bfloat16),
        "dense/bias/Adam": np.array([1.5, np.nan, -0.0, np.inf], dtype=ckpt.dtypes.bfloat16),
        "dense": np.int64(7),
        "step/x": np.array([True, False]),
        "step": np.float64(2.5),
    }


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        x, y = np.asarray(a[key]), np.asarray(b[key])
        assert (x.dtype, x.shape, x.tobytes()) == (y.dtype, y.shape, y.tobytes()), key


@pytest.mark.parametrize("ext", WRITABLE)
def test_every_writable_format_stores_a_tensor_that_is_a_scope(tmp_path, ext):
    path = str(tmp_path / f"m{ext}")
    ckpt.save_file(slots(), path)
    same(ckpt.load_file(path), slots())
    with ckpt.load_checkpoint(path) as reader:
        assert reader.verify() == []


@pytest.mark.parametrize("src", WRITABLE)
@pytest.mark.parametrize("dst", WRITABLE)
def test_conversion_between_every_writable_format_and_back_is_bit_exact(tmp_path, src, dst):
    first, there, back = str(tmp_path / f"a{src}"), str(tmp_path / f"b{dst}"), str(tmp_path / f"c{src}")
    ckpt.save_file(slots(), first)
    ckpt.convert(first, there)
    ckpt.convert(there, back)
    same(ckpt.load_file(there), slots())
    same(ckpt.load_file(back), slots())


def test_ckpt_convert_may_rename_a_tensor_under_another(tmp_path):
    src, dst = str(tmp_path / "src.h5"), str(tmp_path / "out.h5")
    ckpt.save_file({"enc/kernel": np.ones(2), "dec": np.arange(3.0)}, src)
    result = CliRunner().invoke(main, ["convert", src, dst, "--rename", "dec=enc"])
    assert result.exit_code == 0, result.output
    assert {k: v.tolist() for k, v in ckpt.load_file(dst).items()} == {"enc": [0.0, 1.0, 2.0], "enc/kernel": [1.0, 1.0]}


def test_hdf5_keeps_the_tensor_of_a_scope_inside_its_group_for_plain_h5py(tmp_path):
    path = str(tmp_path / "m.h5")
    ckpt.save_file(slots(), path)
    with h5py.File(path, "r") as f:
        assert isinstance(f["dense/kernel"], h5py.Group)
        assert f["dense/kernel/__ckpt_tensor__"][()].tobytes() == slots()["dense/kernel"].tobytes()
        assert f["dense/kernel/Adam"][()].tobytes() == slots()["dense/kernel/Adam"].tobytes()
        assert f["dense/__ckpt_tensor__"][()] == 7 and f["dense/bias/__ckpt_tensor__"].attrs["ckpt_dtype"] == "bfloat16"


def test_hdf5_files_read_through_h5py_map_the_layout_back_to_the_keys(tmp_path):
    """A ckpt file an HDF5 tool rewrote (read through h5py, checked against the index), and one
    written by plain h5py in the same layout (no ckpt index)."""
    path = str(tmp_path / "m.h5")
    ckpt.save_file(slots(), path)
    with h5py.File(path, "r+") as f:  # grows the file: ckpt reads it through h5py from now on
        f["extra"] = np.zeros(5000)
    with ckpt.load_checkpoint(path) as reader:
        assert set(reader.tensors) == set(slots()) | {"extra"}
        assert reader.get_tensor("dense/kernel").tobytes() == slots()["dense/kernel"].tobytes()
        assert reader.get_tensor("dense") == 7
    plain = str(tmp_path / "plain.h5")
    with h5py.File(plain, "w") as f:
        f["w/__ckpt_tensor__"] = np.arange(3.0)
        f["w/Momentum"] = np.ones(3)
    assert {k: v.tolist() for k, v in ckpt.load_file(plain).items()} == {"w": [0.0, 1.0, 2.0], "w/Momentum": [1.0] * 3}


def test_hdf5_through_libhdf5_keeps_the_layout(tmp_path):
    """Attributes too big for ckpt's own headers (10,000 string lengths) make libhdf5 lay out the file."""
    strings = np.array([b"x\x00"] * 10000, dtype=object)
    tensors = {"s": strings, "s/Adam": np.ones(2, np.float32)}
    path = str(tmp_path / "s.h5")
    ckpt.save_file(tensors, path)
    with h5py.File(path, "r") as f:
        assert f["s/__ckpt_tensor__"].attrs["ckpt_lengths"].tolist() == [2] * 10000
    back = ckpt.load_file(path)
    assert back["s"].tolist() == strings.tolist() and back["s/Adam"].tolist() == [1.0, 1.0]


def test_hdf5_refuses_a_key_named_like_the_layouts_reserved_name(tmp_path):
    path = tmp_path / "bad.h5"
    with pytest.raises(ValueError, match=r"bad\.h5: key 'w/__ckpt_tensor__' ends in '__ckpt_tensor__'"):
        ckpt.save_file({"w/__ckpt_tensor__": np.ones(1)}, str(path))
    assert not path.exists()
    ckpt.save_file({"w/__ckpt_tensor__": np.ones(1)}, str(tmp_path / "ok.msgpack"))  # flat formats store it


@pytest.mark.parametrize("ext", [".h5", ".msgpack"])
def test_a_saver_saves_and_restores_variables_named_under_another(tmp_path, ext):
    model = {"dense/kernel": ckpt.Variable(np.arange(4.0)), "dense/kernel/Adam": ckpt.Variable(np.ones(4))}
    saved = ckpt.Saver(model).save(str(tmp_path / "run" / f"m{ext}"), global_step=1)
    fresh = {key: ckpt.Variable(np.zeros(4)) for key in model}
    ckpt.Saver(fresh).restore(saved)
    assert fresh["dense/kernel"].numpy().tolist() == [0.0, 1.0, 2.0, 3.0]
    assert fresh["dense/kernel/Adam"].numpy().tolist() == [1.0] * 4


def test_the_key_rules_accept_a_tensor_that_is_a_scope():
    base.validate_keys(["a", "a/b", "a/b/c"], "here")  # nothing raised
    with pytest.raises(ValueError, match="here: duplicate key 'a'"):
        base.validate_keys(["a", "a/b", "a"], "here")
