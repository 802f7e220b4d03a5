"""orbax-checkpoint: the directories orbax wrote (zarr arrays per leaf, a CheckpointManager root),
OCDBT refused clearly, and hostile metadata and chunks.

Fixtures written by jax 0.10.2 / orbax-checkpoint 0.12.8 (tests/fixtures/foreign/generators/gen_orbax.py).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from conftest import assert_bit_exact

import ckpt

pytest.importorskip("zstandard")  # orbax compresses chunks with zstd; the test extra installs it
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "foreign")
KEYS = {"flag": [2], "ids": [6], "layers/0": [2], "layers/1": [], "params/dense/bias": [4],
        "params/dense/kernel": [3, 4], "params/emb": [5, 2], "params/grid": [6, 8], "step": []}


def expected(npz):
    data = np.load(os.path.join(FIXTURES, npz))
    out = {}
    for name in data.files:
        value = data[name]
        if name.endswith("__bits"):
            name, value = name[:-len("__bits")], value.view(ckpt.dtypes.bfloat16)
        out[name.replace("__", "/")] = value
    return out


@pytest.mark.parametrize("path, npz", [("orbax_zarr", "orbax_zarr_expected.npz"),
                                       ("orbax_manager", "orbax_manager_expected.npz"),
                                       ("orbax_manager/2", "orbax_manager_expected.npz"),
                                       ("orbax_manager/1/default", None)])
def test_orbax_directories_read_bit_exact(path, npz):
    with ckpt.load_checkpoint(os.path.join(FIXTURES, path)) as reader:
        assert reader.format == "orbax"
        assert reader.get_variable_to_shape_map() == KEYS
        assert str(reader.get_variable_to_dtype_map()["params/emb"]) == "bfloat16"
        if npz is None:  # step 1 of the manager: everything scaled by 1, step by 7
            assert reader.get_tensor("step") == 7
            return
        want = expected(npz)
        for key in KEYS:
            if key == "step":  # an np.int32 leaf: zarr stores "<i4", orbax restores it as a Python int
                assert reader.get_tensor(key).dtype == np.int32 and reader.get_tensor(key) == want[key]
                continue
            assert_bit_exact(want[key], reader.get_tensor(key))
        assert reader.verify() == []


def test_get_slice_reads_the_chunks_it_overlaps():
    want = expected("orbax_zarr_expected.npz")["params/grid"]  # 4 chunks of (3, 4)
    with ckpt.load_checkpoint(os.path.join(FIXTURES, "orbax_zarr")) as reader:
        for index in [np.s_[1:5, 2:7], np.s_[0, :], np.s_[4:6, 4:8], np.s_[:, 3]]:
            assert_bit_exact(np.array(want[index]), reader.get_slice("params/grid", index))


def test_the_cli_reads_a_manager_root():
    from click.testing import CliRunner

    from ckpt.cli import main

    result = CliRunner().invoke(main, ["inspect", os.path.join(FIXTURES, "orbax_manager")])
    assert result.exit_code == 0, result.output
    assert "params/grid" in result.output


def test_ocdbt_is_refused_clearly():
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="OCDBT"):
        ckpt.load_checkpoint(os.path.join(FIXTURES, "orbax_ocdbt"))


def copy(tmp_path):
    target = tmp_path / "o"
    shutil.copytree(os.path.join(FIXTURES, "orbax_zarr"), target)
    return target


def edit_json(path, edit):
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def first_leaf(doc):
    return doc["tree_metadata"][sorted(doc["tree_metadata"])[0]]


@pytest.mark.parametrize("file, edit, error, words", [
    ("_METADATA", lambda d: first_leaf(d)["key_metadata"][0].update({"key": ".."}), ckpt.UnsupportedCheckpointError,
     "cannot name an array directory"),
    ("_METADATA", lambda d: first_leaf(d)["key_metadata"][0].update({"key": "a/../../x"}),
     ckpt.UnsupportedCheckpointError, "cannot name an array directory"),
    ("_METADATA", lambda d: first_leaf(d).update({"key_metadata": []}), ckpt.CorruptCheckpointError, "key_metadata"),
    ("_METADATA", lambda d: d.update({"tree_metadata": []}), ckpt.CorruptCheckpointError, "tree_metadata"),
    ("_METADATA", lambda d: d.update({"use_zarr3": True}), ckpt.UnsupportedCheckpointError, "zarr v3"),
    ("params.grid/.zarray", lambda d: d.update({"shape": [2 ** 40, 2 ** 40]}), ckpt.CorruptCheckpointError,
     "more elements"),
    ("params.grid/.zarray", lambda d: d.update({"chunks": [1, 1]}), ckpt.CorruptCheckpointError, "chunk files"),
    ("params.grid/.zarray", lambda d: d.update({"chunks": [0, 4]}), ckpt.CorruptCheckpointError, "chunks"),
    ("params.grid/.zarray", lambda d: d.update({"chunks": [3]}), ckpt.CorruptCheckpointError, "chunks"),
    ("params.grid/.zarray", lambda d: d.update({"dtype": "|O"}), ckpt.UnsupportedCheckpointError, "zarr dtype"),
    ("params.grid/.zarray", lambda d: d.update({"dtype": ">f4"}), ckpt.UnsupportedCheckpointError, "zarr dtype"),
    ("params.grid/.zarray", lambda d: d.update({"compressor": {"id": "blosc"}}), ckpt.UnsupportedCheckpointError,
     "blosc"),
    ("params.grid/.zarray", lambda d: d.update({"order": "F"}), ckpt.UnsupportedCheckpointError, "order"),
    ("params.grid/.zarray", lambda d: d.update({"zarr_format": 3}), ckpt.CorruptCheckpointError, "zarr v2"),
])
def test_hostile_metadata(tmp_path, file, edit, error, words):
    target = copy(tmp_path)
    edit_json(target / file, edit)
    with pytest.raises(error, match=words):
        with ckpt.load_checkpoint(str(target)) as reader:
            for key in reader.get_variable_to_shape_map():
                reader.get_tensor(key)


@pytest.mark.parametrize("damage, words", [
    (lambda p: p.write_bytes(p.read_bytes()[:-3]), "does not decompress|holds"),
    (lambda p: p.write_bytes(b"garbage" * 3), "does not decompress"),
    (lambda p: p.unlink(), "missing"),
    (lambda p: p.write_bytes(__import__("zlib").compress(b"x" * 10)), "does not decompress"),
])
def test_damaged_chunks(tmp_path, damage, words):
    target = copy(tmp_path)
    damage(target / "params.grid" / "1.0")
    with ckpt.load_checkpoint(str(target)) as reader:
        with pytest.raises(ckpt.CorruptCheckpointError, match=words):
            reader.get_tensor("params/grid")
        assert reader.get_tensor("params/dense/bias").shape == (4,)


def test_a_zstd_bomb_stops_at_the_chunk_size(tmp_path):
    import zstandard

    target = copy(tmp_path)
    (target / "params.grid" / "0.0").write_bytes(zstandard.ZstdCompressor().compress(b"\x00" * (64 << 20)))
    with ckpt.load_checkpoint(str(target)) as reader:
        with pytest.raises(ckpt.CorruptCheckpointError, match="cannot decompress to|expected 48"):
            reader.get_tensor("params/grid")


def test_chunk_files_truncated_and_flipped(tmp_path):
    """Every truncation and seeded bit flips of every chunk: a value or a CheckpointError."""
    target = copy(tmp_path)
    rng = np.random.default_rng(16)
    count = 0
    for array in sorted(os.listdir(target)):
        if not os.path.isdir(target / array) or array == "array_metadatas":
            continue
        for name in sorted(os.listdir(target / array)):
            if name.startswith("."):
                continue
            chunk = target / array / name
            raw = chunk.read_bytes()
            variants = [raw[:n] for n in range(len(raw))]
            for _ in range(20):
                flipped = bytearray(raw)
                flipped[int(rng.integers(len(raw)))] ^= 1 << int(rng.integers(8))
                variants.append(bytes(flipped))
            for variant in variants:
                chunk.write_bytes(variant)
                count += 1
                try:
                    with ckpt.load_checkpoint(str(target)) as reader:
                        for key in reader.get_variable_to_shape_map():
                            reader.get_tensor(key)
                except ckpt.CheckpointError:
                    pass
            chunk.write_bytes(raw)
    assert count > 400


def test_metadata_truncated_at_every_byte(tmp_path):
    target = copy(tmp_path)
    path = target / "_METADATA"
    raw = path.read_bytes()
    for n in range(0, len(raw), 7):
        path.write_bytes(raw[:n])
        with pytest.raises(ckpt.CheckpointError):
            ckpt.load_checkpoint(str(target))


def test_manager_skips_unfinished_steps(tmp_path):
    root = tmp_path / "m"
    shutil.copytree(os.path.join(FIXTURES, "orbax_manager"), root)
    os.makedirs(root / "3.orbax-checkpoint-tmp-1")
    os.makedirs(root / "4")  # an empty step directory: not a checkpoint
    with ckpt.load_checkpoint(str(root)) as reader:
        assert reader.path.endswith("2")
