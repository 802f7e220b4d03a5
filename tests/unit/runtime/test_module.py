"""ckpt.Module against the tf.Module guide's examples."""

from __future__ import annotations

import numpy as np
import pytest

import ckpt
from ckpt.runtime import initializers


class SimpleModule(ckpt.Module):
    def __init__(self, name=None):
        super().__init__(name=name)
        self.a_variable = ckpt.Variable(5.0, name="train_me")
        self.non_trainable_variable = ckpt.Variable(5.0, trainable=False, name="do_not_train_me")

    def __call__(self, x):
        return self.a_variable * x + self.non_trainable_variable


class Dense(ckpt.Module):
    def __init__(self, in_features, out_features, name=None):
        super().__init__(name=name)
        self.w = ckpt.Variable(initializers.RandomNormal(seed=0), shape=(in_features, out_features), name="w")
        self.b = ckpt.Variable(np.zeros(out_features, dtype=np.float32), name="b")

    def __call__(self, x):
        return np.maximum(x @ self.w + self.b, 0)


class SequentialModule(ckpt.Module):
    def __init__(self, name=None):
        super().__init__(name=name)
        self.dense_1 = Dense(in_features=3, out_features=3)
        self.dense_2 = Dense(in_features=3, out_features=2)

    def __call__(self, x):
        return self.dense_2(self.dense_1(x))


class MLP(ckpt.Module):
    def __init__(self, input_size, sizes, name=None):
        super().__init__(name=name)
        self.layers = []
        with self.name_scope:
            for size in sizes:
                self.layers.append(Dense(input_size, size))
                input_size = size

    @ckpt.Module.with_name_scope
    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def names(variables):
    return [v.name for v in variables]


def test_guide_simple_module():
    simple_module = SimpleModule(name="simple")
    assert simple_module(np.float32(5.0)) == 30.0
    assert names(simple_module.trainable_variables) == ["train_me:0"]
    # attributes are visited in sorted order ("a_variable" < "non_trainable_variable"), as TF does
    assert names(simple_module.variables) == ["train_me:0", "do_not_train_me:0"]
    assert [p for p, _ in simple_module.named_variables()] == ["a_variable", "non_trainable_variable"]
    assert names(simple_module.non_trainable_variables) == ["do_not_train_me:0"]


def test_guide_sequential_module_submodules():
    my_model = SequentialModule(name="the_model")
    subs = my_model.submodules
    assert len(subs) == 2 and subs[0] is my_model.dense_1 and subs[1] is my_model.dense_2
    assert [p for p, _ in my_model.named_variables()] == ["dense_1/b", "dense_1/w", "dense_2/b", "dense_2/w"]
    assert my_model(np.ones((1, 3), dtype=np.float32)).shape == (1, 2)
    assert my_model.name == "the_model"


def test_guide_mlp_finds_variables_in_lists_and_names_them_in_scope():
    module = MLP(input_size=5, sizes=[5, 5])
    assert names(module.variables) == ["mlp/b:0", "mlp/w:0", "mlp/b:0", "mlp/w:0"]
    assert [p for p, _ in module.named_variables()] == ["layers/0/b", "layers/0/w", "layers/1/b", "layers/1/w"]
    assert [v.shape for v in module.variables] == [(5,), (5, 5), (5,), (5, 5)]
    assert module(np.ones((2, 5), dtype=np.float32)).shape == (2, 5)


def test_nested_name_scopes_give_full_names():
    class Inner(ckpt.Module):
        def __init__(self, name=None):
            super().__init__(name=name)
            with self.name_scope:
                self.kernel = ckpt.Variable(np.zeros((2, 2), np.float32), name="kernel")

    class Outer(ckpt.Module):
        def __init__(self):
            super().__init__()
            with self.name_scope:
                self.dense_0 = Inner(name="dense_0")

    outer = Outer()
    assert outer.name == "outer"
    assert names(outer.variables) == ["outer/dense_0/kernel:0"]


def test_default_name_is_snake_case_class_name():
    class MyHTTPModel(ckpt.Module):
        pass

    class DenseLayer(ckpt.Module):
        pass

    assert MyHTTPModel().name == "my_http_model"
    assert DenseLayer().name == "dense_layer"
    with pytest.raises(ValueError):
        ckpt.Module(name="not valid")


def test_dicts_tuples_shared_and_cyclic_references():
    m = ckpt.Module(name="m")
    shared = ckpt.Variable(1.0, name="shared")
    m.params = {"z": ckpt.Variable(2.0, name="z"), "a": (shared, ckpt.Variable(3.0, name="t1"))}
    m.alias = shared
    m.self_ref = m
    m.plain = [1, "x", None]
    paths = [p for p, _ in m.named_variables()]
    # "alias" sorts first, so the shared variable is listed once, under that path
    assert paths == ["alias", "params/a/1", "params/z"]
    assert len(m.variables) == 3
    assert m.submodules == []


def test_submodule_reachable_twice_is_listed_once():
    shared = Dense(2, 2, name="shared")
    m = ckpt.Module(name="m")
    m.first, m.second = shared, [shared]
    assert m.submodules == [shared]
    assert len(m.variables) == 2


def test_missing_super_init_is_a_clear_error():
    class Broken(ckpt.Module):
        def __init__(self):
            self.v = ckpt.Variable(1.0)

    with pytest.raises(RuntimeError, match="super"):
        Broken().variables


def test_module_created_later_in_another_scope():
    with ckpt.name_scope("outer"):
        m = SimpleModule(name="inner")
    with m.name_scope as scope:
        assert scope == "outer/inner/"
        v = ckpt.Variable(1.0, name="late")
    assert v.name == "outer/inner/late:0"


def readme_classes():
    """The README's Dense pattern, exactly (no name given, variables under its name scope),
    and a Net of them: classes named as a user names them, since names come from them."""

    class Dense(ckpt.Module):
        def __init__(self, n_in, n_out, name=None):
            super().__init__(name=name)
            with self.name_scope:
                self.kernel = ckpt.Variable(ckpt.initializers.GlorotUniform(), shape=(n_in, n_out), name="kernel")
                self.bias = ckpt.Variable(ckpt.initializers.Zeros(), shape=(n_out,), name="bias")

    class Net(ckpt.Module):
        def __init__(self, n_layers, name=None):
            super().__init__(name=name)
            with self.name_scope:
                self.layers = [Dense(4, 4) for _ in range(n_layers)]

    return Dense, Net


ReadmeDense, ReadmeNet = readme_classes()


def test_unnamed_modules_get_unique_names_within_their_scope():
    net = ReadmeNet(6, name="net")
    assert [layer.name for layer in net.layers] == ["dense"] + [f"dense_{i}" for i in range(1, 6)]
    assert len({v.name for v in net.variables}) == 12
    assert net.layers[3].kernel.name == "net/dense_3/kernel:0"
    other = ReadmeNet(2, name="other")  # another scope: its own "dense"
    assert other.layers[0].kernel.name == "other/dense/kernel:0"
    # every variable name is a distinct key, so saving by name works
    assert len(ckpt.Saver(net.variables + other.variables).var_list) == 16


def test_unique_names_skip_explicit_names_and_are_freed_with_their_module():
    with ckpt.name_scope("fresh_scope"):
        explicit = ReadmeDense(1, 1, name="dense")
        auto = ReadmeDense(1, 1)
        assert (explicit.name, auto.name) == ("dense", "dense_1")
        del explicit
        assert ReadmeDense(1, 1).name == "dense"  # the dropped module's name is free again
        kept = [ReadmeNet(0), ReadmeNet(0)]
        assert [m.name for m in kept] == ["net", "net_1"]


def test_scope_maps_work_with_the_readme_pattern(tmp_path):
    small = ReadmeNet(2, name="small_net")
    path = ckpt.Saver(small.variables).save(str(tmp_path / "s.h5"))  # keys: variable names
    with ckpt.deferred_init():
        big = ReadmeNet(3, name="big_net")
    pairs = ckpt.init_from_checkpoint(path, {"small_net/dense/": "big_net/dense/",
                                             "small_net/dense_1/": "big_net/dense_1/"})
    assert len(pairs) == 4
    np.testing.assert_array_equal(big.layers[1].kernel.numpy(), small.layers[1].kernel.numpy())
    assert not big.layers[2].kernel.is_initialized()


def test_dir_ckpt_lists_no_future_import():
    assert "annotations" not in dir(ckpt)
