"""Keras: the files Keras wrote (legacy .h5, Keras 3 .weights.h5, .keras), hand-built layouts, hostile files."""

from __future__ import annotations

import os
import shutil
import zipfile

import h5py
import ml_dtypes
import numpy as np
import pytest
from conftest import assert_bit_exact, TESTS

import ckpt

FIXTURES = os.path.join(TESTS, "fixtures", "foreign")
#: keras_expected.npz is keyed "<order>_<weight path>"; the Keras 3 files name the same weights by place
KERAS3_KEYS = {"sequential/d1/kernel": "layers/dense/vars/0", "sequential/d1/bias": "layers/dense/vars/1",
               "sequential/bn/gamma": "layers/batch_normalization/vars/0",
               "sequential/bn/beta": "layers/batch_normalization/vars/1",
               "sequential/bn/moving_mean": "layers/batch_normalization/vars/2",
               "sequential/bn/moving_variance": "layers/batch_normalization/vars/3",
               "sequential/d2/kernel": "layers/dense_1/vars/0", "sequential/d2/bias": "layers/dense_1/vars/1"}


def expected_weights():
    """[(weight path, value)] in model order."""
    npz = np.load(os.path.join(FIXTURES, "keras_expected.npz"))
    named = [(int(k.split("_", 1)[0]), k.split("_", 1)[1].replace("__", "/"), npz[k]) for k in npz.files]
    return [(name, value) for _, name, value in sorted(named, key=lambda t: t[0])]


@pytest.mark.parametrize("name", ["keras3.weights.h5", "keras3_model.keras"])
def test_keras3_files(name):
    with ckpt.load_checkpoint(os.path.join(FIXTURES, name)) as reader:
        assert reader.format == "keras"
        assert sorted(reader.tensors) == sorted(KERAS3_KEYS.values())
        for weight, value in expected_weights():
            assert_bit_exact(value, reader.get_tensor(KERAS3_KEYS[weight]))
        assert reader.metadata["layer_names"] == {"layers/dense/vars": "d1", "layers/batch_normalization/vars": "bn",
                                                  "layers/dense_1/vars": "d2", "vars": "sequential"}
        assert reader._reader.checksummed == name.endswith(".keras")
        assert reader.verify() == []
        if name.endswith(".keras"):
            assert reader.metadata["keras_version"] == "3.15.1"
            assert '"class_name": "Sequential"' in reader.metadata["model_config"]


def test_legacy_full_model_file_lists_weights_in_model_order():
    with ckpt.load_checkpoint(os.path.join(FIXTURES, "keras_legacy_model.h5")) as reader:
        assert reader.format == "keras"
        weights = expected_weights()
        layer = {"d1": "d1", "bn": "bn", "d2": "d2"}
        keys = [f"model_weights/{layer[w.split('/')[1]]}/{w}" for w, _ in weights]
        assert list(reader.tensors) == keys
        for key, (_, value) in zip(keys, weights):
            assert_bit_exact(value, reader.get_tensor(key))
        assert reader.metadata["layer_names"] == ["d1", "bn", "d2"]
        assert reader.metadata["keras_version"] == "3.15.1" and reader.metadata["backend"] == "tensorflow"


def test_legacy_weights_only_file_keras2_style(tmp_path):
    path = str(tmp_path / "w.h5")
    kernel = np.arange(6, dtype=np.float32).reshape(2, 3)
    with h5py.File(path, "w") as f:
        f.attrs["layer_names"] = np.array([b"dense", b"flatten"])
        f.attrs["keras_version"] = b"2.15.0"
        f.create_group("flatten").attrs["weight_names"] = np.array([], dtype="S1")
        group = f.create_group("dense")
        group.attrs["weight_names"] = np.array([b"dense/kernel:0", b"dense/bias:0"])
        group["dense/bias:0"] = np.zeros(3, np.float32)
        group["dense/kernel:0"] = kernel
    with ckpt.load_checkpoint(path) as reader:
        assert list(reader.tensors) == ["dense/dense/kernel:0", "dense/dense/bias:0"]
        assert reader.metadata == {"keras_version": "2.15.0", "layer_names": ["dense", "flatten"]}
    # the ":0" is part of these keys, so load_variable keeps it
    assert_bit_exact(kernel, ckpt.load_variable(path, "dense/dense/kernel:0"))


def test_keras3_bfloat16_and_natural_order(tmp_path):
    path = str(tmp_path / "m.weights.h5")
    bf = np.array([1.5, -2.0, 3.0], dtype=ml_dtypes.bfloat16)
    with h5py.File(path, "w") as f:
        variables = f.create_group("layers/emb/vars")
        variables.attrs["name"] = "embedding"
        for i in range(12):
            variables[str(i)] = np.full(2, i, np.float32)
        ds = f["layers/emb"].create_group("more").create_dataset("table", data=bf)
        ds.attrs["dtype"] = "bfloat16"
        f.create_group("vars")
    with ckpt.load_checkpoint(path) as reader:
        assert list(reader.tensors) == ["layers/emb/more/table"] + [f"layers/emb/vars/{i}" for i in range(12)]
        assert reader.get_tensor("layers/emb/vars/10")[0] == 10
        assert_bit_exact(bf, reader.get_tensor("layers/emb/more/table"))
        assert reader.metadata == {"layer_names": {"layers/emb/vars": "embedding"}}


def test_other_hdf5_files_are_not_keras(tmp_path):
    plain = str(tmp_path / "plain.h5")
    with h5py.File(plain, "w") as f:
        f["weights/w"] = np.ones(2, np.float32)
    with ckpt.load_checkpoint(plain) as reader:
        assert reader.format == "hdf5"
    own = str(tmp_path / "own.h5")
    ckpt.Saver({"layers/w": ckpt.Variable([1.0])}).save(own)
    with ckpt.load_checkpoint(own) as reader:
        assert reader.format == "hdf5"


def test_keras_files_with_external_links_or_missing_weights(tmp_path):
    secret = tmp_path / "secret.h5"
    with h5py.File(secret, "w") as f:
        f["data"] = np.ones(2)
    path = str(tmp_path / "linked.h5")
    with h5py.File(path, "w") as f:
        f.attrs["layer_names"] = np.array([b"dense"])
        f.create_group("dense").attrs["weight_names"] = np.array([b"dense/kernel:0"])
        f["dense/dense/kernel:0"] = h5py.ExternalLink(str(secret), "data")
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="external link"):
        ckpt.load_checkpoint(path)
    path = str(tmp_path / "missing.h5")
    with h5py.File(path, "w") as f:
        f.attrs["layer_names"] = np.array([b"dense"])
        f.create_group("dense").attrs["weight_names"] = np.array([b"dense/kernel:0"])
    with pytest.raises(ckpt.CorruptCheckpointError, match="lists weight 'dense/kernel:0'.*no dataset"):
        ckpt.load_checkpoint(path)


def member_offset(path, name):
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(name)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        lengths = f.read(4)
    return info.header_offset + 30 + int.from_bytes(lengths[:2], "little") + int.from_bytes(lengths[2:], "little")


def test_damaged_or_unusual_keras_zips(tmp_path):
    path = tmp_path / "m.keras"
    shutil.copyfile(os.path.join(FIXTURES, "keras3_model.keras"), path)
    raw = bytearray(path.read_bytes())
    raw[member_offset(str(path), "model.weights.h5") + 100] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"model.weights.h5 fails its checksum \(CRC-32"):
        ckpt.load_checkpoint(str(path))
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("metadata.json", "{}")
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="without model.weights.h5"):
        ckpt.load_checkpoint(str(path))
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("metadata.json", "{}")
        z.write(os.path.join(FIXTURES, "keras3.weights.h5"), "model.weights.h5", compress_type=zipfile.ZIP_DEFLATED)
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="'model.weights.h5' is compressed"):
        ckpt.load_checkpoint(str(path))


def test_declared_sizes_are_checked_before_allocating(tmp_path):
    path = str(tmp_path / "huge.weights.h5")
    with h5py.File(path, "w") as f:
        f.create_group("vars")
        f.create_group("layers/dense/vars").create_dataset("0", shape=(2 ** 40,), dtype="f4")  # never written
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"'layers/dense/vars/0' declares \[1099511627776\] .* "
                                                          "more than a .*-byte file can hold"):
        ckpt.load_checkpoint(path)
