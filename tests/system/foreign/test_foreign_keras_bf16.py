"""Keras's legacy .h5 with a bfloat16 layer: its weights (and their optimizer slots) are opaque 2-byte data,
typed from the model config stored in the same file; one whose type cannot be known is refused when read,
naming the dataset (never read as another type), and the rest of the file reads.

Fixture written by keras 3.15 (tests/fixtures/foreign/generators/gen_tf_keras.py).
"""

from __future__ import annotations

import json
import os
import shutil

import h5py
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import assert_bit_exact, TESTS

import ckpt
from ckpt.cli import main as cli_main

FIXTURES = os.path.join(TESTS, "fixtures", "foreign")
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
    return edited_copy(tmp_path, PATH, edit)


def set_policy(f, name):
    config = json.loads(f.attrs["model_config"])
    for layer in config["config"]["layers"]:
        if layer["config"]["name"] in ("d2", "proj_bf16"):
            layer["config"]["dtype"]["config"]["name"] = name
    f.attrs["model_config"] = json.dumps(config)


def assert_refused_when_read(reader, key):
    """``key`` is listed as a non-tensor; reading it raises naming it; it is never read as a guess."""
    assert key not in reader.tensors and "opaque 2-byte" in reader.metadata["non_tensors"][key]
    with pytest.raises(ckpt.UnsupportedCheckpointError, match=f"{reader.path}: dataset '{key}' holds opaque 2-byte"):
        reader.get_tensor(key)
    with pytest.raises(ckpt.UnsupportedCheckpointError, match=f"'{key}'"):
        reader.read_into(key, np.empty(2, np.uint16))


@pytest.mark.parametrize("edit", [
    lambda f: set_policy(f, "float16"),
    lambda f: set_policy(f, "mixed_bfloat16"),  # a mixed policy keeps float32 variables: not these bytes
    lambda f: f.attrs.__delitem__("model_config"),
    lambda f: f.attrs.__setitem__("model_config", "{not json"),
])
def test_without_a_bfloat16_policy_only_the_opaque_data_is_refused(tmp_path, edit):
    want = np.load(os.path.join(FIXTURES, "keras_legacy_bf16_expected.npz"))
    with ckpt.load_checkpoint(edited(tmp_path, edit)) as reader:
        assert reader.format == "keras"
        assert_bit_exact(want["d1__0"], reader.get_tensor("model_weights/d1/sequential/d1/kernel"))
        assert_bit_exact(want["bn__3"], reader.get_tensor("model_weights/bn/sequential/bn/moving_variance"))
        assert len(reader.tensors) == 6
        for weight in ("kernel", "bias"):
            assert_refused_when_read(reader, f"model_weights/d2/sequential/d2/{weight}")


@pytest.mark.parametrize("n", [5000, 9000])
def test_a_config_integer_past_pythons_digit_limit_still_types_the_layers(tmp_path, n):
    """json.loads refuses int literals past 4,300 digits; only the dtype policies matter here."""
    want = np.load(os.path.join(FIXTURES, "keras_legacy_bf16_expected.npz"))

    def edit(f):
        f.attrs["model_config"] = f.attrs["model_config"].replace('"units": 2', '"units": ' + "9" * n)

    with ckpt.load_checkpoint(edited(tmp_path, edit)) as reader:
        value = reader.get_tensor("model_weights/d2/sequential/d2/kernel")
        assert value.dtype == ckpt.dtypes.bfloat16
        assert_bit_exact(want["d2__0__bits"], value.view(np.uint16))
        assert len(reader.metadata["model_config"]) > n  # kept as the file's text


def test_opaque_data_in_a_plain_hdf5_file_is_refused_when_read(tmp_path):
    path = str(tmp_path / "plain.h5")
    with h5py.File(path, "w") as f:
        f["w"] = np.arange(3, dtype=np.float32)
        f["x"] = np.zeros(4, dtype="V2")
    with ckpt.load_checkpoint(path) as reader:
        assert reader.format == "hdf5" and list(reader.tensors) == ["w"]
        assert_bit_exact(np.arange(3, dtype=np.float32), reader.get_tensor("w"))
        assert_refused_when_read(reader, "x")
    result = CliRunner().invoke(cli_main, ["inspect", path])
    assert result.exit_code == 0 and "non-tensor: x (opaque 2-byte" in result.output


# --- a whole model with its optimizer (keras_legacy_bf16_adam.h5) ---------------------------------------

ADAM = os.path.join(FIXTURES, "keras_legacy_bf16_adam.h5")
SLOT = "optimizer_weights/adam/sequential_proj_bf16_bias_momentum"


def npz_name(key):
    return key.replace("/", "__")


def test_adam_slots_take_their_variables_type():
    """Keras gives a slot its variable's dtype: proj_bf16's momentum/velocity are bfloat16 like its weights."""
    want = np.load(os.path.join(FIXTURES, "keras_legacy_bf16_adam_expected.npz"))
    with ckpt.load_checkpoint(ADAM) as reader:
        assert reader.format == "keras" and "non_tensors" not in reader.metadata
        assert sorted(npz_name(k) for k in reader.tensors) == sorted(f.removesuffix("__bits") for f in want.files)
        bits = 0
        for key in reader.tensors:
            value = reader.get_tensor(key)
            if npz_name(key) + "__bits" in want.files:
                bits += 1
                assert value.dtype == ckpt.dtypes.bfloat16
                assert_bit_exact(want[npz_name(key) + "__bits"], value.view(np.uint16))
            else:
                assert_bit_exact(want[npz_name(key)], value)
        assert bits == 6  # proj_bf16's kernel and bias, and their 4 Adam slots


def test_adam_file_restores_with_a_bfloat16_model():
    want = np.load(os.path.join(FIXTURES, "keras_legacy_bf16_adam_expected.npz"))
    var = ckpt.Variable(np.zeros(2, ckpt.dtypes.bfloat16), name=SLOT)
    ckpt.Saver([var]).restore(ADAM)
    assert_bit_exact(want[npz_name(SLOT) + "__bits"], var.numpy().view(np.uint16))


def rename_slot(f, new):
    f.move(SLOT, new)


@pytest.mark.parametrize("edit, unknown", [
    # the variable's layer has no bfloat16 policy: its weights and slots are unknown, the rest reads
    (lambda f: set_policy(f, "float16"), ["model_weights/proj_bf16/sequential/proj_bf16/kernel", SLOT]),
    # a slot whose name matches no variable of the model
    (lambda f: rename_slot(f, "optimizer_weights/adam/mystery_momentum"), ["optimizer_weights/adam/mystery_momentum"]),
    # a slot named after a float32 variable cannot hold 2-byte values of a known type
    (lambda f: rename_slot(f, "optimizer_weights/adam/sequential_d1_bias_momentum2"),
     ["optimizer_weights/adam/sequential_d1_bias_momentum2"]),
])
def test_an_opaque_slot_of_unknown_type_is_refused_when_read(tmp_path, edit, unknown):
    with ckpt.load_checkpoint(edited_copy(tmp_path, ADAM, edit)) as reader:
        assert reader.get_tensor("optimizer_weights/adam/iteration") == 1
        assert reader.get_tensor("model_weights/d1/sequential/d1/kernel").shape == (3, 4)
        for key in unknown:
            assert_refused_when_read(reader, key)


def edited_copy(tmp_path, source, edit):
    path = tmp_path / "m.h5"
    shutil.copy(source, path)
    with h5py.File(path, "r+") as f:
        edit(f)
    return str(path)
