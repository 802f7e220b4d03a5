"""A real TF1 training checkpoint: Adam slots and EMA shadows named under their variable
(``dense/kernel`` beside ``dense/kernel/Adam``, ``Adam_1``, ``ExponentialMovingAverage``), keys
that are both a tensor and a scope. ckpt reads it bit-exactly, converts it to every writable
format and back, and restores the averages into a model as TF1's evaluation does.

Fixture written by tensorflow-cpu 2.21 (tests/fixtures/foreign/generators/gen_tf_keras.py tf1_adam).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import TESTS, assert_bit_exact

import ckpt

FIXTURES = os.path.join(TESTS, "fixtures", "foreign")
CHECKPOINT = os.path.join(FIXTURES, "tf1_adam")
LAYERS = {"dense/kernel": (3, 4), "dense/bias": (4,), "out/kernel": (4, 2), "out/bias": (2,)}
SUFFIXES = ("", "/Adam", "/Adam_1", "/ExponentialMovingAverage")


def expected() -> dict[str, np.ndarray]:
    """What TF itself read back (tf.train.load_checkpoint), keyed by the checkpoint's keys."""
    data = np.load(os.path.join(FIXTURES, "tf1_adam_expected.npz"))
    keys = [f"{layer}{suffix}" for layer in LAYERS for suffix in SUFFIXES] + ["beta1_power", "beta2_power",
                                                                              "global_step"]
    assert sorted(k.replace("/", "__") for k in keys) == sorted(data.files)
    return {key: data[key.replace("/", "__")] for key in keys}


def test_the_tf1_checkpoint_reads_bit_exact_with_its_slot_and_shadow_keys():
    want = expected()
    with ckpt.load_checkpoint(CHECKPOINT) as reader:
        assert reader.path.endswith("model.ckpt-3")  # the directory's latest, from TF's state file
        assert sorted(reader.get_variable_to_shape_map()) == sorted(want)
        for key, value in want.items():
            assert_bit_exact(value, reader.get_tensor(key))
        assert reader.verify() == []
    assert int(want["global_step"]) == 3


@pytest.mark.parametrize("ext", [".h5", ".msgpack", ".safetensors"])
def test_it_converts_to_every_writable_format_and_back_bit_exact(tmp_path, ext):
    want = expected()
    there = ckpt.convert(CHECKPOINT, tmp_path / f"adam{ext}").path
    assert sorted(ckpt.load_file(there)) == sorted(want)
    for key, value in ckpt.load_file(there).items():
        assert_bit_exact(want[key], value)
    back = ckpt.convert(there, tmp_path / f"back{'.msgpack' if ext == '.h5' else '.h5'}").path
    got = ckpt.load_file(back)
    assert sorted(got) == sorted(want)
    for key, value in got.items():
        assert_bit_exact(want[key], value)


def test_the_averages_restore_into_the_model_as_tf1_evaluates():
    want = expected()
    model = {key: ckpt.Variable(np.zeros(shape, np.float32), name=key) for key, shape in LAYERS.items()}
    ema = ckpt.ExponentialMovingAverage(0.9)
    names = ema.variables_to_restore(model.values())
    assert sorted(names) == sorted(f"{key}/ExponentialMovingAverage" for key in LAYERS)
    ckpt.Saver(names).restore(CHECKPOINT)
    for key, variable in model.items():
        assert_bit_exact(want[f"{key}/ExponentialMovingAverage"], variable.numpy())
        assert not np.array_equal(want[key], variable.numpy())  # the averages, not the weights


def test_it_averages_with_a_converted_copy_into_hdf5(tmp_path):
    # the average of a checkpoint and its own copy is the checkpoint (x/4 + 3x/4 is exact in float64)
    want = expected()
    copy = ckpt.convert(CHECKPOINT, tmp_path / "copy.msgpack").path
    out = ckpt.average_checkpoints([CHECKPOINT, copy], tmp_path / "avg.h5", weights=[1, 3])
    got = ckpt.load_file(out)
    assert sorted(got) == sorted(want)
    for key, value in got.items():
        assert_bit_exact(want[key], value)  # global_step (int64) copied, the floats averaged
