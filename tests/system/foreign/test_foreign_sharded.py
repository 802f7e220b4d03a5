"""Hugging Face model directories and sharded saves, Keras 3 sharded weights: the files the libraries
wrote (tests/fixtures/foreign/generators/gen_*.py), and hostile indexes."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import assert_bit_exact, TESTS

import ckpt
from ckpt.cli import main as cli_main

FIXTURES = os.path.join(TESTS, "fixtures", "foreign")
HF_LAYOUTS = ["hf_safetensors", "hf_sharded_safetensors", "hf_bin", "hf_sharded_bin",
              "hf_sharded_safetensors/model.safetensors.index.json", "hf_sharded_bin/pytorch_model.bin.index.json"]


def expected(name):
    """{key: value} from an *_expected.npz (keys written with "__"; raw bits under "__bits")."""
    npz = np.load(os.path.join(FIXTURES, name))
    return {k: npz[k] for k in npz.files}


def npz_key(key):
    return key.replace("/", "__").replace(".", "__")


@pytest.mark.parametrize("layout", HF_LAYOUTS)
def test_hugging_face_layouts_read_bit_exact(layout):
    want = expected("hf_expected.npz")
    with ckpt.load_checkpoint(os.path.join(FIXTURES, layout)) as reader:
        keys = reader.get_variable_to_shape_map()
        assert len(keys) in (16, 17)
        for key in keys:
            assert_bit_exact(want[npz_key(key)], reader.get_tensor(key))
        sharded = "sharded" in layout
        assert reader.format == ("huggingface" if sharded else "safetensors" if "safetensors" in layout
                                 else "pytorch")
        if sharded:
            assert len(reader.metadata["shards"]) == 5 and reader.metadata["total_size"] > 0


@pytest.mark.parametrize("layout", ["hf_bin", "hf_sharded_bin"])
def test_tied_weights_keep_both_keys(layout):
    """torch.save keeps lm_head.weight and wte (one storage); both keys read the same values."""
    path = os.path.join(FIXTURES, layout)
    lm_head = ckpt.load_variable(path, "lm_head.weight")
    assert_bit_exact(ckpt.load_variable(path, "transformer.wte.weight"), lm_head)


def test_safetensors_layouts_hold_one_key_of_a_tied_pair():
    """save_pretrained drops lm_head.weight from safetensors files; ckpt lists what the file holds."""
    keys = dict(ckpt.list_variables(os.path.join(FIXTURES, "hf_sharded_safetensors")))
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys


def test_hugging_face_directory_through_the_api_and_cli(tmp_path):
    path = os.path.join(FIXTURES, "hf_sharded_bin")
    var = ckpt.Variable(np.zeros((16, 8), np.float32))
    ckpt.init_from_checkpoint(path, {"lm_head.weight": var})
    assert_bit_exact(expected("hf_expected.npz")["lm_head__weight"], var.numpy())
    result = CliRunner().invoke(cli_main, ["inspect", path])
    assert result.exit_code == 0, result.output
    assert "transformer.h.0.attn.c_attn.weight" in result.output
    out = str(tmp_path / "m.h5")
    assert CliRunner().invoke(cli_main, ["convert", path, out]).exit_code == 0
    assert_bit_exact(ckpt.load_variable(path, "transformer.wpe.weight"), ckpt.load_variable(out, "transformer.wpe.weight"))
    assert CliRunner().invoke(cli_main, ["verify", path]).exit_code == 0


def test_a_state_file_still_wins_in_a_directory(tmp_path):
    """A directory with ckpt's state file opens its latest checkpoint, HF files or not."""
    shutil.copy(os.path.join(FIXTURES, "hf_safetensors", "model.safetensors"), tmp_path)
    saved = ckpt.Saver({"w": ckpt.Variable([1.0])}).save(str(tmp_path / "mine.h5"))
    with ckpt.load_checkpoint(str(tmp_path)) as reader:
        assert reader.path == saved


def test_keras_sharded_weights():
    want = expected("keras_sharded_expected.npz")
    path = os.path.join(FIXTURES, "keras_sharded", "model.weights.json")
    with ckpt.load_checkpoint(path) as reader:
        assert reader.format == "keras"
        names = reader.metadata["layer_names"]
        assert names["layers/dense/vars"] == "d1" and names["layers/dense_1/vars"] == "d2"
        assert sorted(reader.metadata["shards"]) == ["model_00000.weights.h5", "model_00001.weights.h5"]
        keys = list(reader.get_variable_to_shape_map())
        assert len(keys) == 8
        for key in keys:
            group, _, index = key.rpartition("/")
            name = npz_key(f"{names[group]}/{index}")
            value = reader.get_tensor(key)
            if name + "__bits" in want:
                assert value.dtype == ckpt.dtypes.bfloat16
                assert_bit_exact(want[name + "__bits"], value.view(np.uint16))
            else:
                assert_bit_exact(want[name], value)



def test_keras_sharded_shards_holding_only_optimizer_state():
    """Shards 00002 and 00003 hold only optimizer/vars (bfloat16 slots among them): still Keras shards."""
    want = expected("keras_sharded_opt_expected.npz")
    directory = os.path.join(FIXTURES, "keras_sharded_opt")
    with ckpt.load_checkpoint(os.path.join(directory, "model.weights.json")) as reader:
        assert reader.format == "keras"
        names = reader.metadata["layer_names"]
        assert names["optimizer/vars"] == "adam" and names["layers/dense_1/vars"] == "proj_bf16"
        keys = list(reader.get_variable_to_shape_map())
        assert len(keys) == len(want) == 22
        for key in keys:
            group, _, index = key.rpartition("/")
            name = npz_key(f"{names[group]}/{index}")
            value = reader.get_tensor(key)
            if name + "__bits" in want:
                assert value.dtype == ckpt.dtypes.bfloat16
                assert_bit_exact(want[name + "__bits"], value.view(np.uint16))
            else:
                assert_bit_exact(want[name], value)
    with ckpt.load_checkpoint(os.path.join(directory, "model_00003.weights.h5")) as shard:  # on its own too
        assert shard.format == "keras"
        assert shard.tensors["optimizer/vars/7"].dtype == ckpt.dtypes.bfloat16


# --- hostile indexes ---------------------------------------------------------------------------------

def sharded_copy(tmp_path, layout="hf_sharded_safetensors", index="model.safetensors.index.json"):
    directory = tmp_path / "m"
    shutil.copytree(os.path.join(FIXTURES, layout), directory)
    return directory, directory / index


def edit_index(path, edit):
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("edit, error, words", [
    (lambda d: d["weight_map"].update({"transformer.wte.weight": "../../etc/passwd"}), ckpt.CorruptCheckpointError,
     "shards are file names"),
    (lambda d: d["weight_map"].update({"transformer.wte.weight": "/abs/model.safetensors"}),
     ckpt.CorruptCheckpointError, "shards are file names"),
    (lambda d: d["weight_map"].update({"transformer.wte.weight": "model.safetensors.index.json"}),
     ckpt.CorruptCheckpointError, "shards are file names"),
    (lambda d: d["weight_map"].update({"transformer.wte.weight": "missing.safetensors"}),
     ckpt.CorruptCheckpointError, "missing"),
    (lambda d: d["weight_map"].update({"transformer.wte.weight": 7}), ckpt.CorruptCheckpointError, "not a file name"),
    (lambda d: d["weight_map"].update({"ghost.weight": "model-00001-of-00005.safetensors"}),
     ckpt.CorruptCheckpointError, "does not hold it"),
    (lambda d: d["weight_map"].pop("transformer.wte.weight"), ckpt.CorruptCheckpointError,
     "does not map to it"),
    (lambda d: d.update({"weight_map": []}), ckpt.CorruptCheckpointError, "weight_map"),
    (lambda d: d.update({"weight_map": {}}), ckpt.CorruptCheckpointError, "empty"),
    (lambda d: d.update({"metadata": {"total_size": 2 ** 70}}), ckpt.CorruptCheckpointError, "metadata"),
])
def test_hostile_index_edits(tmp_path, edit, error, words):
    _, index = sharded_copy(tmp_path)
    edit_index(index, edit)
    with pytest.raises(error, match=words):
        ckpt.load_checkpoint(str(index))


def test_a_key_moved_to_the_wrong_shard(tmp_path):
    _, index = sharded_copy(tmp_path)
    doc = json.loads(index.read_text())
    key, shard = next(iter(doc["weight_map"].items()))
    other = next(s for s in doc["weight_map"].values() if s != shard)
    edit_index(index, lambda d: d["weight_map"].update({key: other}))
    with pytest.raises(ckpt.CorruptCheckpointError, match=key):
        ckpt.load_checkpoint(str(index))


@pytest.mark.parametrize("raw, words", [
    (b"", "not valid JSON"),
    (b"{\"weight_map\": {\"a\": \"x\", \"a\": \"y\"}}", "duplicate key"),
    (b"{\"weight_map\": {\"a\": NaN}}", "not JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),
    (b"{\"weight_map\": 1}", "weight_map"),
    (b"[]", "weight_map"),
])
def test_malformed_index_json(tmp_path, raw, words):
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(raw)
    with pytest.raises(ckpt.CorruptCheckpointError, match=words):
        ckpt.load_checkpoint(str(index))


def test_an_oversized_index_is_refused_before_reading(tmp_path):
    from ckpt.formats import sharded

    _, index = sharded_copy(tmp_path)
    with pytest.raises(ckpt.CorruptCheckpointError, match="over 100 bytes"):
        sharded.open_sharded(str(index), max_index=100)


def test_a_shard_of_another_format_is_refused(tmp_path):
    directory, index = sharded_copy(tmp_path)
    shard = json.loads(index.read_text())["weight_map"]["transformer.wte.weight"]
    ckpt.Saver({"w": ckpt.Variable([1.0])}).save(str(directory / "w.h5"))
    os.replace(directory / "w.h5", directory / shard)
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="expected safetensors or pytorch"):
        ckpt.load_checkpoint(str(index))


def test_a_damaged_shard_names_its_file(tmp_path):
    directory, index = sharded_copy(tmp_path)
    shard = directory / json.loads(index.read_text())["weight_map"]["transformer.wte.weight"]
    shard.write_bytes(shard.read_bytes()[:50])
    with pytest.raises(ckpt.CorruptCheckpointError, match=shard.name):
        ckpt.load_checkpoint(str(directory))


def test_keras_index_edits(tmp_path):
    directory = tmp_path / "k"
    shutil.copytree(os.path.join(FIXTURES, "keras_sharded"), directory)
    index = directory / "model.weights.json"
    edit_index(index, lambda d: d["weight_map"].update({"/layers/batch_normalization/vars": ["model_00000.weights.h5"]}))
    with pytest.raises(ckpt.CorruptCheckpointError, match="model_00001.weights.h5 is in the directory"):
        ckpt.load_checkpoint(str(index))
    edit_index(index, lambda d: d["weight_map"].update({"/layers/dense/vars": ["model_00001.weights.h5"]}))
    with pytest.raises(ckpt.CorruptCheckpointError, match="does not map to it"):
        ckpt.load_checkpoint(str(index))
    edit_index(index, lambda d: d["weight_map"].update({"/layers/dense/vars": ["model_00000.weights.h5"],
                                                        "/layers/ghost/vars": ["model_00000.weights.h5"],
                                                        "/layers/batch_normalization/vars": [
                                                            "model_00000.weights.h5", "model_00001.weights.h5"]}))
    with pytest.raises(ckpt.CorruptCheckpointError, match="ghost"):
        ckpt.load_checkpoint(str(index))
    edit_index(index, lambda d: d["weight_map"].update({"/layers/ghost/vars": {"x": 1}}))
    with pytest.raises(ckpt.CorruptCheckpointError, match="not file names"):
        ckpt.load_checkpoint(str(index))
