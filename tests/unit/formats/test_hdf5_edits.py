"""A ckpt HDF5 file changed with h5py or h5repack after ckpt saved it: every kind of edit either
reads what plain h5py sees or raises a CheckpointError naming the file, never what ckpt's
(now stale) index recorded."""

from __future__ import annotations

import pathlib
import shutil
import struct
import subprocess

import h5py
import numpy as np
import pytest

import ckpt
from ckpt.formats import _h5edited

TENSORS = {
    "model/w": np.arange(6.0).reshape(2, 3),
    "opt/m": np.ones(3, dtype=np.float32),
    "x/p": np.arange(4, dtype=np.float32),
    "x/q": np.arange(4, 8, dtype=np.float32),
    "emb/bf": np.array([1.5, -2.0], dtype=ckpt.dtypes.bfloat16),
    "vocab": np.array([b"ab", b"c\x00"], dtype=object),
}
METADATA = {"step": 12}


def _set_metadata(f: h5py.File) -> None:
    f.attrs["ckpt_metadata"] = '{"step": 99}'  # as long as '{"step": 12}'


def _replace(f: h5py.File) -> None:
    del f["x/p"]
    f["x/p"] = np.arange(10, 14, dtype=np.float32)


def _resize(f: h5py.File) -> None:
    del f["x/p"]
    f["x/p"] = np.arange(5, dtype=np.float32)


#: In-place edits with h5py (``h5py.File(path, "r+")``).
EDITS = {
    "delete a dataset": lambda f: f.__delitem__("x/q"),
    "delete a group": lambda f: f.__delitem__("opt"),
    "swap two names": lambda f: (f.move("x/p", "x/tmp"), f.move("x/q", "x/p"), f.move("x/tmp", "x/q")),
    "rename a dataset": lambda f: f.move("x/p", "x/r"),
    "rename a group": lambda f: f.move("opt", "optimizer"),
    "same-length metadata edit": _set_metadata,
    "remove ckpt_format": lambda f: f.attrs.__delitem__("ckpt_format"),
    "remove ckpt_version": lambda f: f.attrs.__delitem__("ckpt_version"),
    "remove a dtype attribute": lambda f: f["emb/bf"].attrs.__delitem__("ckpt_dtype"),
    "edit string lengths": lambda f: f["vocab"].attrs.__setitem__("ckpt_lengths", np.array([1, 2], np.uint64)),
    "add a dataset attribute": lambda f: f["x/p"].attrs.__setitem__("note", "hi"),
    "add a dataset": lambda f: f.__setitem__("extra", np.arange(3.0)),
    "add a group": lambda f: f.create_group("empty"),
    "write data in place": lambda f: f["x/p"].__setitem__(slice(None), np.full(4, 9.0, np.float32)),
    "replace a dataset (same size)": _replace,
    "replace a dataset (another size)": _resize,
    "open and close": lambda f: None,
}


def _saved(tmp_path: pathlib.Path, name: str = "m.h5") -> pathlib.Path:
    path = tmp_path / name
    ckpt.save_file(TENSORS, path, METADATA)
    return path


def _h5py_view(path: pathlib.Path) -> dict[str, np.ndarray]:
    """What plain h5py sees: every dataset by path (ckpt's bfloat16 as its raw 16-bit patterns)."""
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name: str, obj: object) -> None:
            if isinstance(obj, h5py.Dataset):
                if obj.id.get_type().get_size() == 2 and obj.dtype.kind == "f" and obj.dtype.itemsize == 4:
                    raw = np.empty(obj.shape, np.uint16)
                    obj.id.read(h5py.h5s.ALL, h5py.h5s.ALL, raw, mtype=obj.id.get_type())
                    out[name] = raw
                else:
                    out[name] = obj[()]
        f.visititems(visit)
    return out


def _check_reads_h5py_view_or_refuses(path: pathlib.Path) -> str:
    """Load ``path``; return "refused" (a CheckpointError naming the file) or "read" (exactly
    the datasets and values h5py sees, the metadata unchanged)."""
    try:
        with ckpt.load_checkpoint(path) as reader:
            got = {key: reader.get_tensor(key) for key in reader.get_variable_to_shape_map()}
            metadata = reader.metadata
    except ckpt.CheckpointError as exc:
        assert path.name in str(exc), exc
        return "refused"
    seen = _h5py_view(path)
    assert sorted(got) == sorted(seen)
    for key, value in got.items():
        if value.dtype == ckpt.dtypes.bfloat16:
            np.testing.assert_array_equal(value.view(np.uint16), seen[key])
        elif value.dtype.kind == "O":
            assert value.tolist() == TENSORS[key].tolist()  # h5py strips the trailing NUL ckpt_lengths keeps
        else:
            assert value.dtype == seen[key].dtype and value.tobytes() == seen[key].tobytes(), key
    assert metadata == METADATA
    return "read"


def _rewrite(src: pathlib.Path, dst: pathlib.Path) -> None:
    """What h5repack does: every object copied into a new file with the same user block, whose
    bytes are copied too."""
    with h5py.File(src, "r") as f:
        userblock = f.userblock_size
        with h5py.File(dst, "w", userblock_size=userblock) as out:
            for name in f:
                f.copy(f[name], out, name=name)
            for key, value in f.attrs.items():
                out.attrs[key] = value
    with open(src, "rb") as f_src, open(dst, "r+b") as f_dst:
        f_dst.write(f_src.read(userblock))


@pytest.mark.parametrize("edit", EDITS)
def test_an_edit_in_place_reads_what_h5py_sees_or_is_refused(tmp_path, edit):
    path = _saved(tmp_path)
    with h5py.File(path, "r+") as f:
        EDITS[edit](f)
    outcome = _check_reads_h5py_view_or_refuses(path)
    if edit == "open and close":
        assert outcome == "read"


def test_an_edit_in_place_is_refused_with_what_to_do(tmp_path):
    path = _saved(tmp_path)
    with h5py.File(path, "r+") as f:
        del f["opt"]
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"m\.h5: the HDF5 structure .* changed.*h5repack"):
        ckpt.load_file(path)


@pytest.mark.parametrize("edit", EDITS)
def test_an_edit_then_a_rewrite_reads_what_h5py_sees_or_is_refused(tmp_path, edit):
    path = _saved(tmp_path, "edited.h5")
    with h5py.File(path, "r+") as f:
        EDITS[edit](f)
    _rewrite(path, tmp_path / "r.h5")
    outcome = _check_reads_h5py_view_or_refuses(tmp_path / "r.h5")
    if edit in ("delete a dataset", "delete a group", "remove ckpt_format", "remove ckpt_version",
                "add a dataset attribute", "add a group", "open and close"):  # every value still checks out
        assert outcome == "read"


def test_a_rewritten_file_is_read_through_h5py_and_checked(tmp_path):
    _rewrite(_saved(tmp_path), tmp_path / "r.h5")
    with ckpt.load_checkpoint(tmp_path / "r.h5") as reader:
        assert reader.checksummed and reader.metadata == METADATA
        for key, value in TENSORS.items():
            got = reader.get_tensor(key)
            assert got.dtype == value.dtype and got.tolist() == value.tolist()
        assert ckpt.verify(tmp_path / "r.h5").ok


def test_a_rewritten_file_refuses_values_its_index_does_not_vouch_for(tmp_path):
    path = _saved(tmp_path)
    with h5py.File(path, "r+") as f:
        EDITS["swap two names"](f)
        f["extra"] = np.arange(3.0)
    _rewrite(path, tmp_path / "r.h5")
    with ckpt.load_checkpoint(tmp_path / "r.h5") as reader:
        np.testing.assert_array_equal(reader.get_tensor("model/w"), TENSORS["model/w"])
        with pytest.raises(ckpt.CorruptCheckpointError, match=r"r\.h5: tensor 'x/p' fails its checksum"):
            reader.get_tensor("x/p")
        with pytest.raises(ckpt.CorruptCheckpointError, match=r"r\.h5: tensor 'extra' was added after"):
            reader.get_tensor("extra")
        problems = reader.verify()
    assert sorted(p.split("'")[1] for p in problems) == ["extra", "x/p", "x/q"]


def test_a_rewritten_file_with_another_shape_is_refused_on_open(tmp_path):
    path = _saved(tmp_path)
    with h5py.File(path, "r+") as f:
        _resize(f)
    _rewrite(path, tmp_path / "r.h5")
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"r\.h5: tensor 'x/p' is float32 \[5\] .* saved float32 \[4\]"):
        ckpt.load_checkpoint(tmp_path / "r.h5")


@pytest.mark.parametrize("damage", ["truncated", "appended"])
def test_a_file_whose_size_changed_without_hdf5_is_refused(tmp_path, damage):
    path = _saved(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[:-1] if damage == "truncated" else raw + bytes(8))
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"m\.h5: the file is \d+ bytes but was written as"):
        ckpt.load_checkpoint(path)


def test_rewritten_reads_the_end_of_file_hdf5_recorded(tmp_path):
    path = _saved(tmp_path)
    raw = path.read_bytes()
    userblock = struct.unpack_from("<I", raw, 12)[0]
    with ckpt.formats._io.LocalFile(str(path)) as blob:
        assert _h5edited.rewritten(blob, userblock, len(raw))
        assert not _h5edited.rewritten(blob, userblock, len(raw) - 1)


@pytest.mark.skipif(shutil.which("h5repack") is None, reason="h5repack is not installed (apt-get install hdf5-tools)")
def test_h5repack_of_an_edited_file(tmp_path):
    path = _saved(tmp_path)
    with h5py.File(path, "r+") as f:
        del f["opt"]
    subprocess.run(["h5repack", str(path), str(tmp_path / "r.h5")], check=True, capture_output=True)
    with ckpt.load_checkpoint(tmp_path / "r.h5") as reader:
        assert reader.checksummed  # read through h5py, every tensor checked against the index
        assert sorted(reader.get_variable_to_shape_map()) == sorted(k for k in TENSORS if k != "opt/m")
        np.testing.assert_array_equal(reader.get_tensor("x/q"), TENSORS["x/q"])
