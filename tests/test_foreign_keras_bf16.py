"""Keras's legacy .h5 with a bfloat16 layer: its weights are opaque 2-byte data, typed from the model
config stored in the same file, or refused naming the dataset (never read as another type).

Fixture written by keras 3.15 (tests/fixtures/foreign/generators/gen_tf_keras.py).
"""

from __future__ import annotations

import json
import os
import shutil

import h5py
import numpy as np
import pytest
from conftest import assert_bit_exact

import ckpt

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "foreign")
PATH = os.path.join(FIXTURES, "keras_legacy_bf16.h5")
WEIGHTS = {"d1/0": "d1/sequential/d1/kernel", "d1/1": "d1/sequential/d1/bias", "d2/0": "d2/sequential/d2/kernel",
           "d2/1": "d2/sequential/d2/bias", "bn/0": "bn/sequential/bn/gamma", "bn/1": "bn/sequential/bn/beta",
           "bn/2": "bn/sequential/bn/moving_mean", "bn/3": "bn/sequential/bn/moving_variance"}


def test_bfloat16_layer_reads_as_bfloat16():
    want = np.load(os.path.join(FIXTURES, "keras_legacy_bf16_expected.npz"))
    with ckpt.load_checkpoint(PATH) as reader:
        assert reader.format == "keras"
        for name, weight in WEIGHTS.items():
            value = reader.get_tensor("model_weights/" + weight)
            npz = name.replace("/", "__")
            if npz + "__bits" in want.files:
                assert value.dtype == ckpt.dtypes.bfloat16
                assert_bit_exact(want[npz + "__bits"], value.view(np.uint16))
            else:
                assert_bit_exact(want[npz], value)


def edited(tmp_path, edit):
    path = tmp_path / "m.h5"
    shutil.copy(PATH, path)
    with h5py.File(path, "r+") as f:
        edit(f)
    return str(path)


def set_policy(f, name):
    config = json.loads(f.attrs["model_config"])
    for layer in config["config"]["layers"]:
        if layer["config"]["name"] == "d2":
            layer["config"]["dtype"]["config"]["name"] = name
    f.attrs["model_config"] = json.dumps(config)


@pytest.mark.parametrize("edit", [
    lambda f: set_policy(f, "float16"),
    lambda f: set_policy(f, "mixed_bfloat16"),  # a mixed policy keeps float32 variables: not these bytes
    lambda f: f.attrs.__delitem__("model_config"),
    lambda f: f.attrs.__setitem__("model_config", "{not json"),
])
def test_without_a_bfloat16_policy_the_opaque_data_is_refused(tmp_path, edit):
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="'model_weights/d2/sequential/d2/.*opaque 2-byte"):
        ckpt.load_checkpoint(edited(tmp_path, edit))


def test_opaque_data_in_a_plain_hdf5_file_is_refused(tmp_path):
    path = str(tmp_path / "plain.h5")
    with h5py.File(path, "w") as f:
        f["w"] = np.zeros(3, np.float32)
        f["x"] = np.zeros(4, dtype="V2")
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="'x' holds opaque 2-byte"):
        ckpt.load_checkpoint(path)
