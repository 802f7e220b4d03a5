"""CheckpointError carries the file (``path``) and the tensor (``key``) it concerns."""

from __future__ import annotations

import numpy as np
import pytest

import ckpt


def _saved(tmp_path, name="m.msgpack"):
    path = str(tmp_path / name)
    ckpt.Saver({"w": ckpt.Variable(np.arange(4.0)), "b": ckpt.Variable(1.0)}).save(path)
    return path


def test_a_missing_key_names_the_file_and_the_key(tmp_path):
    path = _saved(tmp_path)
    with pytest.raises(ckpt.KeyNotFoundError) as caught:
        ckpt.Saver({"w": ckpt.Variable(np.zeros(4)), "gone": ckpt.Variable(0.0)}).restore(path)
    assert (caught.value.path, caught.value.key) == (path, "gone")


def test_a_shape_mismatch_names_the_key_and_two_problems_name_none(tmp_path):
    path = _saved(tmp_path)
    with pytest.raises(ckpt.MismatchError) as caught:
        ckpt.Saver({"w": ckpt.Variable(np.zeros(5)), "b": ckpt.Variable(1.0)}).restore(path)
    assert (caught.value.path, caught.value.key) == (path, "w")
    with pytest.raises(ckpt.MismatchError) as caught:
        ckpt.Saver({"w": ckpt.Variable(np.zeros(5)), "b": ckpt.Variable(np.zeros(2))}).restore(path)
    assert (caught.value.path, caught.value.key) == (path, None)


@pytest.mark.parametrize("name", ["m.msgpack", "m.h5"])
def test_a_checksum_failure_names_the_file_and_the_key(tmp_path, name):
    path = _saved(tmp_path, name)
    with open(path, "r+b") as f:
        data = f.read()
        at = data.index(np.arange(4.0).tobytes()) + 9
        f.seek(at)
        f.write(bytes([data[at] ^ 1]))
    with ckpt.load_checkpoint(path) as reader, \
            pytest.raises(ckpt.CorruptCheckpointError, match="fails its checksum") as caught:
        reader.get_tensor("w")
    assert (caught.value.path, caught.value.key) == (path, "w")


def test_a_missing_file_names_it(tmp_path):
    path = str(tmp_path / "none.h5")
    with pytest.raises(ckpt.CheckpointNotFoundError) as caught:
        ckpt.load_checkpoint(path)
    assert (caught.value.path, caught.value.key) == (path, None)
