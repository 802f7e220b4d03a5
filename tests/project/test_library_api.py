"""What the command line does, done from Python: convert, compare, list_checkpoints, tensor_stats, verify."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest
from conftest import assert_bit_exact, every_dtype_tensors

import ckpt


def save(path, tensors: dict, metadata: dict | None = None) -> str:
    saver = ckpt.Saver({k: ckpt.Variable(v) for k, v in tensors.items()}, max_to_keep=None)
    return saver.save(str(path), metadata=metadata) if metadata else saver.save(str(path))


def model() -> dict:
    return {"enc/kernel": np.arange(6, dtype=np.float32).reshape(2, 3), "enc/bias": np.zeros(3, np.float32),
            "dec/w": np.full((2, 2), 7.5, np.float32)}


# -- convert ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dst_ext", [".msgpack", ".h5"])
def test_convert_every_dtype_bit_for_bit(tmp_path, dst_ext):
    tensors = every_dtype_tensors()
    src = tmp_path / "src.h5"
    ckpt.save_file(dict(tensors), src)
    done = ckpt.convert(src, tmp_path / f"dst{dst_ext}")
    assert done.source == str(src) and done.keys == {k: k for k, _ in tensors} and done.renamed == 0
    with ckpt.load_checkpoint(done.path) as reader:
        for key, value in tensors:
            assert_bit_exact(value, reader.get_tensor(key))


def test_convert_keys_renames_and_a_reader(tmp_path):
    src = save(tmp_path / "m.h5", model())
    with ckpt.load_checkpoint(src) as reader:
        done = ckpt.convert(reader, tmp_path / "out.msgpack", ["enc/kernel", "dec/w"], renames={"enc/": "encoder"})
        assert reader.get_tensor("dec/w").shape == (2, 2)  # a reader passed in stays open
    assert done.keys == {"enc/kernel": "encoder/kernel", "dec/w": "dec/w"} and done.renamed == 1
    assert ckpt.list_variables(done.path) == [("dec/w", [2, 2]), ("encoder/kernel", [2, 3])]


def test_convert_refuses_before_writing(tmp_path):
    src = save(tmp_path / "m.h5", model())
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="cannot tell a checkpoint format"):
        ckpt.convert(src, tmp_path / "out.txt")
    with pytest.raises(ckpt.KeyNotFoundError, match="no tensor key matches '\\^x'"):
        ckpt.convert(src, tmp_path / "out.h5", "^x")
    with pytest.raises(ckpt.KeyNotFoundError, match="'enc/kernl' not found.*closest keys: enc/kernel"):
        ckpt.convert(src, tmp_path / "out.h5", ["enc/kernl"])
    with pytest.raises(ckpt.KeyNotFoundError, match="rename encc=...: no tensor key is 'encc'.*closest keys: enc"):
        ckpt.convert(src, tmp_path / "out.h5", renames={"encc": "x"})
    with pytest.raises(ValueError, match="'enc/kernel' and 'enc/bias' would both become 'enc/kernel'"):
        ckpt.convert(src, tmp_path / "out.h5", renames={"enc/bias": "enc/kernel"})
    existing = save(tmp_path / "old.msgpack", {"old": np.ones(1)})
    with pytest.raises(ckpt.CheckpointWriteError, match="exists; pass overwrite=True"):
        ckpt.convert(src, existing)
    assert not os.path.exists(tmp_path / "out.h5") and not os.path.exists(tmp_path / "out.txt")
    assert ckpt.convert(src, existing, overwrite=True).format == "msgpack"
    assert [k for k, _ in ckpt.list_variables(existing)] == ["dec/w", "enc/bias", "enc/kernel"]


def test_convert_format_by_name_and_sharded(tmp_path):
    src = save(tmp_path / "m.h5", model())
    done = ckpt.convert(src, tmp_path / "weights.bin", format="msgpack")
    assert done.format == "msgpack" and ckpt.load_variable(done.path, "dec/w")[0, 0] == 7.5
    sharded = ckpt.convert(src, tmp_path / "sharded.msgpack", shards=2)
    assert sharded.shards == 2 and os.path.isdir(sharded.path)
    assert ckpt.compare(src, sharded.path).same
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="safetensors cannot store"):
        ckpt.convert(save(tmp_path / "c.h5", {"c": np.ones(2, np.complex128)}), tmp_path / "c.safetensors")
    assert not os.path.exists(tmp_path / "c.safetensors")


@pytest.mark.parametrize("how", ["api", "cli"])
def test_convert_into_sharded_safetensors(tmp_path, how):
    """Safetensors shard files store one checksum per tensor: the commit record's per-block
    checksums of a block over 1 MiB are computed from the bytes read back (checked against it)."""
    from click.testing import CliRunner

    from ckpt.cli import main

    rng = np.random.default_rng(24)
    tensors = {**model(), "big": rng.standard_normal((600, 1024)).astype(np.float32),  # 1.2 MiB a shard
               "empty": np.zeros((0, 4), np.float16), "i8": np.arange(-5, 5, dtype=np.int8),
               "bf16": np.linspace(-2, 2, 600 * 1024).reshape(600, 1024).astype(ckpt.dtypes.bfloat16),
               "scalar": np.float64(2.5)}
    src = ckpt.save_file(tensors, tmp_path / "src.h5")
    dst = tmp_path / "b.safetensors"
    if how == "api":
        assert ckpt.convert(src, dst, shards=2).shards == 2
    else:
        result = CliRunner().invoke(main, ["convert", src, str(dst), "--shards", "2"], prog_name="ckpt",
                                    catch_exceptions=False)
        assert result.exit_code == 0, result.output
    assert sorted(n.endswith(".safetensors") for n in os.listdir(dst)).count(True) == 2
    assert ckpt.compare(src, dst).same
    with ckpt.load_checkpoint(dst) as reader:
        assert reader.verify() == []
        for key, value in tensors.items():
            assert_bit_exact(value, reader.get_tensor(key))


@pytest.mark.parametrize("metadata, where", [
    ({"x": object()}, "'x'"), ({"run": {"opts": [1, {2}]}}, "'run.opts[1]'"), ({"big": 2 ** 64}, "'big'"),
    ({"ok": 1, 7: "seven"}, "7"), ({"deep": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}, "'deep"),
])
@pytest.mark.parametrize("how", ["Saver.save", "save_file"])
def test_metadata_that_cannot_be_stored_is_a_checkpoint_error(tmp_path, metadata, where, how):
    path = tmp_path / "m.h5"
    with pytest.raises(ckpt.InvalidMetadataError) as info:
        if how == "Saver.save":
            ckpt.Saver({"v": ckpt.Variable(1.0)}).save(str(path), metadata=metadata)
        else:
            ckpt.save_file({"v": np.ones(2)}, path, metadata=metadata)
    assert isinstance(info.value, ckpt.CheckpointError) and isinstance(info.value, ValueError)
    message = str(info.value)
    assert message.startswith(f"{path}: metadata key {where}"), message
    assert os.listdir(tmp_path) == []  # refused before anything was written


# -- compare ---------------------------------------------------------------------------------

def test_compare_reports_every_kind_of_change(tmp_path):
    a = save(tmp_path / "a.h5", {**model(), "only_a": np.ones(1)}, metadata={"step": 1, "lr": 0.1})
    other = model()
    other["enc/kernel"] = other["enc/kernel"] + np.float32(1e-4)
    other["dec/w"] = other["dec/w"][:1]
    b = save(tmp_path / "b.msgpack", {**other, "only_b": np.ones(2)}, metadata={"step": 2, "lr": 0.1})
    result = ckpt.compare(a, b, atol=1e-3)
    assert not result.same
    assert (result.only_in_a, result.only_in_b, result.changed) == (["only_a"], ["only_b"], ["dec/w"])
    assert (result.within_tolerance, result.identical, result.differ) == (["enc/kernel"], ["enc/bias"], [])
    assert [(m.key, m.a, m.b) for m in result.metadata] == [("step", 1, 2)]
    vd = result.tensor("enc/kernel").values
    assert vd.count == 6 and vd.unequal == 6 and vd.outside == 0 and vd.max_abs == pytest.approx(1e-4, rel=0.1)
    assert result.counts["within tolerance"] == 1 and result.to_json()["same"] is False
    strict = ckpt.compare(a, b, keys="^enc/kernel$")
    assert strict.differ == ["enc/kernel"] and strict.metadata == [] and not strict.same


def test_compare_finds_a_damaged_tensor(tmp_path):
    a = save(tmp_path / "a.msgpack", model())
    data = bytearray(pathlib.Path(a).read_bytes())
    at = data.index(np.full(4, 7.5, np.float32).tobytes())
    data[at] ^= 1
    b = str(tmp_path / "b.msgpack")
    with open(b, "wb") as f:
        f.write(bytes(data))
    with pytest.raises(ckpt.CorruptCheckpointError, match="'dec/w' fails its checksum"):
        ckpt.compare(a, b)
    with pytest.raises(ckpt.CorruptCheckpointError, match="'dec/w' fails its checksum"):
        ckpt.compare(b, a)


# -- list_checkpoints, tensor_stats, verify --------------------------------------------------

def test_list_checkpoints(tmp_path):
    saver = ckpt.Saver({"v": ckpt.Variable(1.0)}, max_to_keep=2)
    for step in (1, 2, 3):
        saver.save(tmp_path / "model.msgpack", global_step=step)
    ckpt.save_file({"w": np.ones(1)}, tmp_path / "stray.h5")  # no state file entry
    rows = ckpt.list_checkpoints(tmp_path)
    assert [(r.path, r.step, r.latest) for r in rows] == [("model-2.msgpack", 2, False), ("model-3.msgpack", 3, True),
                                                          ("stray.h5", None, False)]
    assert rows[-1].note == "not in the 'checkpoint' state file" and rows[0].size == os.path.getsize(
        tmp_path / "model-2.msgpack")
    with pytest.raises(ckpt.CheckpointNotFoundError, match="no such directory"):
        ckpt.list_checkpoints(tmp_path / "none")


def test_tensor_stats_of_a_checkpoint(tmp_path):
    values = np.array([[1.0, -2.0, 0.0], [np.nan, np.inf, 4.0]], np.float32)
    path = save(tmp_path / "m.h5", {"x": values, "n": np.arange(5, dtype=np.int64)})
    stats = ckpt.tensor_stats(path)
    assert set(stats) == {"x", "n"}
    x = stats["x"]
    assert (x.min, x.max, x.nan, x.inf, x.zeros, x.count) == (-2.0, 4.0, 1, 1, 1, 6)
    assert x.mean == pytest.approx(0.75) and sum(x.histogram) == 4
    assert ckpt.tensor_stats(path, ["n"])["n"] == ckpt.array_stats(np.arange(5, dtype=np.int64))


def test_verify_returns_a_report(tmp_path):
    path = save(tmp_path / "m.msgpack", model())
    report = ckpt.verify(path)
    assert report.ok and report.tensors == 3 and report.checksummed and report.format == "msgpack"
    data = bytearray(pathlib.Path(path).read_bytes())
    data[data.index(np.full(4, 7.5, np.float32).tobytes())] ^= 1
    with open(path, "wb") as f:
        f.write(bytes(data))
    report = ckpt.verify(path)
    assert not report.ok and "'dec/w' fails its checksum" in report.problems[0]
    assert report.to_json()["ok"] is False
