"""Foreign checkpoints through ckpt's public API: recognition by content, restores with assignment
maps and transposition, and the command line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import assert_bit_exact, OUTSIDE_CHECKOUT, TESTS

import ckpt
from ckpt.cli.main import main

FIXTURES = os.path.join(TESTS, "fixtures", "foreign")
TORCH = os.path.join(FIXTURES, "torch_state.pt")
#: every fixture, the format it is, and one of its tensors
FILES = [("tf1_saver", "tensorflow", "encoder/dense/kernel"), ("tf2_object", "tensorflow", "save_counter/.ATTRIBUTES/VARIABLE_VALUE"),
         ("keras3.weights.h5", "keras", "layers/dense/vars/0"), ("keras_legacy_model.h5", "keras",
                                                                 "model_weights/d2/sequential/d2/bias"),
         ("keras3_model.keras", "keras", "layers/dense_1/vars/1"), ("flax_state.msgpack", "flax", "params/emb"),
         ("torch_state.pt", "pytorch", "t_view"), ("st.safetensors", "safetensors", "i8")]
SINGLE_FILES = [f for f in FILES if not f[0].startswith("tf")]


@pytest.mark.parametrize("name, fmt, key", SINGLE_FILES)
def test_formats_are_recognised_by_content_not_extension(tmp_path, name, fmt, key):
    disguised = tmp_path / "weights.bin.old"
    shutil.copyfile(os.path.join(FIXTURES, name), disguised)
    with ckpt.load_checkpoint(str(disguised)) as reader, ckpt.load_checkpoint(os.path.join(FIXTURES, name)) as orig:
        assert reader.format == fmt
        assert_bit_exact(orig.get_tensor(key), reader.get_tensor(key))


@pytest.mark.parametrize("name, fmt, key", FILES)
def test_list_and_load_variable(name, fmt, key):
    listed = dict(ckpt.list_variables(os.path.join(FIXTURES, name)))
    value = ckpt.load_variable(os.path.join(FIXTURES, name), key)
    assert listed[key] == list(value.shape)


def test_unknown_files_list_what_is_supported(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(ckpt.UnsupportedCheckpointError) as info:
        ckpt.load_checkpoint(str(path))
    for name in ("hdf5", "msgpack", "safetensors", "pytorch", "keras", "flax", "tensorflow"):
        assert name in str(info.value)


def test_importing_ckpt_formats_imports_no_codec_or_archive_modules():
    code = ("import sys, ckpt, ckpt.formats; "
            "print(sorted(m for m in ('h5py', 'msgpack', 'zipfile', 'pickletools') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=OUTSIDE_CHECKOUT).stdout
    assert out.strip() == "[]"


# --- restoring foreign tensors into a model ----------------------------------------------------
class Dense(ckpt.Module):
    def __init__(self, n_in, n_out, name):
        super().__init__(name=name)
        with self.name_scope:
            self.kernel = ckpt.Variable(ckpt.initializers.Zeros(), shape=(n_in, n_out), name="kernel")
            self.bias = ckpt.Variable(ckpt.initializers.Zeros(), shape=(n_out,), name="bias")


def test_init_from_checkpoint_transposes_torch_linear_weights():
    expected = np.load(os.path.join(FIXTURES, "torch_expected.npz"))
    layer = Dense(3, 4, name="layer1")  # torch's fc1 is Linear(3, 4): weight (4, 3)
    restored = ckpt.init_from_checkpoint(TORCH, {"fc1.weight": layer.kernel, "fc1.bias": "layer1/bias"},
                                         transpose=["fc1.weight"])
    assert [key for key, _ in restored] == ["fc1.weight", "fc1.bias"]
    assert_bit_exact(expected["fc1__weight"].T, layer.kernel.numpy())
    assert_bit_exact(expected["fc1__bias"], layer.bias.numpy())
    layer.kernel.assign(np.zeros((3, 4)))
    ckpt.init_from_checkpoint(TORCH, {"fc1.weight": layer.kernel}, transpose=lambda key: key.endswith(".weight"))
    assert_bit_exact(expected["fc1__weight"].T, layer.kernel.numpy())


def test_transpose_mistakes_are_refused_before_anything_changes():
    layer = Dense(3, 4, name="layer2")
    with pytest.raises(ckpt.MismatchError, match=r"fc1.weight: shape \(3, 4\) in the model, \(4, 3\) in torch_state.pt "
                                                 r"\(its transpose fits"):
        ckpt.init_from_checkpoint(TORCH, {"fc1.weight": layer.kernel, "fc1.bias": layer.bias})
    with pytest.raises(ValueError, match="transpose names 'fc1.weigth', which the assignment map does not restore"):
        ckpt.init_from_checkpoint(TORCH, {"fc1.weight": layer.kernel}, transpose=["fc1.weigth"])
    with pytest.raises(TypeError, match=r"write \['fc1.weight'\]"):
        ckpt.init_from_checkpoint(TORCH, {"fc1.weight": layer.kernel}, transpose="fc1.weight")
    wrong = ckpt.Variable(ckpt.initializers.Zeros(), shape=(4, 3), name="wrong")
    with pytest.raises(ckpt.MismatchError, match=r"\(transposed: \(3, 4\)\)"):
        ckpt.init_from_checkpoint(TORCH, {"fc1.weight": wrong, "fc1.bias": layer.bias}, transpose=["fc1.weight"])
    assert not layer.bias.numpy().any()  # nothing was assigned


def test_transpose_refuses_higher_ranks(tmp_path):
    path = str(tmp_path / "conv.safetensors")
    ckpt.Saver({"conv.weight": ckpt.Variable(np.ones((2, 3, 4), np.float32))}).save(path)
    target = ckpt.Variable(np.zeros((4, 3, 2), np.float32), name="conv_kernel")
    with pytest.raises(ckpt.MismatchError, match="transpose applies to 2-D tensors"):
        ckpt.init_from_checkpoint(path, {"conv.weight": target}, transpose=["conv.weight"])


def test_assignment_maps_over_tensorflow_and_keras_keys():
    expected = np.load(os.path.join(FIXTURES, "tf1_saver_expected.npz"))
    enc = Dense(4, 3, name="enc")
    ckpt.init_from_checkpoint(os.path.join(FIXTURES, "tf1_saver"), {"encoder/dense/": "enc/"})
    assert_bit_exact(expected["encoder__dense__kernel"], enc.kernel.numpy())
    d2 = Dense(4, 2, name="d2")
    ckpt.init_from_checkpoint(os.path.join(FIXTURES, "keras_legacy_model.h5"),
                              {"model_weights/d2/sequential/d2/": "d2/"})
    keras = np.load(os.path.join(FIXTURES, "keras_expected.npz"))
    assert_bit_exact(keras["6_sequential__d2__kernel"], d2.kernel.numpy())


def test_saver_restore_non_strict_with_foreign_keys():
    expected = np.load(os.path.join(FIXTURES, "torch_expected.npz"))
    bias = ckpt.Variable(np.zeros(4, np.float32), name="b")
    extra = ckpt.Variable(np.zeros(2, np.float32), name="extra")
    result = ckpt.Saver({"fc1.bias": bias, "fc2.bias": extra}).restore(TORCH, strict=False)
    assert result.restored == ["fc1.bias"] and result.missing == ["fc2.bias"]
    assert set(result.unexpected) == {"fc1.weight", "emb", "counts", "t_view"}
    assert_bit_exact(expected["fc1__bias"], bias.numpy())
    with pytest.raises(ckpt.KeyNotFoundError, match="fc2.bias: not found in torch_state.pt; closest keys: fc1.bias"):
        ckpt.Saver({"fc2.bias": extra}).restore(TORCH)


# --- the command line ----------------------------------------------------------------------------
def run(*args):
    try:
        runner = CliRunner(mix_stderr=False)
    except TypeError:  # click >= 8.2 always keeps stderr apart
        runner = CliRunner()
    return runner.invoke(main, [str(a) for a in args], prog_name="ckpt", catch_exceptions=False)


@pytest.mark.parametrize("name, fmt, key", FILES)
def test_cli_inspects_converts_and_diffs_foreign_files(tmp_path, name, fmt, key):
    src = os.path.join(FIXTURES, name)
    shown = run("inspect", src)
    assert shown.exit_code == 0 and f"tensor: {key} " in shown.output
    for ext in (".h5", ".msgpack", ".safetensors"):
        dst = tmp_path / f"converted{ext}"
        converted = run("convert", src, dst)
        assert converted.exit_code == 0, converted.stderr
        assert run("diff", src, dst).exit_code == 0
        assert run("verify", dst).exit_code == 0
    assert run("verify", src).exit_code == 0


def test_cli_refuses_a_hostile_pickle_in_one_line(tmp_path):
    import zipfile
    path = tmp_path / "evil.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00ls\x85R.")
    result = run("inspect", path)
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and "os.system" in result.stderr and "Traceback" not in result.stderr


def test_cli_explains_the_tensorflow_object_graph():
    result = run("inspect", os.path.join(FIXTURES, "tf2_object"), "--json")
    assert result.exit_code == 0 and "_CHECKPOINTABLE_OBJECT_GRAPH" in result.output
