"""The HDF5 structures ckpt writes itself (formats/_h5struct.py), checked with libhdf5 (h5py)."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

import ckpt
from ckpt.formats import _h5struct, base
from ckpt.formats.builtin import Hdf5Format


def write(path, tensors, metadata=None):
    Hdf5Format().write(str(path), tensors, metadata or {})
    return str(path)


def test_large_groups_deep_scopes_and_names_read_back_through_libhdf5(tmp_path):
    """Groups of thousands of links take multi-level B-trees; h5py finds every one by name."""
    tensors = [(f"big/t{i:04d}", np.full(3, i, np.int32)) for i in range(1500)]
    tensors += [(f"r{i}", np.float64(i)) for i in range(40)]
    tensors += [("a/b/c/d/e/f/g/h", np.arange(4, dtype=np.int16)), ("ünï/日本/x", np.ones(2, np.float32)),
                ("a/b/c/z", np.zeros((0, 3), np.float32))]
    path = write(tmp_path / "big.h5", tensors)
    with h5py.File(path, "r") as f:
        assert list(f["big"]) == [f"t{i:04d}" for i in range(1500)]  # sorted, as HDF5 lists them
        for key, value in tensors:
            got = f[key][()]
            assert got.dtype == value.dtype and got.shape == value.shape
            assert np.asarray(got).tobytes() == value.tobytes()
        seen = []
        f.visititems(lambda name, obj: seen.append(name) if isinstance(obj, h5py.Dataset) else None)
        assert sorted(seen) == sorted(k for k, _ in tensors)
    with ckpt.load_checkpoint(path) as reader:
        assert list(reader.tensors) == [k for k, _ in tensors] and reader.verify() == []


def test_attributes_have_the_types_h5py_gives_them(tmp_path):
    path = write(tmp_path / "a.h5", [("s", np.array([b"a\x00", b"bc"], dtype=object)),
                                     ("b", np.ones(2, ckpt.dtypes.bfloat16))], {"step": 5, "note": "ü"})
    with h5py.File(path, "r") as f:
        assert f.attrs["ckpt_format"] == "ckpt-hdf5" and isinstance(f.attrs["ckpt_format"], str)
        assert f.attrs["ckpt_version"] == 2 and f.attrs["ckpt_version"].dtype == np.int64
        assert f.attrs["ckpt_metadata"] == '{"step": 5, "note": "\\u00fc"}'
        assert f["s"].attrs["ckpt_dtype"] == "string" and f["b"].attrs["ckpt_dtype"] == "bfloat16"
        lengths = f["s"].attrs["ckpt_lengths"]
        assert lengths.dtype == np.uint64 and lengths.tolist() == [2, 2]
        assert f.id.get_create_plist().get_userblock() >= 512


def test_an_empty_checkpoint_is_a_valid_hdf5_file(tmp_path):
    path = write(tmp_path / "e.h5", [])
    with h5py.File(path, "r") as f:
        assert list(f) == [] and f.attrs["ckpt_format"] == "ckpt-hdf5"
    with ckpt.load_checkpoint(path) as reader:
        assert dict(reader.tensors) == {} and reader.verify() == []


def test_libhdf5_can_extend_the_file(tmp_path):
    """libhdf5 splitting our B-tree and symbol-table nodes proves it reads them as its own."""
    tensors = [(f"g/t{i:03d}", np.full(2, i, np.int64)) for i in range(100)] + [("solo/w", np.ones(3))]
    path = write(tmp_path / "x.h5", tensors)
    with h5py.File(path, "r+") as f:
        for i in range(100):
            f[f"g/u{i:03d}"] = np.full(2, -i)
        f["solo/v"] = np.zeros(1)
        f["new/w"] = np.ones(1)
    with h5py.File(path, "r") as f:
        assert len(f["g"]) == 200 and f["g/t042"][0] == 42 and f["g/u042"][0] == -42
        assert sorted(f["solo"]) == ["v", "w"] and f["new/w"][0] == 1


def test_the_same_tensors_give_the_same_bytes(tmp_path):
    tensors = [(f"l{i}/w", np.arange(i + 1, dtype=np.float32)) for i in range(20)]
    a, b = write(tmp_path / "a.h5", tensors, {"s": 1}), write(tmp_path / "b.h5", tensors, {"s": 1})
    with open(a, "rb") as fa, open(b, "rb") as fb:
        assert fa.read() == fb.read()


def test_attributes_too_big_for_our_headers_go_through_libhdf5(tmp_path):
    """Lengths of 10,000 strings (80 KB) exceed a version 1 object header message."""
    value = np.array([b"x\x00"] * 10000, dtype=object)
    with pytest.raises(ValueError, match="at most"):
        _h5struct.layout([_h5struct.Dataset("s", b"", (1,), 1, [("ckpt_lengths", np.zeros(10000, np.uint64))])],
                         [], 512)
    path = write(tmp_path / "s.h5", [("s", value), ("w", np.ones(3))])
    with h5py.File(path, "r") as f:
        assert f["s"].attrs["ckpt_lengths"].tolist() == [2] * 10000
    with base.open_reader(path) as reader:
        assert reader.read("s").tolist() == value.tolist() and reader.verify() == []


def test_large_tensors_start_page_aligned_small_ones_packed(tmp_path):
    tensors = [("small/a", np.ones(10, np.float32)), ("big", np.ones(1 << 16, np.float32)),
               ("small/b", np.ones(3, np.int8))]
    path = write(tmp_path / "al.h5", tensors)
    with h5py.File(path, "r") as f:
        offsets = {k: f[k].id.get_offset() for k, _ in tensors}
    assert offsets["big"] % 4096 == 0
    assert offsets["small/b"] == offsets["big"] + (1 << 18)  # data follows data: one read restores a run


def test_the_known_datatype_messages_are_libhdf5s():
    """The table that spares a writer h5py's import holds exactly what libhdf5 encodes."""
    from ckpt.formats import _h5write

    known = {np.dtype(d) for d in ("<f2", "<f4", "<f8", "<i1", "<i2", "<i4", "<i8", "<u1", "<u2", "<u4", "<u8",
                                   "?")}
    assert known <= set(_h5write._TYPE_MESSAGES)
    for dtype in known:
        assert _h5write._TYPE_MESSAGES[dtype] == _h5struct.dtype_message(_h5write._h5_type(dtype)), dtype


def test_writing_the_usual_dtypes_imports_no_h5py(tmp_path):
    """A save or a conversion to .h5 of numeric tensors loads no h5py (30-40 ms of a process);
    plain h5py reads the file all the same."""
    import subprocess
    import sys

    path = tmp_path / "m.h5"
    code = ("import sys, numpy as np, ckpt\n"
            "ckpt.save_file({'w': np.arange(6, dtype=np.float32).reshape(2, 3), 'b': np.array([True, False]),\n"
            "                'n': np.arange(3, dtype=np.uint16), 'x': np.float64(2.5)}, sys.argv[1])\n"
            "print('h5py' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, "False\n", "")
    with h5py.File(path, "r") as f:
        assert f["w"][()].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] and f["w"].dtype == np.float32
        assert f["b"][()].tolist() == [True, False] and f["n"].dtype == np.uint16 and f["x"][()] == 2.5
