"""ckpt.Variable against the tf.Variable guides' examples and the assign/cast rules."""

from __future__ import annotations

import gc
import weakref

import ml_dtypes
import numpy as np
import pytest

import ckpt


def _contains(variables, v):
    return any(x is v for x in variables)


# --- creation and dtype inference (guide: "Create a variable") ---------------------------
def test_guide_creation_shapes_and_dtypes():
    my_tensor = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)
    my_variable = ckpt.Variable(my_tensor)
    bool_variable = ckpt.Variable([False, False, False, True])
    complex_variable = ckpt.Variable([5 + 4j, 6 + 1j])
    assert my_variable.shape == (2, 2)
    assert my_variable.dtype == np.float32
    np.testing.assert_array_equal(my_variable.numpy(), my_tensor)
    assert bool_variable.dtype == np.bool_
    assert complex_variable.dtype == np.complex128
    # numpy functions take a Variable: argmax per column, reshape
    np.testing.assert_array_equal(np.argmax(my_variable, axis=0), [1, 1])
    np.testing.assert_array_equal(np.reshape(my_variable, [1, 4]), [[1.0, 2.0, 3.0, 4.0]])


@pytest.mark.parametrize("value, dtype", [
    (3.14, np.float32), (1, np.int32), ([1, 2, 3], np.int32), (True, np.bool_),
    (2 ** 40, np.int64), (1 + 2j, np.complex128), ([[1.0, 2], [3, 4]], np.float32),
    (np.float64(1.5), np.float64), (np.arange(3, dtype=np.uint16), np.uint16),
])
def test_dtype_inference_follows_tensorflow(value, dtype):
    assert ckpt.Variable(value).dtype == np.dtype(dtype)


def test_dtype_argument_casts_and_refuses_lossy_casts():
    assert ckpt.Variable([1, 2], dtype="float64").dtype == np.float64
    v = ckpt.Variable(1.5, dtype=ckpt.dtypes.bfloat16)
    assert v.dtype == ml_dtypes.bfloat16 and float(v) == 1.5
    with pytest.raises(TypeError):
        ckpt.Variable(1.5, dtype=np.int32)
    with pytest.raises(TypeError):
        ckpt.Variable(300, dtype=np.int8)


@pytest.mark.parametrize("name", list(ckpt.dtypes.NAMES))
def test_every_dtype_can_be_held(name):
    dtype = ckpt.dtypes.as_dtype(name)
    value = ckpt.initializers.Zeros()((2,), dtype) if name != "string" else [b"a", b"b"]
    v = ckpt.Variable(value, dtype=dtype)
    assert v.dtype == dtype and v.shape == (2,)


def test_byte_strings():
    v = ckpt.Variable(["abc"])
    assert v.dtype == ckpt.dtypes.string
    assert v.numpy()[0] == b"abc"
    v.assign([b"a much longer value \x00 with a NUL"])
    assert v.numpy()[0] == b"a much longer value \x00 with a NUL"
    with pytest.raises(TypeError):
        v.assign([1])
    with pytest.raises(TypeError):
        v.assign_add([b"x"])
    assert ckpt.Variable(b"s").numpy() == b"s"


def test_from_another_variable_copies_memory():
    a = ckpt.Variable([2.0, 3.0])
    b = ckpt.Variable(a)
    a.assign([5, 6])
    np.testing.assert_array_equal(a.numpy(), [5.0, 6.0])
    np.testing.assert_array_equal(b.numpy(), [2.0, 3.0])
    assert not np.shares_memory(a._value, b._value)


def test_from_numpy_array_does_not_alias_it():
    source = np.zeros(3, dtype=np.float32)
    v = ckpt.Variable(source)
    source[0] = 7
    assert v.numpy()[0] == 0


# --- assign -------------------------------------------------------------------------------
def test_guide_assign_keeps_dtype_and_buffer():
    a = ckpt.Variable([2.0, 3.0])
    buffer = a._value
    a.assign([1, 2])
    assert a.dtype == np.float32
    np.testing.assert_array_equal(a.numpy(), [1.0, 2.0])
    assert a._value is buffer
    np.testing.assert_array_equal(a.assign_add([2, 3]).numpy(), [3.0, 5.0])
    np.testing.assert_array_equal(a.assign_sub([3, 5]).numpy(), [0.0, 0.0])
    assert a._value is buffer


def test_guide_shape_error_names_variable_and_shapes():
    a = ckpt.Variable([2.0, 3.0])
    with pytest.raises(ValueError, match=r"Cannot assign to variable Variable:0: shapes \(2,\) and \(3,\) "
                                         r"are incompatible"):
        a.assign([1.0, 2.0, 3.0])
    np.testing.assert_array_equal(a.numpy(), [2.0, 3.0])


def test_scalars_broadcast():
    v = ckpt.Variable(np.ones((2, 3)))
    v.assign(0)
    np.testing.assert_array_equal(v.numpy(), np.zeros((2, 3)))
    v.assign_add(2.5)
    assert (v.numpy() == 2.5).all()


def test_read_value_false_returns_none():
    v = ckpt.Variable(1.0)
    assert v.assign(2.0, read_value=False) is None
    assert v.assign_add(1.0, read_value=False) is None
    assert v.assign_sub(1.0, read_value=False) is None
    assert float(v) == 2.0
    assert v.assign(3.0) is v


@pytest.mark.parametrize("var_value, new, ok", [
    (np.float32(0), np.int64(3), True),                     # int -> float
    (np.float32(0), np.float64(1.5), True),                 # float64 -> float32
    (np.int32(0), 3.5, False),                              # float -> int
    (np.int32(0), np.float32(1.0), False),
    (np.float64(0), 1 + 1j, False),                         # complex -> real
    (np.bool_(False), 1, False),                            # anything -> bool
    (np.bool_(False), np.float32(0), False),
    (np.bool_(False), True, True),
    (np.int8(0), 127, True),
    (np.int8(0), 128, False),                               # does not fit
    (np.int32(0), np.int64(2 ** 40), False),
    (np.int32(0), np.int64(5), True),
    (np.uint8(0), -1, False),
    (np.complex64(0), 2.5, True),
])
def test_same_kind_cast_rule(var_value, new, ok):
    v = ckpt.Variable(var_value)
    before = v.numpy()
    if ok:
        v.assign(new)
        assert v.numpy() == np.asarray(new).astype(v.dtype)
    else:
        with pytest.raises(TypeError):
            v.assign(new)
        assert v.numpy() == before
    assert v.dtype == np.asarray(var_value).dtype


def test_assign_into_bfloat16_and_float16():
    v = ckpt.Variable(np.zeros(2, dtype=ml_dtypes.bfloat16))
    v.assign([1.5, 2])
    np.testing.assert_array_equal(v.numpy().astype(np.float32), [1.5, 2.0])
    v.assign_add(np.float32(1))
    np.testing.assert_array_equal(v.numpy().astype(np.float32), [2.5, 3.0])


def test_assign_from_variable():
    a, b = ckpt.Variable([1.0, 2.0]), ckpt.Variable([3.0, 4.0])
    a.assign(b)
    np.testing.assert_array_equal(a.numpy(), [3.0, 4.0])


# --- reads --------------------------------------------------------------------------------
def test_reads_are_copies_and_snapshots_read_only():
    v = ckpt.Variable([1.0, 2.0])
    n = v.numpy()
    n[0] = 100
    assert v.numpy()[0] == 1.0
    snap = v.value()
    assert not snap.flags.writeable
    v.assign([5, 5])
    assert snap[0] == 1.0
    assert not v.read_value().flags.writeable
    arr = np.asarray(v)
    arr[0] = 9
    assert v.numpy()[0] == 5.0


def test_scalar_numpy_is_a_numpy_scalar():
    assert isinstance(ckpt.Variable(3.14).numpy(), np.float32)


def test_repr():
    v = ckpt.Variable(3.14, name="var_a")
    assert repr(v) == "<ckpt.Variable 'var_a:0' shape=() dtype=float32, numpy=3.14>"
    w = ckpt.Variable([1.0, 2.0], name="w")
    assert repr(w) == "<ckpt.Variable 'w:0' shape=(2,) dtype=float32, numpy=array([1., 2.], dtype=float32)>"


# --- operators ----------------------------------------------------------------------------
def test_operators_return_numpy_arrays():
    a = ckpt.Variable([1.0, 2.0])
    b = ckpt.Variable([3.0, 4.0])
    np.testing.assert_array_equal(a + b, [4.0, 6.0])
    np.testing.assert_array_equal(a - 1, [0.0, 1.0])
    np.testing.assert_array_equal(2 * a, [2.0, 4.0])
    np.testing.assert_array_equal(a / 2, [0.5, 1.0])
    np.testing.assert_array_equal(b // 2, [1.0, 2.0])
    np.testing.assert_array_equal(b % 2, [1.0, 0.0])
    np.testing.assert_array_equal(a ** 2, [1.0, 4.0])
    np.testing.assert_array_equal(2 ** a, [2.0, 4.0])
    assert (a @ b) == 11.0
    np.testing.assert_array_equal(-a, [-1.0, -2.0])
    np.testing.assert_array_equal(abs(ckpt.Variable([-1.0])), [1.0])
    np.testing.assert_array_equal(a < b, [True, True])
    np.testing.assert_array_equal(np.ones(2) + a, [2.0, 3.0])
    assert isinstance(a + b, np.ndarray)
    m = ckpt.Variable(np.eye(2))
    np.testing.assert_array_equal(np.ones((1, 2)) @ m, [[1.0, 1.0]])
    # broadcasting
    np.testing.assert_array_equal(ckpt.Variable([[1], [2]]) + np.array([10, 20]), [[11, 21], [12, 22]])


def test_guide_equality_is_elementwise():
    t = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)
    a = ckpt.Variable(t, name="Mark")
    b = ckpt.Variable(t + 1, name="Mark")
    assert a.name == b.name == "Mark:0"
    np.testing.assert_array_equal(a == b, [[False, False], [False, False]])
    np.testing.assert_array_equal(a != b, [[True, True], [True, True]])
    assert {a: 1, b: 2}[a] == 1  # hashable by identity


def test_guide_variable_plus_one():
    v = ckpt.Variable(0.0)
    w = v + 1
    assert w == 1.0 and isinstance(w, (np.ndarray, np.generic))
    v.assign_add(1)
    assert float(v) == 1.0


def test_indexing_and_iteration():
    v = ckpt.Variable([[1, 2], [3, 4]])
    row = v[0]
    row[0] = 100
    assert v[0, 0] == 1
    assert [r.tolist() for r in v] == [[1, 2], [3, 4]]
    assert len(v) == 2
    with pytest.raises(TypeError):
        len(ckpt.Variable(1.0))
    with pytest.raises(TypeError):
        iter(ckpt.Variable(1.0))


# --- names, trainable, devices -------------------------------------------------------------
def test_names_and_scopes():
    assert ckpt.Variable(1.0).name == "Variable:0"
    with ckpt.name_scope("layer1"):
        assert ckpt.Variable(1.0, name="w").name == "layer1/w:0"
        with ckpt.name_scope("inner") as scope:
            assert scope == "layer1/inner/"
            v = ckpt.Variable(1.0)
            assert v.name == "layer1/inner/Variable:0" and v.key == "layer1/inner/Variable"
        with ckpt.name_scope("abs/"):
            assert ckpt.Variable(1.0, name="x").name == "abs/x:0"
        with ckpt.name_scope(""):
            assert ckpt.Variable(1.0, name="x").name == "x:0"
    assert ckpt.Variable(1.0, name="a/b").name == "a/b:0"


@pytest.mark.parametrize("bad", ["a:0", "a//b", "..", "a/./b", "x\x00y"])
def test_invalid_names(bad):
    with pytest.raises(ValueError):
        ckpt.Variable(1.0, name=bad)


def test_trainable():
    step_counter = ckpt.Variable(1, trainable=False)
    w = ckpt.Variable(1.0)
    assert not step_counter.trainable and w.trainable
    # == is elementwise (1 == 1.0), so membership is checked by identity
    assert _contains(ckpt.trainable_variables(), w)
    assert not _contains(ckpt.trainable_variables(), step_counter)
    assert _contains(ckpt.global_variables(), step_counter)


@pytest.mark.parametrize("spec, requested", [
    ("CPU:0", "/device:CPU:0"), ("GPU:0", "/device:GPU:0"), ("/gpu:1", "/device:GPU:1"),
    ("/job:ps/task:7/device:CPU:0", "/job:ps/task:7/device:CPU:0"),
    ("/device:GPU:0", "/device:GPU:0"),
])
def test_device_scopes_are_recorded_and_placement_is_soft(spec, requested):
    with ckpt.device(spec):
        v = ckpt.Variable(1.0)
    assert v.requested_device == requested
    assert v.device == "/job:localhost/replica:0/task:0/device:CPU:0"
    assert ckpt.Variable(1.0).requested_device == ""


def test_device_scopes_nest_and_merge():
    with ckpt.device("/job:ps/task:7"):
        with ckpt.device("GPU:1"):
            v = ckpt.Variable(1.0)
        with ckpt.device(None):
            w = ckpt.Variable(1.0)
    assert v.requested_device == "/job:ps/task:7/device:GPU:1"
    assert w.requested_device == ""
    with pytest.raises(ValueError):
        with ckpt.device("FPGA:0"):
            pass


# --- lifecycle ----------------------------------------------------------------------------
def test_unreferenced_variables_are_freed_and_leave_the_registry():
    v = ckpt.Variable(np.zeros(10), name="ephemeral")
    ref = weakref.ref(v)
    assert _contains(ckpt.global_variables(), v)
    del v
    gc.collect()
    assert ref() is None
    assert all(x.name != "ephemeral:0" for x in ckpt.global_variables())


def test_global_variables_in_creation_order():
    made = [ckpt.Variable(float(i), name=f"order_{i}") for i in range(5)]
    live = [v for v in ckpt.global_variables() if v.name.startswith("order_")]
    assert all(x is y for x, y in zip(live, made))
    assert [v.name for v in live] == [f"order_{i}:0" for i in range(5)]


# --- initialization ------------------------------------------------------------------------
def test_guide_initialized_value():
    w = ckpt.Variable(ckpt.initializers.RandomNormal(stddev=0.35), shape=(784, 200), name="weights")
    initial = w.numpy()
    w2 = ckpt.Variable(w.initialized_value(), name="w2")
    w_twice = ckpt.Variable(w.initialized_value() * 2.0, name="w_twice")
    np.testing.assert_array_equal(w2.numpy(), initial)
    np.testing.assert_array_equal(w_twice.numpy(), initial * 2.0)
    w.assign_add(1.0)
    np.testing.assert_array_equal(w.initialized_value(), initial)
    w.initialize()
    np.testing.assert_array_equal(w.numpy(), initial)


def test_initializer_called_with_shape_and_dtype():
    calls = []

    def init(shape, dtype=None):
        calls.append((shape, dtype))
        return np.full(shape, 7, dtype=dtype)

    v = ckpt.Variable(init, shape=(2, 3), dtype=np.int16)
    assert calls == [((2, 3), np.dtype(np.int16))]
    assert v.dtype == np.int16 and (v.numpy() == 7).all()
    assert ckpt.Variable(lambda: np.ones(3)).shape == (3,)


def test_initialize_resets_array_valued_variables():
    v = ckpt.Variable([1.0, 2.0])
    v.assign([9, 9])
    v.initialize()
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])


def test_deferred_init_allocates_nothing_until_initialized():
    with ckpt.deferred_init():
        v = ckpt.Variable(ckpt.initializers.GlorotUniform(seed=3), shape=(300, 200), name="big")
        eager = ckpt.Variable([1.0], name="eager")
    assert v._value is None and not v.is_initialized()
    assert eager.is_initialized()
    assert "big" in ckpt.report_uninitialized_variables()
    assert ckpt.report_uninitialized_variables([eager]) == []
    with pytest.raises(ckpt.UninitializedVariableError, match="big:0"):
        v.numpy()
    with pytest.raises(ckpt.CheckpointError):
        v + 1
    with pytest.raises(ckpt.UninitializedVariableError):
        v.assign_add(1.0)
    assert "uninitialized" in repr(v)
    ckpt.initialize_variables([v])
    assert v.is_initialized()
    np.testing.assert_array_equal(v.numpy(), ckpt.initializers.GlorotUniform(seed=3)((300, 200)))
    assert "big" not in ckpt.report_uninitialized_variables()


def test_deferred_init_needs_a_shape():
    with ckpt.deferred_init(), pytest.raises(ValueError, match="shape"):
        ckpt.Variable(ckpt.initializers.Zeros())


def test_assign_initializes_a_deferred_variable():
    with ckpt.deferred_init():
        v = ckpt.Variable(ckpt.initializers.Ones(), shape=(2,))
    v.assign([3.0, 4.0])
    assert v.is_initialized()
    np.testing.assert_array_equal(v.numpy(), [3.0, 4.0])


def test_initialize_all_variables():
    v = ckpt.Variable(5.0)
    v.assign(1.0)
    ckpt.initialize_all_variables()
    assert float(v) == 5.0


def test_unseeded_initializers_are_reproducible_with_set_seed():
    ckpt.random.set_seed(1234)
    a = ckpt.Variable(ckpt.initializers.RandomNormal(), shape=(5,)).numpy()
    ckpt.random.set_seed(1234)
    b = ckpt.Variable(ckpt.initializers.RandomNormal(), shape=(5,)).numpy()
    np.testing.assert_array_equal(a, b)
    c = ckpt.Variable(ckpt.initializers.RandomNormal(), shape=(5,)).numpy()
    assert not np.array_equal(a, c)


def test_shape_argument_must_match_value():
    with pytest.raises(ValueError):
        ckpt.Variable([1.0, 2.0], shape=(3,))
    assert ckpt.Variable([1.0, 2.0], shape=[2]).shape == (2,)


def test_ragged_and_unsupported_values_are_refused():
    with pytest.raises(ValueError):
        ckpt.Variable([[1, 2], [3]])
    with pytest.raises(TypeError):
        ckpt.Variable(np.array(["2020-01-01"], dtype="datetime64[D]"))
    with pytest.raises(TypeError):
        ckpt.Variable(2 ** 70)


def test_large_buffers_are_page_aligned():
    """Restores copy fastest into page-aligned buffers (see ckpt.buffers)."""
    from_array = ckpt.Variable(np.zeros(1 << 16, np.float32))
    from_init = ckpt.Variable(ckpt.initializers.RandomNormal(seed=0), shape=(1 << 16,))
    with ckpt.deferred_init():
        deferred = ckpt.Variable(ckpt.initializers.Zeros(), shape=(256, 256))
    deferred.initialize()
    for v in (from_array, from_init, deferred):
        assert v._value.ctypes.data % 4096 == 0 and v._value.flags.c_contiguous
    np.testing.assert_array_equal(from_init.numpy(), ckpt.initializers.RandomNormal(seed=0)((1 << 16,)))
