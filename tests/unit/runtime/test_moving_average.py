"""ckpt.ExponentialMovingAverage against TF1's tf.train.ExponentialMovingAverage formula."""

from __future__ import annotations

import numpy as np
import pytest

import ckpt


def tf1_step(shadow: np.ndarray, value: np.ndarray, decay: float, n: int | None) -> np.ndarray:
    """TF1's update, written out: a float32 decay (min with (1+n)/(10+n)), then
    shadow -= (shadow - value) * (1 - decay) in the variable's dtype."""
    d = np.float32(decay)
    if n is not None:
        d = min(d, (np.float32(1) + np.float32(n)) / (np.float32(10) + np.float32(n)))
    one_minus = np.asarray(np.float32(1) - d, dtype=shadow.dtype)
    return shadow - (shadow - value) * one_minus


def test_the_tf1_example_values():
    """TF1's documented example: decay 0.99 with a step counter; v1 0 -> 5 at step 0, -> 10 at 10000."""
    v1, step = ckpt.Variable(0.0, name="v1"), ckpt.Variable(0, trainable=False, name="step")
    ema = ckpt.ExponentialMovingAverage(0.99, num_updates=step)
    ema.apply([v1])
    v1.assign(5.0)
    ema.apply([v1])
    assert ema.average(v1).numpy() == np.float32(4.5)  # decay min(0.99, 1/10)
    step.assign(10000)
    v1.assign(10.0)
    ema.apply([v1])
    assert ema.average(v1).numpy() == pytest.approx(4.555, abs=1e-6)
    ema.apply([v1])
    assert ema.average(v1).numpy() == pytest.approx(4.60945, abs=1e-5)


@pytest.mark.parametrize("dtype", [np.float16, ckpt.dtypes.bfloat16, np.float32, np.float64])
@pytest.mark.parametrize("num_updates", [None, 0, 37])
def test_updates_match_tf1s_formula_bit_for_bit(dtype, num_updates):
    rng = np.random.default_rng(7)
    values = [rng.standard_normal((3, 5)).astype(dtype) for _ in range(6)]
    w = ckpt.Variable(values[0], name="w")
    ema = ckpt.ExponentialMovingAverage(0.9, num_updates=num_updates)
    ema.apply([w])
    expected = values[0].copy()
    for value in values[1:]:
        w.assign(value)
        ema.apply([w])
        expected = tf1_step(expected, value, 0.9, num_updates)
        got = ema.average(w).numpy()
        assert got.dtype == np.dtype(dtype) and got.tobytes() == expected.tobytes()


def test_shadows_are_named_as_tf1_and_not_trainable():
    with ckpt.name_scope("model"):
        kernel = ckpt.Variable(np.ones((2, 2), np.float32), name="dense/kernel")
    ema = ckpt.ExponentialMovingAverage(0.999)
    assert ema.average(kernel) is None
    with ckpt.name_scope("elsewhere"):
        (shadow,) = ema.apply([kernel])
    assert shadow.name == "model/dense/kernel/ExponentialMovingAverage:0" and not shadow.trainable
    assert ema.average(kernel) is shadow and ema.average_name(kernel) == "model/dense/kernel/ExponentialMovingAverage"
    assert ema.apply([kernel]) == [shadow]  # created once


def test_apply_refuses_what_tf1_refuses_before_updating_anything():
    w, ids = ckpt.Variable(np.ones(2, np.float32), name="w"), ckpt.Variable(np.arange(2), name="ids")
    ema = ckpt.ExponentialMovingAverage(0.5)
    with pytest.raises(TypeError, match="variable 'ids' is int64; only float16, bfloat16, float32 and float64"):
        ema.apply([w, ids])
    assert ema.average(w) is None
    (shadow,) = ema.apply([w])
    with pytest.raises(TypeError, match="'w/ExponentialMovingAverage' is a shadow of this average"):
        ema.apply([shadow])
    with pytest.raises(ValueError, match="decay must be in"):
        ckpt.ExponentialMovingAverage(1.5)


@pytest.mark.parametrize("ext", [".h5", ".msgpack"])
def test_a_saver_restores_the_averages_into_the_model(tmp_path, ext):
    """TF1's pattern: train with shadows saved, evaluate with variables_to_restore."""
    w = ckpt.Variable(np.zeros(3, np.float32), name="dense/kernel")
    step = ckpt.Variable(0, trainable=False, name="global_step")
    ema = ckpt.ExponentialMovingAverage(0.5)
    ema.apply([w])
    for i in range(1, 4):
        w.assign(np.full(3, 8.0 * i, np.float32))
        step.assign(i)
        ema.apply([w])
    averaged = ema.average(w).numpy().copy()
    saved = ckpt.Saver([w, step, ema.average(w)]).save(str(tmp_path / "run" / f"m{ext}"), global_step=3)
    with ckpt.load_checkpoint(saved) as reader:
        assert sorted(reader.tensors) == ["dense/kernel", "dense/kernel/ExponentialMovingAverage", "global_step"]

    eval_w = ckpt.Variable(np.zeros(3, np.float32), name="dense/kernel")
    eval_step = ckpt.Variable(0, trainable=False, name="global_step")
    to_restore = ckpt.ExponentialMovingAverage(0.5).variables_to_restore([eval_w, eval_step])
    assert to_restore == {"dense/kernel/ExponentialMovingAverage": eval_w, "global_step": eval_step}
    ckpt.Saver(to_restore).restore(saved)
    assert eval_w.numpy().tobytes() == averaged.tobytes() and int(eval_step.numpy()) == 3
    assert ema.variables_to_restore([w, ema.average(w)]) == {"dense/kernel/ExponentialMovingAverage": w}
