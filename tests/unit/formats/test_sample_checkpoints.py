"""The committed sample checkpoints read back exactly; generate.py is deterministic; the
``ckpt`` outputs shown in the READMEs are what the command prints."""

from __future__ import annotations

import filecmp
import importlib.util
import io
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import crc32c
import h5py
import msgpack
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import assert_bit_exact, TESTS

import ckpt
from ckpt.cli import main
from ckpt.storage.state import read_state

ROOT = os.path.join(TESTS, os.pardir)
SAMPLES = os.path.join(ROOT, "sample_checkpoints")
MLP_KEYS = {"hidden/kernel": [784, 64], "hidden/bias": [64], "logits/kernel": [64, 10], "logits/bias": [10]}


def load_generator():
    spec = importlib.util.spec_from_file_location("sample_generate", os.path.join(SAMPLES, "generate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = load_generator()


@pytest.mark.parametrize("name", ["mlp.h5", "mlp.msgpack", "v1/mlp.h5", "v1/mlp.msgpack", "v2/mlp.msgpack"])
def test_trained_mlp_classifies_the_generated_digits(name):
    with ckpt.load_checkpoint(os.path.join(SAMPLES, name)) as reader:
        assert reader.get_variable_to_shape_map() == MLP_KEYS
        assert all(dt == np.float32 for dt in reader.get_variable_to_dtype_map().values())
        weights = {key: reader.get_tensor(key) for key in MLP_KEYS}
        metadata = reader.metadata
    assert metadata["test_accuracy"] == 0.976 and metadata["epochs"] == 5
    x, y = generate.make_digits(generate.TRAIN + generate.TEST, generate.SEED)
    accuracy = generate.accuracy(generate.mlp_logits(weights, x[generate.TRAIN:]), y[generate.TRAIN:])
    assert accuracy >= 0.97  # an untrained network scores about 0.1


@pytest.mark.parametrize("first, second", [("mlp.h5", "mlp.msgpack"), ("v1/mlp.h5", "v1/mlp.msgpack"),
                                           ("v1/mlp.msgpack", "v2/mlp.msgpack")])
def test_mlp_files_written_together_hold_the_same_tensors(first, second):
    """Files of one generate.py run hold the same bits (runs on other machines may train to
    other last bits: v1/ and v2/ were written by an earlier run)."""
    with ckpt.load_checkpoint(os.path.join(SAMPLES, first)) as a, \
            ckpt.load_checkpoint(os.path.join(SAMPLES, second)) as b:
        assert a.metadata == b.metadata
        for key in MLP_KEYS:
            assert_bit_exact(a.get_tensor(key), b.get_tensor(key))


@pytest.mark.parametrize("name", ["dtypes.h5", "dtypes.msgpack", "v1/dtypes.h5", "v1/dtypes.msgpack",
                                  "v2/dtypes.msgpack"])
def test_every_dtype_reads_back_exactly(name):
    expected = generate.every_dtype()
    assert {f"dtypes/{n}" for n in ckpt.dtypes.NAMES} <= set(expected)  # a new dtype needs new sample files
    with ckpt.load_checkpoint(os.path.join(SAMPLES, name)) as reader:
        assert sorted(reader.tensors) == sorted(expected)
        assert reader.metadata == {"description": "every dtype ckpt supports"}
        for key, value in expected.items():
            assert_bit_exact(value, reader.get_tensor(key))
        assert reader.verify() == []


@pytest.mark.parametrize("name", ["mlp", "dtypes"])
def test_msgpack_golden_files_of_every_version(name):
    """v1/ keeps files of msgpack format version 1 (a stream of objects) and v2/ of version 2 (one
    array, no block checksums) as ckpt wrote them; the files beside them are version 3. All read
    back to the same tensors."""
    v1, v2, v3 = (os.path.join(SAMPLES, p, f"{name}.msgpack") for p in ("v1", "v2", ""))
    raw1 = pathlib.Path(v1).read_bytes()
    objects = list(msgpack.Unpacker(io.BytesIO(raw1), raw=False))
    assert objects[0] == {"format": "ckpt-msgpack", "version": 1} and objects[-1][0] == b"ckpt-idx"
    with pytest.raises(msgpack.ExtraData):
        msgpack.unpackb(raw1, raw=False)
    for version, path in ((2, v2), (3, v3)):
        whole = msgpack.unpackb(pathlib.Path(path).read_bytes(), raw=False)
        assert whole[0] == {"format": "ckpt-msgpack", "version": version} and whole[-1][0] == b"ckpt-idx"
        assert whole[-2]["metadata"] == objects[-2]["metadata"]
        assert ("block_crcs" in whole[-2]) == (version == 3)
    with ckpt.load_checkpoint(v1) as a, ckpt.load_checkpoint(v2) as b, ckpt.load_checkpoint(v3) as c:
        assert list(a.tensors) == list(b.tensors) == list(c.tensors)
        assert a.verify() == b.verify() == c.verify() == []
        for key in a.tensors:  # v1/ and v2/ were written from the same tensors
            assert_bit_exact(a.get_tensor(key), b.get_tensor(key))


@pytest.mark.parametrize("name", ["mlp", "dtypes"])
def test_hdf5_golden_files_of_both_layout_versions(name):
    """v1/ keeps HDF5 files of layout version 1 (no block checksums); the files beside it are
    version 2. Both read back to the same tensors, through ckpt and through plain h5py."""
    import h5py

    for version, path in ((1, os.path.join(SAMPLES, "v1", f"{name}.h5")), (2, os.path.join(SAMPLES, f"{name}.h5"))):
        with h5py.File(path, "r") as f:
            assert int(f.attrs["ckpt_version"]) == version
        beside = path[:-3] + ".msgpack"  # written by the same generate.py run
        with ckpt.load_checkpoint(path) as reader, ckpt.load_checkpoint(beside) as old:
            assert reader.verify() == [] and list(reader.tensors) == list(old.tensors)
            for key in old.tensors:
                assert_bit_exact(old.get_tensor(key), reader.get_tensor(key))


@pytest.mark.parametrize("ext", [".msgpack", ".h5"])
def test_the_writers_reproduce_the_current_golden_files_byte_for_byte(tmp_path, ext):
    path = str(tmp_path / f"dtypes{ext}")
    generate.write_file(path, sorted(generate.every_dtype().items()),
                        {"description": "every dtype ckpt supports"})
    assert pathlib.Path(path).read_bytes() == pathlib.Path(os.path.join(SAMPLES, f"dtypes{ext}")).read_bytes()
    generate.write_blocks_file(str(tmp_path / f"blocks{ext}"))
    assert (tmp_path / f"blocks{ext}").read_bytes() == pathlib.Path(os.path.join(SAMPLES, f"blocks{ext}")).read_bytes()


def test_slots_golden_file_pins_the_layout_of_keys_that_are_also_scopes(tmp_path):
    """TF1's slot names in HDF5: the tensor of a scope is its group's dataset ``__ckpt_tensor__``."""
    path = os.path.join(SAMPLES, "slots.h5")
    expected = generate.slot_tensors()
    with ckpt.load_checkpoint(path) as reader:
        assert reader.verify() == [] and sorted(reader.tensors) == sorted(expected)
        for key, value in expected.items():
            assert_bit_exact(np.asarray(value), reader.get_tensor(key))
    with h5py.File(path, "r") as f:
        assert sorted(f["dense/kernel"]) == ["Adam", "Adam_1", "ExponentialMovingAverage", "__ckpt_tensor__"]
        assert f["dense/kernel/__ckpt_tensor__"][()].tobytes() == expected["dense/kernel"].tobytes()
        assert f["dense/__ckpt_tensor__"][()].tolist() == [b"not a scope only"]
    generate.write_slots_file(str(tmp_path / "slots.h5"))
    assert (tmp_path / "slots.h5").read_bytes() == pathlib.Path(path).read_bytes()


@pytest.mark.parametrize("ext", [".msgpack", ".h5"])
def test_block_checksum_golden_files(ext):
    """blocks.* pin the block checksum layout (4 KiB blocks): each stored value is the crc32c of
    its block; a slice reads and verifies only the blocks that hold it."""
    expected = generate.block_tensors()
    block = generate.SMALL_BLOCK
    with ckpt.load_checkpoint(os.path.join(SAMPLES, "blocks" + ext)) as reader:
        assert reader.verify() == [] and sorted(reader.tensors) == sorted(expected)
        for key, value in expected.items():
            assert_bit_exact(value, reader.get_tensor(key))
        inner = reader._reader
        assert {k for k in expected if inner.block_checksums(k) is not None} == \
            {"blocks/float32", "blocks/int64", "blocks/bfloat16"}
        for key in ("blocks/float32", "blocks/int64", "blocks/bfloat16"):
            crcs, size = inner.block_checksums(key)
            raw = expected[key].tobytes()
            assert size == block and crcs.tolist() == [crc32c.crc32c(raw[i:i + block])
                                                       for i in range(0, len(raw), block)]
        inner.bytes_read = 0
        part = reader.get_slice("blocks/float32", np.s_[45:55, 10:20])  # bytes 9040..10960: block 2 only
        assert_bit_exact(expected["blocks/float32"][45:55, 10:20], part)
        assert inner.bytes_read == block
        assert_bit_exact(expected["blocks/float32"][99], reader.get_slice("blocks/float32", np.s_[-1]))
        assert inner.bytes_read == block + 20000 - 4 * block  # the short last block


SHARDED = ["COMMIT", "5a3d0c1e2b4f6789.00000-of-00002.msgpack", "5a3d0c1e2b4f6789.00001-of-00002.msgpack"]


def test_compressed_golden_file():
    """compressed.msgpack (msgpack version 4, 4 KiB chunks) reads back exactly, slices decode only
    the chunks they touch, and its layout is the one docs/formats.md specifies."""
    path = os.path.join(SAMPLES, "compressed.msgpack")
    expected = generate.block_tensors()
    with ckpt.load_checkpoint(path) as reader:
        assert reader.metadata == {"block_bytes": generate.SMALL_BLOCK}
        for key, value in expected.items():
            assert_bit_exact(value, reader.get_tensor(key))
        assert_bit_exact(expected["blocks/float32"][45:55, 10:20], reader.get_slice("blocks/float32", np.s_[45:55, 10:20]))
        assert_bit_exact(expected["blocks/bfloat16"][-1], reader.get_slice("blocks/bfloat16", np.s_[-1]))
    *_, index, _ = msgpack.unpackb(pathlib.Path(path).read_bytes(), raw=False)
    assert index["version"] == 4 and index["compression"] == "zstd"
    assert sorted(index["compressed"]) == ["blocks/bfloat16", "blocks/float32", "blocks/int64"]
    sizes = np.frombuffer(index["compressed"]["blocks/float32"], "<u4").reshape(-1, 4)  # 5 chunks of 1024 floats
    assert sizes.shape == (5, 4) and (sizes <= 1024).all()
    assert [n for _, n in index["tensors"]["blocks/float32"][2]] == sizes.sum(axis=1).tolist()
    assert CliRunner().invoke(main, ["verify", path]).exit_code == 0


def test_sharded_golden_checkpoint(tmp_path):
    """sharded.msgpack/ pins the commit record (version 2: one msgpack object) and the shard files."""
    path = os.path.join(SAMPLES, "sharded.msgpack")
    assert sorted(os.listdir(path)) == sorted(SHARDED)
    raw = pathlib.Path(path, "COMMIT").read_bytes()
    header, record, footer = msgpack.unpackb(raw, raw=False)
    assert header == {"format": "ckpt-commit", "version": 2} and raw[:1] == b"\x93"
    assert footer[1] == 30 and raw[30:30 + footer[2]] == msgpack.packb(record)
    assert record["step"] == 9 and record["ranks"] == 2 and record["block_bytes"] == 1 << 20
    expected = generate.block_tensors()
    with ckpt.load_checkpoint(path) as reader:
        assert reader.format == "ckpt-sharded" and reader.verify() == [] and sorted(reader.tensors) == sorted(expected)
        for key, value in expected.items():
            assert_bit_exact(value, reader.get_tensor(key))
            assert_bit_exact(value[3:7], reader.get_slice(key, np.s_[3:7]))
    for key, value in expected.items():  # each saved block's crc32c (every block fits in 1 MiB)
        if value.dtype.kind != "O":
            halves = np.array_split(value, 2)
            assert record["tensors"][key][6] == [crc32c.crc32c(h.tobytes()) for h in halves]
    generate.write_sharded(str(tmp_path / "again"))
    for name in SHARDED:
        assert (tmp_path / "again" / name).read_bytes() == pathlib.Path(path, name).read_bytes(), name


def test_samples_are_small():
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(SAMPLES) for f in files)
    assert total < 2 << 20  # five copies of the MLP (every format version) take 1 MiB


def test_steps_directory():
    steps = os.path.join(SAMPLES, "steps")
    assert ckpt.latest_checkpoint(steps) == os.path.join(steps, "model-500.msgpack")
    state = read_state(steps)
    assert [(e.path, e.step, e.time) for e in state.checkpoints] == [
        (f"model-{s}.msgpack", s, generate.EPOCH + s) for s in (300, 400, 500)]
    assert sorted(os.listdir(steps)) == ["checkpoint", "model-300.msgpack", "model-400.msgpack", "model-500.msgpack"]
    for step in (300, 400, 500):
        with ckpt.load_checkpoint(os.path.join(steps, f"model-{step}.msgpack")) as reader:
            assert reader.get_tensor("global_step") == step
            assert reader.get_variable_to_shape_map() == {"global_step": [], "softmax/kernel": [49, 10],
                                                          "softmax/bias": [10]}
            assert 0.5 < reader.metadata["train_accuracy"] <= 1.0


def test_generate_is_deterministic(tmp_path):
    for out in ("a", "b"):
        (tmp_path / out).mkdir()
        subprocess.run([sys.executable, os.path.join(SAMPLES, "generate.py"), "--out", str(tmp_path / out)],
                       check=True, capture_output=True, timeout=120)
    names = ["mlp.h5", "mlp.msgpack", "dtypes.h5", "dtypes.msgpack", "blocks.h5", "blocks.msgpack", "compressed.msgpack",
             "steps/checkpoint",
             *(f"steps/model-{s}.msgpack" for s in (300, 400, 500)), *(f"sharded.msgpack/{n}" for n in SHARDED)]
    _match, mismatch, errors = filecmp.cmpfiles(tmp_path / "a", tmp_path / "b", names, shallow=False)
    assert (mismatch, errors) == ([], [])
    assert sorted(os.listdir(tmp_path / "a" / "steps")) == sorted(os.listdir(os.path.join(SAMPLES, "steps")))


def console_examples(readme: str) -> list[tuple[str, str]]:
    """(command, expected output) for each "$ ckpt ..." line in the README's console blocks."""
    with open(readme, encoding="utf-8") as f:
        blocks = re.findall(r"```console\n(.*?)```", f.read(), flags=re.S)
    examples = []
    for block in blocks:
        for chunk in re.split(r"^\$ ", block, flags=re.M)[1:]:
            command, _, output = chunk.partition("\n")
            examples.append((command, output))
    return examples


@pytest.mark.parametrize("readme, cwd", [("sample_checkpoints/README.md", "sample_checkpoints"),
                                         ("README.md", ".")])
def test_readme_examples_print_what_they_show(tmp_path, monkeypatch, readme, cwd):
    shutil.copytree(SAMPLES, tmp_path / "sample_checkpoints")
    monkeypatch.chdir(tmp_path / cwd)
    examples = [(c, o) for c, o in console_examples(os.path.join(ROOT, readme)) if c.startswith("ckpt ")]
    assert len(examples) >= 7
    for command, expected in examples:
        # the README's convert example writes under /tmp/ckpt-readme/; here, under tmp_path
        command, expected = (text.replace("/tmp/ckpt-readme/", f"{tmp_path}/readme-out/") for text in (command, expected))
        result = CliRunner().invoke(main, shlex.split(command)[1:], prog_name="ckpt", catch_exceptions=False)
        assert result.output == expected, command


#: Absolute paths of the machine that wrote a file (POSIX homes and temporary directories, macOS,
#: Windows): a committed file naming one works only where that path still exists (issue 24).
MACHINE_PATHS = re.compile(rb"(?<![\w.])/(?:tmp|home|root|Users|private/var|var/folders)/|[A-Za-z]:\\\\?Users\\")


def test_no_committed_fixture_or_sample_names_an_absolute_path_of_the_machine_that_wrote_it():
    """Text and binary files alike: the bytes are searched, so a path inside an index or a
    commit record counts too."""
    found = []
    for top in (SAMPLES, os.path.join(ROOT, "tests", "fixtures")):
        for directory, _, files in os.walk(top):
            for name in files:
                path = os.path.join(directory, name)
                with open(path, "rb") as f:
                    match = MACHINE_PATHS.search(f.read())
                if match is not None:
                    found.append(f"{os.path.relpath(path, ROOT)}: {match.group().decode('latin-1')!r}")
    assert found == []
