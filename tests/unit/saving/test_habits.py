"""Habits people bring from TensorFlow, orbax and safetensors (issue 26): restore-or-initialize,
steps, waiting for checkpoints, plain arrays' types, errors that name the argument."""

from __future__ import annotations

import os

import numpy as np
import pytest

import ckpt


def _saver(value: float = 0.0) -> tuple[ckpt.Saver, ckpt.Variable]:
    w = ckpt.Variable(np.full(2, value, np.float32), name="w")
    return ckpt.Saver({"w": w}, max_to_keep=None), w


def _save_steps(directory, steps) -> tuple[ckpt.Saver, ckpt.Variable]:
    saver, w = _saver()
    for step in steps:
        w.assign([step, step])
        saver.save(os.path.join(directory, "model.h5"), global_step=step)
    return saver, w


# -- steps -----------------------------------------------------------------------------------

def test_all_steps_and_latest_step(tmp_path):
    assert ckpt.all_steps(tmp_path) == [] and ckpt.latest_step(tmp_path) is None
    saver, _ = _save_steps(tmp_path, [30, 10, 20])
    saver.save(str(tmp_path / "unstepped.h5"))  # no step: not listed
    assert ckpt.all_steps(tmp_path) == [10, 20, 30]
    assert ckpt.latest_step(tmp_path) == 30
    os.remove(tmp_path / "model-30.h5")  # deleted by hand: no longer a step
    assert ckpt.all_steps(str(tmp_path)) == [10, 20] and ckpt.latest_step(tmp_path) == 20


def test_restore_step(tmp_path):
    saver, w = _save_steps(tmp_path, [1, 2, 3])
    result = saver.restore(tmp_path, step=2)
    assert result.path == str(tmp_path / "model-2.h5")
    np.testing.assert_array_equal(w.numpy(), [2.0, 2.0])


def test_restore_missing_step_lists_the_steps(tmp_path):
    saver, w = _save_steps(tmp_path, [1, 3])
    with pytest.raises(ckpt.CheckpointNotFoundError, match=r"no checkpoint of step 2; steps saved: 1, 3") as info:
        saver.restore(tmp_path, step=2)
    assert info.value.path == str(tmp_path)
    np.testing.assert_array_equal(w.numpy(), [3.0, 3.0])  # unchanged
    with pytest.raises(TypeError, match="step must be an int"):
        saver.restore(tmp_path, step="2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="best=True or step="):
        saver.restore(tmp_path, step=1, best=True)


# -- restore_or_initialize -------------------------------------------------------------------

def test_restore_or_initialize_initializes_when_no_checkpoint(tmp_path):
    with ckpt.deferred_init():
        w = ckpt.Variable(ckpt.initializers.Ones(), shape=(2,), name="w")
    b = ckpt.Variable([7.0], name="b")  # initialized already: left as it is
    b.assign([8.0])
    saver = ckpt.Saver({"w": w, "b": b})
    assert saver.restore_or_initialize(tmp_path / "not-yet") is None
    np.testing.assert_array_equal(w.numpy(), [1.0, 1.0])
    np.testing.assert_array_equal(b.numpy(), [8.0])
    assert not (tmp_path / "not-yet").exists()  # looking creates nothing


def test_restore_or_initialize_restores_the_latest(tmp_path):
    saver, w = _save_steps(tmp_path, [1, 2])
    w.assign([0.0, 0.0])
    assert saver.restore_or_initialize(tmp_path) == str(tmp_path / "model-2.h5")
    np.testing.assert_array_equal(w.numpy(), [2.0, 2.0])


# -- checkpoints_iterator --------------------------------------------------------------------

def test_checkpoints_iterator_yields_each_new_checkpoint(tmp_path):
    saver, _ = _save_steps(tmp_path, [1])
    calls = []

    def on_timeout() -> bool:  # a training job's next save, made while the evaluator waits
        calls.append(1)
        if len(calls) == 1:
            saver.save(str(tmp_path / "model.h5"), global_step=2)
            return False
        return True

    seen = [os.path.basename(p) for p in ckpt.checkpoints_iterator(tmp_path, timeout=0, timeout_fn=on_timeout)]
    assert seen == ["model-1.h5", "model-2.h5"] and len(calls) == 2


def test_checkpoints_iterator_empty_directory_times_out(tmp_path):
    assert list(ckpt.checkpoints_iterator(tmp_path, timeout=0)) == []
    with pytest.raises(ValueError, match="non-negative"):
        next(ckpt.checkpoints_iterator(tmp_path, timeout=-1))


# -- errors that name the argument -----------------------------------------------------------

def test_restore_of_a_dict_names_the_path_argument(tmp_path):
    saver, w = _saver()
    with pytest.raises(TypeError, match=r"restore\(path=...\) takes a checkpoint file or directory .* got a dict"):
        saver.restore({"w": w})  # type: ignore[arg-type]


def test_save_with_a_non_int_step_names_global_step(tmp_path):
    saver, _ = _saver()
    with pytest.raises(TypeError, match=r"save\(global_step=...\) takes an int .* got 'abc'"):
        saver.save(str(tmp_path / "m.h5"), global_step="abc")
    assert os.listdir(tmp_path) == []  # nothing written


def test_initializer_without_shape_names_shape():
    with pytest.raises(ValueError, match=r"variable .w.: an initializer \(Zeros\) needs shape="):
        ckpt.Variable(ckpt.initializers.Zeros(), name="w")
    assert ckpt.Variable(lambda: np.ones(2), name="v").shape == (2,)  # a plain callable makes its own shape


def test_get_slice_with_a_step_names_file_key_and_index(tmp_path):
    path = ckpt.save_file({"k": np.arange(8)}, str(tmp_path / "m.msgpack"))
    with ckpt.load_checkpoint(path) as reader, pytest.raises(IndexError) as info:
        reader.get_slice("k", np.s_[::4])
    message = str(info.value)
    assert message.startswith(f"{path}: get_slice('k', ...): index: slices with step 1 only")
    assert "dimension 0 has step 4" in message and "[::4]" in message
