"""Tests for ckpt.initializers and ckpt.random: shapes, dtypes, statistics, seeding, configs."""

from __future__ import annotations

import json
import math
import threading

import ml_dtypes
import numpy as np
import pytest

from ckpt.runtime import initializers, random
from ckpt.runtime.initializers import (
    Constant,
    GlorotNormal,
    GlorotUniform,
    HeNormal,
    HeUniform,
    Identity,
    LecunNormal,
    LecunUniform,
    Ones,
    Orthogonal,
    RandomNormal,
    RandomUniform,
    TruncatedNormal,
    VarianceScaling,
    Zeros,
)

TRUNC_STD = 0.87962566103423978  # std of a unit normal truncated at +-2
P_WITHIN_1_OF_TRUNCATED = 0.682689492137 / 0.954499736104  # P(|z|<1 | |z|<2)

BIG = (2000, 500)  # 1e6 samples, and fan_in (2000) != fan_avg (1250) != fan_out (500)
CONV = (3, 3, 64, 128)  # fan_in 576, fan_out 1152, fan_avg 864

ALL = [
    Zeros(), Ones(), Constant(3), Identity(), RandomNormal(seed=1), RandomUniform(seed=1),
    TruncatedNormal(seed=1), Orthogonal(seed=1), VarianceScaling(seed=1), GlorotNormal(seed=1),
    GlorotUniform(seed=1), HeNormal(seed=1), HeUniform(seed=1), LecunNormal(seed=1),
    LecunUniform(seed=1),
]
RANDOM = [init for init in ALL if isinstance(init, initializers.RandomInitializer)]
FLOAT_DTYPES = ["float32", "float64", "float16", "bfloat16", ml_dtypes.bfloat16, np.float32]


def ids(inits):
    return [type(init).__name__ for init in inits]


# ---------------------------------------------------------------------------- fans


@pytest.mark.parametrize("shape, fans", [
    ((), (1, 1)),
    ((7,), (7, 7)),
    ((3, 4), (3, 4)),
    ((5, 6, 7), (30, 35)),
    (CONV, (576, 1152)),
    ((2, 3, 4, 5, 6), (120, 144)),
])
def test_compute_fans(shape, fans):
    assert initializers.compute_fans(shape) == fans
    assert initializers.compute_fans(list(shape)) == fans


# ---------------------------------------------------------------------------- shape and dtype


@pytest.mark.parametrize("init", ALL, ids=ids(ALL))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_shape_and_dtype(init, dtype):
    out = init((4, 6), dtype=dtype)
    assert out.shape == (4, 6)
    assert out.dtype == np.dtype(dtype)
    assert out.flags.c_contiguous and out.flags.writeable
    assert np.isfinite(out.astype(np.float64)).all()


@pytest.mark.parametrize("init", ALL, ids=ids(ALL))
def test_default_dtype_is_float32_and_each_call_returns_a_new_array(init):
    a, b = init([3, 5]), init([3, 5])
    assert a.dtype == np.float32 and a.shape == (3, 5)
    assert a.flags.owndata and not np.shares_memory(a, b)


@pytest.mark.parametrize("init", [i for i in ALL if not isinstance(i, (Identity, Orthogonal))],
                         ids=ids([i for i in ALL if not isinstance(i, (Identity, Orthogonal))]))
@pytest.mark.parametrize("shape, expected", [(5, (5,)), ((), ()), ((2, 0, 3), (2, 0, 3)),
                                             (CONV, CONV)])
def test_shape_forms(init, shape, expected):
    assert init(shape).shape == expected


def test_low_precision_is_the_cast_of_the_float64_sample():
    init = GlorotNormal(seed=9)
    wide = init((64, 32), dtype="float64")
    np.testing.assert_array_equal(init((64, 32), dtype="bfloat16"), wide.astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(init((64, 32), dtype="float16"), wide.astype(np.float16))


# ---------------------------------------------------------------------------- deterministic initializers


@pytest.mark.parametrize("dtype", ["int8", "uint16", "int64", "bool", "complex64", "bfloat16"])
def test_zeros_and_ones_in_any_dtype(dtype):
    zeros, ones = Zeros()((2, 3), dtype), Ones()((2, 3), dtype)
    assert zeros.dtype == ones.dtype == np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    assert (zeros == np.zeros((), zeros.dtype)).all() and (ones == np.ones((), ones.dtype)).all()


def test_string_dtype():
    assert Zeros()((2,), "string").tolist() == [b"", b""]
    assert Constant(b"x")((2,), "string").tolist() == [b"x", b"x"]
    assert Constant("h\u00e9")((1,), "string").tolist() == ["h\u00e9".encode()]
    with pytest.raises(ValueError, match="Ones"):
        Ones()((2,), "string")


@pytest.mark.parametrize("value, dtype, expected", [
    (7, "int16", 7),
    (-3, "int8", -3),
    (True, "bool", True),
    (0, "bool", False),
    (1 + 2j, "complex64", 1 + 2j),
    (2.5, "float64", 2.5),
    (0.1, "bfloat16", float(ml_dtypes.bfloat16(0.1))),
])
def test_constant_scalar(value, dtype, expected):
    out = Constant(value)((3, 2), dtype)
    assert out.shape == (3, 2) and out.dtype.name == dtype
    assert (out == np.asarray(expected, dtype=out.dtype)).all()


def test_constant_broadcasts_an_array_value():
    out = Constant(np.array([1.0, 2.0, 3.0]))((2, 3), "float64")
    np.testing.assert_array_equal(out, [[1, 2, 3], [1, 2, 3]])
    assert out.flags.c_contiguous and out.flags.owndata
    assert Constant(np.array([1, 2])).get_config() == {"value": [1, 2]}  # JSON-friendly
    with pytest.raises(ValueError, match="broadcast"):
        Constant([1.0, 2.0])((2, 3))


def test_identity():
    np.testing.assert_array_equal(Identity()((3, 3), "float64"), np.eye(3))
    np.testing.assert_array_equal(Identity(gain=2.5)((2, 4)), 2.5 * np.eye(2, 4, dtype=np.float32))
    np.testing.assert_array_equal(Identity(gain=3)((4, 2), "int32"), 3 * np.eye(4, 2, dtype=np.int32))
    for shape in [(3,), (2, 2, 2), ()]:
        with pytest.raises(ValueError, match="2-D"):
            Identity()(shape)


# ---------------------------------------------------------------------------- random distributions


def test_random_normal_statistics():
    out = RandomNormal(mean=1.5, stddev=0.3, seed=11)((1000, 1000), "float64")
    assert out.mean() == pytest.approx(1.5, abs=0.3 * 5e-3)
    assert out.std() == pytest.approx(0.3, rel=5e-3)
    # an untruncated normal puts ~4.55% beyond two standard deviations
    assert np.mean(np.abs(out - 1.5) > 0.6) == pytest.approx(0.0455, abs=0.002)


def test_truncated_normal_statistics():
    mean, stddev = -1.0, 2.0
    out = TruncatedNormal(mean=mean, stddev=stddev, seed=12)((1000, 1000), "float64")
    z = (out - mean) / stddev
    assert out.mean() == pytest.approx(mean, abs=stddev * 5e-3)
    assert out.std() == pytest.approx(TRUNC_STD * stddev, rel=5e-3)
    assert np.abs(z).max() <= 2.0
    assert np.abs(z).max() > 1.999  # the tails reach the bound...
    assert np.mean(np.abs(z) > 1.99) < 0.002  # ...but are re-drawn, not clipped onto it
    assert np.mean(np.abs(z) < 1.0) == pytest.approx(P_WITHIN_1_OF_TRUNCATED, abs=0.002)


def test_truncated_normal_bound_in_float32():
    out = TruncatedNormal(mean=0.25, stddev=0.05, seed=13)((500, 500))
    assert np.abs(out.astype(np.float64) - 0.25).max() <= 0.1 * (1 + 1e-6)


def test_random_uniform_statistics():
    out = RandomUniform(minval=-2.0, maxval=3.0, seed=14)((1000, 1000), "float64")
    assert out.min() >= -2.0 and out.max() <= 3.0
    assert out.min() < -1.999 and out.max() > 2.999  # fills the range
    assert out.mean() == pytest.approx(0.5, abs=0.01)
    assert out.std() == pytest.approx(5 / math.sqrt(12), rel=5e-3)


def test_random_uniform_defaults():
    out = RandomUniform(seed=15)((1000, 1000))
    assert out.min() >= -0.05 and out.max() <= 0.05
    assert out.std() == pytest.approx(0.1 / math.sqrt(12), rel=5e-3)


@pytest.mark.parametrize("dtype", ["int8", "int32", "int64", "uint8"])
def test_random_uniform_integers(dtype):
    minval = 0 if dtype.startswith("u") else -3
    out = RandomUniform(minval=minval, maxval=4, seed=16)((100_000,), dtype)
    assert out.dtype == np.dtype(dtype)
    values, counts = np.unique(out, return_counts=True)
    assert values.tolist() == list(range(minval, 4))  # maxval is excluded
    assert np.allclose(counts / out.size, 1 / len(values), atol=0.01)


def test_random_uniform_integers_with_fractional_bounds():
    assert set(RandomUniform(-0.5, 2.5, seed=1)((1000,), "int32").tolist()) == {0, 1, 2}
    assert set(RandomUniform(seed=1)((100,), "int32").tolist()) == {0}  # [-0.05, 0.05) holds only 0
    with pytest.raises(ValueError, match="no integer"):
        RandomUniform(0.2, 0.7, seed=1)(3, "int32")
    with pytest.raises(ValueError, match="int8"):
        RandomUniform(0, 1000, seed=1)(3, "int8")


def expected_std(scale, mode, shape):
    fan_in, fan_out = initializers.compute_fans(shape)
    fan = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[mode]
    return math.sqrt(scale / max(1.0, fan))


def check_variance_scaling(out, distribution, std, rel):
    """Each distribution ends with standard deviation `std`; check it and the bounds."""
    out = out.astype(np.float64)
    assert out.mean() == pytest.approx(0.0, abs=std * 0.02)
    assert out.std() == pytest.approx(std, rel=rel)
    if distribution == "truncated_normal":
        bound = 2 * std / TRUNC_STD  # two of the pre-truncation standard deviations
        assert np.abs(out).max() <= bound * (1 + 1e-12)
        assert np.abs(out).max() > 0.99 * bound
    elif distribution == "uniform":
        limit = math.sqrt(3) * std
        assert np.abs(out).max() <= limit
        assert np.abs(out).max() > 0.99 * limit
    else:
        assert np.abs(out).max() > 2.5 * std / TRUNC_STD  # no truncation


@pytest.mark.parametrize("distribution", VarianceScaling.DISTRIBUTIONS)
@pytest.mark.parametrize("mode", VarianceScaling.MODES)
@pytest.mark.parametrize("shape, rel", [(BIG, 5e-3), (CONV, 0.02)], ids=["dense", "conv"])
def test_variance_scaling(mode, distribution, shape, rel):
    out = VarianceScaling(scale=3.0, mode=mode, distribution=distribution, seed=17)(shape, "float64")
    check_variance_scaling(out, distribution, expected_std(3.0, mode, shape), rel)


def test_variance_scaling_small_fans_are_not_scaled_up():
    out = VarianceScaling(scale=4.0, distribution="uniform", seed=18)((), "float64")
    assert abs(float(out)) <= math.sqrt(12.0)  # fan 1: limit sqrt(3 * 4 / 1)
    rank1 = VarianceScaling(scale=4.0, mode="fan_out", distribution="untruncated_normal",
                            seed=18)((100_000,), "float64")
    assert rank1.std() == pytest.approx(math.sqrt(4.0 / 100_000), rel=0.02)


PRESETS = [
    (GlorotNormal, 1.0, "fan_avg", "truncated_normal"),
    (GlorotUniform, 1.0, "fan_avg", "uniform"),
    (HeNormal, 2.0, "fan_in", "truncated_normal"),
    (HeUniform, 2.0, "fan_in", "uniform"),
    (LecunNormal, 1.0, "fan_in", "truncated_normal"),
    (LecunUniform, 1.0, "fan_in", "uniform"),
]


@pytest.mark.parametrize("cls, scale, mode, distribution", PRESETS, ids=[p[0].__name__ for p in PRESETS])
@pytest.mark.parametrize("shape, rel", [(BIG, 5e-3), (CONV, 0.02)], ids=["dense", "conv"])
def test_presets(cls, scale, mode, distribution, shape, rel):
    init = cls(seed=19)
    assert isinstance(init, VarianceScaling)
    assert (init.scale, init.mode, init.distribution) == (scale, mode, distribution)
    out = init(shape, "float64")
    check_variance_scaling(out, distribution, expected_std(scale, mode, shape), rel)
    same = VarianceScaling(scale, mode, distribution, seed=19)(shape, "float64")
    np.testing.assert_array_equal(out, same)


def test_preset_formulas_in_closed_form():
    # the textbook formulas, written out independently of the mode table
    assert np.abs(GlorotUniform(seed=1)(BIG, "float64")).max() == pytest.approx(
        math.sqrt(6 / (2000 + 500)), rel=1e-3)
    assert np.abs(HeUniform(seed=1)(BIG, "float64")).max() == pytest.approx(math.sqrt(6 / 2000), rel=1e-3)
    assert np.abs(LecunUniform(seed=1)(BIG, "float64")).max() == pytest.approx(math.sqrt(3 / 2000), rel=1e-3)
    assert GlorotNormal(seed=1)(BIG, "float64").std() == pytest.approx(math.sqrt(2 / 2500), rel=5e-3)
    assert HeNormal(seed=1)(CONV, "float64").std() == pytest.approx(math.sqrt(2 / 576), rel=0.02)
    assert LecunNormal(seed=1)(CONV, "float64").std() == pytest.approx(math.sqrt(1 / 576), rel=0.02)


# ---------------------------------------------------------------------------- orthogonal


def keras_orthogonal(shape, gain, seed):
    """Keras's algorithm, written out with the same draws."""
    rows, cols = math.prod(shape[:-1]), shape[-1]
    a = np.random.default_rng(seed).standard_normal((max(rows, cols), min(rows, cols)))
    q, r = np.linalg.qr(a)
    q = q * np.sign(np.diag(r))
    if rows < cols:
        q = q.T
    return gain * q.reshape(shape)


@pytest.mark.parametrize("shape", [(50, 20), (20, 50), (30, 30), (3, 3, 16, 32), (1, 1, 16, 64)],
                         ids=["tall", "wide", "square", "conv-tall", "conv-wide"])
@pytest.mark.parametrize("gain", [1.0, 2.5])
def test_orthogonal(shape, gain):
    out = Orthogonal(gain=gain, seed=20)(shape, "float64")
    assert out.shape == shape
    flat = out.reshape(-1, shape[-1])
    small = min(flat.shape)
    gram = flat.T @ flat if flat.shape[0] >= flat.shape[1] else flat @ flat.T
    np.testing.assert_allclose(gram, gain**2 * np.eye(small), atol=1e-10)
    np.testing.assert_allclose(out, keras_orthogonal(shape, gain, 20), rtol=1e-12, atol=1e-12)


def test_orthogonal_float32_and_distinct_draws():
    q = Orthogonal(seed=21)((64, 64))
    np.testing.assert_allclose(q.T.astype(np.float64) @ q, np.eye(64), atol=1e-5)
    assert not np.allclose(q, Orthogonal(seed=22)((64, 64)))


@pytest.mark.parametrize("shape", [(), (5,)])
def test_orthogonal_needs_rank_2(shape):
    with pytest.raises(ValueError, match="rank"):
        Orthogonal()(shape)


# ---------------------------------------------------------------------------- seeding


@pytest.mark.parametrize("init", RANDOM, ids=ids(RANDOM))
def test_seeded_initializers_repeat_and_differ_by_seed(init):
    a, b = init((40, 30)), init((40, 30))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, init.with_seed(init.seed + 1)((40, 30)))
    np.testing.assert_array_equal(a, type(init).from_config(init.get_config())((40, 30)))


@pytest.mark.parametrize("init", RANDOM, ids=ids(RANDOM))
def test_set_seed_makes_unseeded_initializers_reproducible(init):
    unseeded = init.with_seed(None)
    assert unseeded.seed is None
    random.set_seed(5)
    a, b = unseeded((40, 30)), unseeded((40, 30))
    assert not np.array_equal(a, b)  # each unseeded call draws anew
    random.set_seed(5)
    np.testing.assert_array_equal(unseeded((40, 30)), a)
    np.testing.assert_array_equal(unseeded((40, 30)), b)
    # one unseeded call is exactly "pin a drawn seed, then call" (what ckpt.Variable does)
    random.set_seed(6)
    c = unseeded((40, 30))
    random.set_seed(6)
    np.testing.assert_array_equal(unseeded.with_seed(random.draw_seed())((40, 30)), c)


def test_set_seed_matches_default_rng_and_keeps_the_generator_object():
    gen = random.generator()
    random.set_seed(123)
    assert random.generator() is gen
    np.testing.assert_array_equal(gen.random(5), np.random.default_rng(123).random(5))
    random.set_seed(123)
    first = [random.draw_seed() for _ in range(3)]
    random.set_seed(123)
    assert [random.draw_seed() for _ in range(3)] == first
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in first)
    assert len(set(first)) == 3


@pytest.mark.parametrize("seed, error", [(-1, ValueError), (1.5, TypeError), (True, TypeError),
                                         ("1", TypeError)])
def test_set_seed_rejects_bad_seeds(seed, error):
    with pytest.raises(error):
        random.set_seed(seed)


def test_draw_seed_is_thread_safe():
    random.set_seed(7)
    expected = sorted(random.draw_seed() for _ in range(4000))
    random.set_seed(7)
    drawn: list[int] = []

    def work():
        seeds = [random.draw_seed() for _ in range(500)]
        drawn.extend(seeds)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(drawn) == expected


def test_with_seed():
    init = VarianceScaling(scale=2.0, mode="fan_out", distribution="uniform", seed=1)
    other = init.with_seed(9)
    assert other is not init and type(other) is VarianceScaling
    assert other.get_config() == {"scale": 2.0, "mode": "fan_out", "distribution": "uniform", "seed": 9}
    assert init.seed == 1  # the original is untouched
    assert GlorotUniform().with_seed(4) == GlorotUniform(seed=4)
    for init in [Zeros(), Ones(), Constant(2), Identity(gain=2.0)]:
        assert init.seed is None
        assert init.with_seed(4) is init


@pytest.mark.parametrize("seed, error", [(-1, ValueError), (0.5, TypeError), ("3", TypeError)])
def test_bad_initializer_seed(seed, error):
    with pytest.raises(error):
        RandomNormal(seed=seed)


# ---------------------------------------------------------------------------- configs and get()


CONFIGURED = [
    Zeros(), Ones(), Constant(0.5), Constant([1, 2]), Identity(gain=3.0),
    RandomNormal(mean=1.0, stddev=0.2, seed=3), RandomUniform(minval=-1.0, maxval=2.0, seed=3),
    TruncatedNormal(mean=-1.0, stddev=0.5, seed=None), Orthogonal(gain=2.0, seed=3),
    VarianceScaling(scale=0.5, mode="fan_avg", distribution="untruncated_normal", seed=3),
    GlorotNormal(seed=3), GlorotUniform(), HeNormal(seed=0), HeUniform(seed=3),
    LecunNormal(seed=3), LecunUniform(seed=3),
]


@pytest.mark.parametrize("init", CONFIGURED, ids=ids(CONFIGURED))
def test_config_round_trips(init):
    config = init.get_config()
    json.dumps(config)
    again = type(init).from_config(config)
    assert again == init and hash(again) == hash(init) and again is not init
    assert initializers.get(initializers.serialize(init)) == init
    assert initializers.get(json.loads(json.dumps(initializers.serialize(init)))) == init
    assert repr(again) == repr(init)
    assert eval(repr(init), vars(initializers)) == init  # the repr is the constructor call


def test_configs_and_repr_match_keras():
    assert RandomNormal().get_config() == {"mean": 0.0, "stddev": 0.05, "seed": None}
    assert RandomUniform().get_config() == {"minval": -0.05, "maxval": 0.05, "seed": None}
    assert VarianceScaling().get_config() == {"scale": 1.0, "mode": "fan_in",
                                              "distribution": "truncated_normal", "seed": None}
    assert Orthogonal().get_config() == {"gain": 1.0, "seed": None}
    assert Identity().get_config() == {"gain": 1.0}
    assert Constant().get_config() == {"value": 0}
    assert Zeros().get_config() == {}
    assert GlorotUniform(seed=1).get_config() == {"seed": 1}
    assert repr(GlorotUniform(seed=1)) == "GlorotUniform(seed=1)"
    assert repr(Zeros()) == "Zeros()"
    assert RandomNormal(seed=1) != RandomNormal(seed=2)
    assert GlorotUniform(seed=1) != VarianceScaling(1.0, "fan_avg", "uniform", seed=1)


@pytest.mark.parametrize("name, cls", [
    ("GlorotUniform", GlorotUniform), ("glorot_uniform", GlorotUniform), ("he_normal", HeNormal),
    ("zeros", Zeros), ("Ones", Ones), ("variance_scaling", VarianceScaling),
    ("truncated_normal", TruncatedNormal), ("random_uniform", RandomUniform),
    ("lecun_uniform", LecunUniform), ("orthogonal", Orthogonal), ("identity", Identity),
    ("constant", Constant),
])
def test_get_by_name(name, cls):
    init = initializers.get(name)
    assert type(init) is cls and init == cls()


def test_get_instance_and_dict():
    init = HeNormal(seed=2)
    assert initializers.get(init) is init
    assert initializers.get({"class_name": "he_normal", "config": {"seed": 2}}) == init
    assert initializers.get({"class_name": "Zeros"}) == Zeros()


@pytest.mark.parametrize("identifier", ["glorot", "GLOROT_UNIFORM", "", None, 3,
                                        {"class_name": "Nope", "config": {}}, {"config": {}}])
def test_get_rejects_unknown(identifier):
    with pytest.raises(ValueError) as info:
        initializers.get(identifier)
    if isinstance(identifier, str):
        assert "glorot_uniform" in str(info.value) and "GlorotUniform" in str(info.value)


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize("make", [
    lambda: RandomNormal(stddev=-1.0),
    lambda: TruncatedNormal(stddev=-0.1),
    lambda: RandomNormal(mean=float("nan")),
    lambda: RandomUniform(minval=1.0, maxval=0.0),
    lambda: VarianceScaling(scale=0.0),
    lambda: VarianceScaling(scale=-1.0),
    lambda: VarianceScaling(mode="fan_sum"),
    lambda: VarianceScaling(distribution="gaussian"),
], ids=["normal-stddev", "truncated-stddev", "nan-mean", "uniform-range", "scale-0", "scale-neg",
        "mode", "distribution"])
def test_invalid_arguments(make):
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize("init", RANDOM, ids=ids(RANDOM))
@pytest.mark.parametrize("dtype", ["int32", "bool", "complex64"])
def test_random_initializers_need_float(init, dtype):
    if isinstance(init, RandomUniform) and dtype == "int32":
        return  # draws integers; covered above
    with pytest.raises(ValueError, match=f"{type(init).__name__}.*{dtype}"):
        init((4, 4), dtype)


def test_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match="negative"):
        Zeros()((2, -1))
    with pytest.raises(TypeError):
        Zeros()((2.5, 3))
    with pytest.raises(TypeError):
        Zeros()((2, 3), dtype="float8")
