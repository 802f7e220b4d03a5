"""Pretrained layers into larger models: init_from_checkpoint and partial restores."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import ckpt
from conftest import TESTS


def make(scope, names_shapes, fill=0.0):
    out = {}
    with ckpt.name_scope(scope):
        for name, shape in names_shapes:
            out[name] = ckpt.Variable(np.full(shape, fill, np.float32), name=name)
    return out


@pytest.fixture
def pretrained(tmp_path):
    """A checkpoint with old_scope/{w,b}, old_scope_1/w, other/w, all filled with distinct values."""
    vars_ = {}
    with ckpt.name_scope("old_scope"):
        vars_["old_scope/w"] = ckpt.Variable(np.full((2, 2), 1.0, np.float32), name="w")
        vars_["old_scope/b"] = ckpt.Variable(np.full(2, 2.0, np.float32), name="b")
    with ckpt.name_scope("old_scope_1"):
        vars_["old_scope_1/w"] = ckpt.Variable(np.full((2, 2), 3.0, np.float32), name="w")
    with ckpt.name_scope("other"):
        vars_["other/w"] = ckpt.Variable(np.full(3, 4.0, np.float32), name="w")
    return ckpt.Saver(vars_).save(str(tmp_path / "pre.h5"))


def test_scope_to_scope_does_not_capture_similar_prefixes(pretrained):
    new = make("new_scope", [("w", (2, 2)), ("b", (2,))])
    pairs = ckpt.init_from_checkpoint(pretrained, {"old_scope/": "new_scope/"})
    assert sorted((k, v.name) for k, v in pairs) == [("old_scope/b", "new_scope/b:0"),
                                                     ("old_scope/w", "new_scope/w:0")]
    np.testing.assert_array_equal(new["w"].numpy(), np.full((2, 2), 1.0))  # not old_scope_1's 3.0
    np.testing.assert_array_equal(new["b"].numpy(), np.full(2, 2.0))


def test_root_maps_to_a_scope(tmp_path):
    src = {"w": ckpt.Variable(np.full(2, 5.0, np.float32), name="plain_w")}
    path = ckpt.Saver(src).save(str(tmp_path / "root.msgpack"))
    target = make("big/enc", [("w", (2,))])
    ckpt.init_from_checkpoint(path, {"/": "big/enc/"})
    np.testing.assert_array_equal(target["w"].numpy(), [5.0, 5.0])


def test_scope_maps_to_the_models_root(pretrained):
    with ckpt.name_scope(""):
        target = ckpt.Variable(np.zeros(3, np.float32), name="zz_root_only/w")
    ckpt.init_from_checkpoint(pretrained, {"other/": "zz_root_only/"})
    np.testing.assert_array_equal(target.numpy(), np.full(3, 4.0))


def test_single_tensors_to_variables_names_and_lists(pretrained):
    a = ckpt.Variable(np.zeros((2, 2), np.float32), name="single_a")
    b1 = ckpt.Variable(np.zeros(2, np.float32), name="copy1")
    b2 = ckpt.Variable(np.zeros(2, np.float32), name="copy2")
    c = ckpt.Variable(np.zeros(3, np.float32), name="unique_by_name_xyz")
    pairs = ckpt.init_from_checkpoint(pretrained, [
        ("old_scope_1/w", a), ("old_scope/b", [b1, b2]), ("other/w", "unique_by_name_xyz:0")])
    assert len(pairs) == 4
    np.testing.assert_array_equal(a.numpy(), np.full((2, 2), 3.0))
    np.testing.assert_array_equal(b1.numpy(), [2.0, 2.0])
    np.testing.assert_array_equal(b2.numpy(), [2.0, 2.0])
    np.testing.assert_array_equal(c.numpy(), np.full(3, 4.0))


def test_one_tensor_to_several_variables_by_list_of_pairs(pretrained):
    x = ckpt.Variable(np.zeros(2, np.float32))
    y = ckpt.Variable(np.zeros(2, np.float32))
    ckpt.init_from_checkpoint(pretrained, [("old_scope/b", x), ("old_scope/b", y)])
    assert x.numpy().tolist() == y.numpy().tolist() == [2.0, 2.0]


def test_missing_keys_and_mismatches_raise_value_error_and_assign_nothing(pretrained):
    ok = ckpt.Variable(np.zeros(2, np.float32))
    bad_shape = ckpt.Variable(np.zeros(5, np.float32))
    with pytest.raises(ValueError) as info:
        ckpt.init_from_checkpoint(pretrained, {"old_scope/b": ok, "other/w": bad_shape,
                                               "old_scope/nothing": ckpt.Variable(0.0)})
    message = str(info.value)
    assert "other/w: shape (5,) in the model, (3,) in pre.h5" in message
    assert "old_scope/nothing: not found in pre.h5" in message
    assert not ok.numpy().any()


def test_scope_mapping_to_a_scope_with_an_extra_variable_fails(pretrained):
    extra = make("grown", [("w", (2, 2)), ("b", (2,)), ("gamma", (2,))])
    with pytest.raises(ValueError, match="old_scope/gamma: not found"):
        ckpt.init_from_checkpoint(pretrained, {"old_scope/": "grown/"})
    assert not extra["w"].numpy().any()


@pytest.mark.parametrize("mapping, message", [
    ({"old_scope/": "new_scope"}, "a scope maps to a scope"),
    ({"old_scope/w": "someplace/"}, "not a scope"),
    ({"old_scope/": "no_such_scope_anywhere/"}, "no variables in scope"),
    ({"old_scope/w": "no_variable_has_this_name"}, "no variable named"),
    ({"old_scope/w": 3}, "must be a Variable"),
])
def test_malformed_assignment_maps(pretrained, mapping, message):
    make("new_scope", [("w", (2, 2)), ("b", (2,))])
    with pytest.raises(ValueError, match=message):
        ckpt.init_from_checkpoint(pretrained, mapping)


def test_same_variable_from_two_keys_is_refused(pretrained):
    v = ckpt.Variable(np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="assigned twice"):
        ckpt.init_from_checkpoint(pretrained, [("old_scope/b", v), ("old_scope_1/w", v)])


# --- the canonical case: a trained 5-layer MLP into a 6-layer one (the quickstart's model) ----------
sys.path.insert(0, os.path.join(TESTS, os.pardir, "examples"))
from quickstart import MLP, train_step  # noqa: E402


@pytest.mark.parametrize("how", ["strict_false", "assignment_map"])
def test_five_layers_into_six(tmp_path, how):
    ckpt.random.set_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    y4 = np.stack([np.sin(x[:, :4].sum(1)), np.cos(x[:, 4:].sum(1)), x[:, 0], x[:, 1] * x[:, 2]], 1)
    small = MLP([8, 16, 16, 16, 16, 4], name="small")  # five layers
    losses = [train_step(small, x, y4) for _ in range(30)]
    assert losses[-1] < losses[0]
    if how == "strict_false":
        path = ckpt.Saver(small).save(str(tmp_path / "mlp5.h5"), global_step=30)  # keys: layers/i/...
    else:
        path = ckpt.Saver(small.variables).save(str(tmp_path / "mlp5.h5"), global_step=30)  # keys: names

    with ckpt.deferred_init():
        big = MLP([8, 16, 16, 16, 16, 4, 1], name="big")  # the same five layers and a sixth
    if how == "strict_false":
        result = ckpt.Saver(big).restore(path, strict=False)
        assert result.missing == ["layers/5/bias", "layers/5/kernel"] and result.unexpected == []
    else:
        pairs = ckpt.init_from_checkpoint(path, {f"small/dense_{i}/": f"big/dense_{i}/" for i in range(5)})
        assert len(pairs) == 10
    for i in range(5):
        np.testing.assert_array_equal(big.layers[i].kernel.numpy(), small.layers[i].kernel.numpy())
        np.testing.assert_array_equal(big.layers[i].bias.numpy(), small.layers[i].bias.numpy())
    sixth = big.layers[5].variables
    assert sorted(ckpt.report_uninitialized_variables(big.variables)) == sorted(v.key for v in sixth)
    ckpt.initialize_variables(sixth)
    assert ckpt.report_uninitialized_variables(big.variables) == []
    y1 = y4.sum(1, keepdims=True)
    big_losses = [train_step(big, x, y1, lr=0.02) for _ in range(30)]
    assert big_losses[-1] < big_losses[0]
    again = ckpt.Saver(big).save(str(tmp_path / "mlp6.h5"), global_step=60)
    assert ckpt.list_variables(again)[-1] == ("layers/5/kernel", [4, 1])


def test_init_from_checkpoint_takes_a_module_or_a_scope_to_module_map(tmp_path):
    small = MLP([3, 4, 2], name="pre")
    path = ckpt.Saver(small).save(str(tmp_path / "pre.h5"))  # keys: layers/0/kernel, ...
    with ckpt.deferred_init():
        same = MLP([3, 4, 2], name="same")
    pairs = ckpt.init_from_checkpoint(path, same)  # the Module itself: its keys as they are
    assert sorted(key for key, _ in pairs) == sorted(k for k, _ in small.named_variables())
    np.testing.assert_array_equal(same.layers[1].kernel.numpy(), small.layers[1].kernel.numpy())

    with ckpt.deferred_init():
        big = MLP([3, 4, 4, 2], name="big")
    # one pretrained layer into the bigger model's first layer, by checkpoint scope
    pairs = ckpt.init_from_checkpoint(path, {"layers/0/": big.layers[0]})
    assert sorted(key for key, _ in pairs) == ["layers/0/bias", "layers/0/kernel"]
    np.testing.assert_array_equal(big.layers[0].kernel.numpy(), small.layers[0].kernel.numpy())
    assert not big.layers[1].kernel.is_initialized()

    with pytest.raises(ValueError, match="scope ending in '/'"):
        ckpt.init_from_checkpoint(path, {"layers/0": big.layers[0]})
    with pytest.raises(ckpt.KeyNotFoundError, match="layers/2/kernel"):
        ckpt.init_from_checkpoint(path, big)  # the checkpoint has two layers, the model three
