"""orbax-checkpoint: the directories orbax wrote (zarr arrays as files or in an OCDBT database, a
CheckpointManager root), and hostile metadata, manifests, nodes and chunks.

Fixtures written by jax 0.10.2 / orbax-checkpoint 0.12.8 (tests/fixtures/foreign/generators/gen_orbax.py).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from conftest import assert_bit_exact, TESTS

import ckpt

pytest.importorskip("zstandard")  # orbax compresses chunks with zstd; the test extra installs it
FIXTURES = os.path.join(TESTS, "fixtures", "foreign")
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
                                       ("orbax_ocdbt", "orbax_ocdbt_expected.npz"),
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


@pytest.mark.parametrize("directory", ["orbax_zarr", "orbax_ocdbt"])
def test_get_slice_in_both_layouts(directory):
    want = expected("orbax_zarr_expected.npz")["params/grid"]
    with ckpt.load_checkpoint(os.path.join(FIXTURES, directory)) as reader:
        assert_bit_exact(want[2:5, 3:6], reader.get_slice("params/grid", np.s_[2:5, 3:6]))


def test_ocdbt_keys_follow_orbax_and_nodes_are_checked():
    from ckpt.formats import _ocdbt

    store = _ocdbt.open_store(os.path.join(FIXTURES, "orbax_ocdbt"))
    try:
        assert b"params.grid/1.1" in store.keys() and b"step/.zarray" in store.keys()
        assert len(store.keys()) == 21
    finally:
        store.close()


# --- hand-built OCDBT manifests ------------------------------------------------------------------
def varint(n):
    out = b""
    while True:
        out += bytes([n & 0x7F | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            return out


def manifest(body_fields, version=0):
    import crc32c

    body = b"".join(body_fields)
    head = (0x0CDB3A2A).to_bytes(4, "big")
    rest = varint(version) + varint(0) + body
    raw = head + (4 + 8 + len(rest) + 4).to_bytes(8, "little") + rest
    return raw + crc32c.crc32c(raw).to_bytes(4, "little")


def config(kind=0):
    return b"\x11" * 16 + varint(kind) + varint(1024) + varint(1 << 20) + b"\x04" + varint(0)


def table(paths):
    return varint(len(paths)) + b"".join(varint(0) for _ in paths[1:]) + b"".join(varint(len(p)) for p in paths) \
        + b"".join(varint(0) for _ in paths) + b"".join(paths)


def inline(file_id, offset, length, height=1):
    return (varint(1) + varint(1) + bytes([height]) + varint(file_id) + varint(offset) + varint(length)
            + varint(0) * 3 + b"\x00" * 8 + varint(0))


@pytest.mark.parametrize("raw, error, words", [
    (manifest([config(kind=1), table([b"d/x"]), inline(0, 0, 10)]), ckpt.UnsupportedCheckpointError, "numbered"),
    (manifest([config(), table([b"../../etc/passwd"]), inline(0, 0, 10)]), ckpt.CorruptCheckpointError,
     "outside the database"),
    (manifest([config(), table([b"/etc/passwd"]), inline(0, 0, 10)]), ckpt.CorruptCheckpointError,
     "outside the database"),
    (manifest([config(), table([b"d/x"]), inline(3, 0, 10)]), ckpt.CorruptCheckpointError, "data file 3 of 1"),
    (manifest([config(), table([b"d/x"]), varint(0) + varint(0)]), ckpt.UnsupportedCheckpointError,
     "no inline version"),
    (manifest([config(), table([b"d/x"]), inline(0, 0, 10)], version=1), ckpt.UnsupportedCheckpointError,
     "version 1"),
    (manifest([config(), table([b"d/x"])]), ckpt.CorruptCheckpointError, "needs 1 bytes"),
    (manifest([config(), table([b"d/missing"]), inline(0, 0, 10)]), ckpt.CorruptCheckpointError, "missing"),
    (manifest([config(), table([b"d/x"]), inline(0, 5, 1 << 40)]), ckpt.CorruptCheckpointError, "truncated"),
    (b"\x0c\xdb\x3a\x2a" + b"\x00" * 30, ckpt.CorruptCheckpointError, "declares 0 bytes"),
])
def test_hostile_ocdbt_manifests(tmp_path, raw, error, words):
    target = tmp_path / "o"
    shutil.copytree(os.path.join(FIXTURES, "orbax_ocdbt"), target)
    (target / "manifest.ocdbt").write_bytes(raw)
    os.makedirs(target / "d", exist_ok=True)
    (target / "d" / "x").write_bytes(b"\x00" * 64)
    with pytest.raises(error, match=words):
        ckpt.load_checkpoint(str(target))


def test_ocdbt_files_truncated_and_flipped(tmp_path):
    """The manifest and every data file: truncations and seeded bit flips end in values or a
    CheckpointError (manifests and nodes carry crc32c; values are zarr chunks, checked by size)."""
    target = tmp_path / "o"
    shutil.copytree(os.path.join(FIXTURES, "orbax_ocdbt"), target)
    files = [target / "manifest.ocdbt"] + sorted((target / "d").iterdir()) + sorted(
        (target / "ocdbt.process_0" / "d").iterdir())
    rng = np.random.default_rng(16)
    count = 0
    for victim in files:
        count += damage_and_read(victim, target, rng, step=3, flips=40)
    assert count > 700


def damage_and_read(victim, target, rng, step, flips):
    """Truncate ``victim`` every ``step`` bytes and flip ``flips`` seeded bits, reading ``target`` each time:
    values or a CheckpointError, nothing else. Returns the number of variants tried."""
    raw = victim.read_bytes()
    variants = [raw[:n] for n in range(0, len(raw), step)]
    for _ in range(flips):
        flipped = bytearray(raw)
        flipped[int(rng.integers(len(raw)))] ^= 1 << int(rng.integers(8))
        variants.append(bytes(flipped))
    for variant in variants:
        victim.write_bytes(variant)
        try:
            with ckpt.load_checkpoint(str(target)) as reader:
                for key in reader.get_variable_to_shape_map():
                    reader.get_tensor(key)
        except ckpt.CheckpointError:
            pass
    victim.write_bytes(raw)
    return len(variants)


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
            count += damage_and_read(target / array / name, target, rng, step=1, flips=20)
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


@pytest.mark.parametrize("directory", ["orbax_zarr", "orbax_ocdbt"])
def test_read_box_into_reads_only_the_overlapping_chunks(directory):
    want = expected("orbax_zarr_expected.npz")["params/grid"]
    with ckpt.load_checkpoint(os.path.join(FIXTURES, directory)) as reader:
        out = np.empty((2, 3), np.float32)
        reader._reader.read_box_into("params/grid", (3, 5), out)  # inside chunk (1, 1) only
        assert_bit_exact(want[3:5, 5:8], out)
        with pytest.raises(ckpt.MismatchError):
            reader._reader.read_box_into("params/grid", (5, 5), out)
