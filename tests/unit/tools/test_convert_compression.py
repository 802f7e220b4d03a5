"""``ckpt convert --compression`` / ``ckpt.convert(..., compression=)``, and tensors that reach a
compressing writer lazily (read from another checkpoint while the file is written)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import assert_bit_exact, every_dtype_tensors

import ckpt
from ckpt.cli import main
from ckpt.formats import _blocks
from ckpt.formats import msgpack as mpfmt
from ckpt.formats.builtin import MsgpackFormat
from ckpt.lazy import LazySource

BLOCK = _blocks.BLOCK_BYTES


def tensors() -> dict[str, np.ndarray]:
    """Every dtype (0-d, empty, strings, bfloat16), and weights over several chunks and an odd size."""
    rng = np.random.default_rng(3)
    out = dict(every_dtype_tensors())
    out["big/bf16"] = (rng.standard_normal(BLOCK + 7) * 0.02).astype(ckpt.dtypes.bfloat16)
    out["big/f32"] = (rng.standard_normal((3, BLOCK // 8 + 1)) * 0.02).astype(np.float32)
    out["big/f64"] = (rng.standard_normal(5000) * 0.02).astype(np.float64)
    return out


def compressed_keys(path: str) -> set[str]:
    """The keys a msgpack file stores compressed (and checks that it is version 4 when any)."""
    with ckpt.formats.base.open_reader(path) as reader:
        keys = set(reader._planes)
        assert reader.version == (mpfmt.COMPRESSED_VERSION if keys else mpfmt.VERSION)
    return keys


def check_same(expected: dict[str, np.ndarray], path: str) -> None:
    loaded = ckpt.load_file(path)
    assert sorted(loaded) == sorted(expected)
    for key, value in expected.items():
        assert_bit_exact(np.asarray(value), loaded[key])


BIG = {"big/bf16", "big/f32", "big/f64"}


@pytest.mark.parametrize("src_ext", [".h5", ".msgpack"])
def test_convert_writes_compressed_msgpack_bit_exact(tmp_path, src_ext):
    values = tensors()
    src, dst = str(tmp_path / f"m{src_ext}"), str(tmp_path / "z.msgpack")
    ckpt.save_file(values, src, {"step": 4})
    done = ckpt.convert(src, dst, compression="zstd")
    assert done.format == "msgpack"
    assert compressed_keys(dst) == BIG  # the numeric tensors big enough to pay
    check_same(values, dst)
    with ckpt.load_checkpoint(dst) as reader:
        assert reader.metadata == {"step": 4}


def test_cli_compresses_and_decompresses(tmp_path):
    values = tensors()
    src, packed, plain = (str(tmp_path / name) for name in ("m.h5", "z.msgpack", "p.msgpack"))
    ckpt.save_file(values, src)
    runner = CliRunner()
    result = runner.invoke(main, ["convert", src, packed, "--compression", "zstd"])
    assert result.exit_code == 0, result.output
    assert "zstd-compressed" in result.output
    assert compressed_keys(packed) == BIG
    result = runner.invoke(main, ["convert", packed, plain, "--compression", "none"])
    assert result.exit_code == 0, result.output
    assert compressed_keys(plain) == set()
    check_same(values, plain)
    assert runner.invoke(main, ["verify", packed]).exit_code == 0


def test_sharded_conversion_compresses_every_shard(tmp_path):
    values = {"w": tensors()["big/f32"], "step": np.int64(3)}
    src, dst = str(tmp_path / "m.msgpack"), tmp_path / "s.msgpack"
    ckpt.save_file(values, src)
    ckpt.convert(src, dst, shards=2, compression="zstd")
    shards = sorted(dst.glob("*.msgpack"))
    assert len(shards) == 2 and all(compressed_keys(str(p)) == {"w"} for p in shards)
    with ckpt.load_checkpoint(str(dst)) as reader:
        assert_bit_exact(values["w"], reader.get_tensor("w"))


@pytest.mark.parametrize("dst_name", ["m.h5", "m.safetensors"])
def test_targets_that_cannot_compress_are_refused_naming_the_file(tmp_path, dst_name):
    src, dst = str(tmp_path / "z.msgpack"), tmp_path / dst_name
    ckpt.save_file({"w": tensors()["big/f64"]}, src, compression="zstd")
    with pytest.raises(ckpt.UnsupportedCheckpointError, match=rf"{dst_name}.*does not compress") as info:
        ckpt.convert(src, dst, compression="zstd")
    assert info.value.path == str(dst)
    result = CliRunner().invoke(main, ["convert", src, str(dst), "--compression", "zstd"])
    assert result.exit_code == 2 and dst_name in result.output and "--compression" in result.output
    with pytest.raises(ckpt.UnsupportedCheckpointError, match=r"z2\.msgpack.*offers 'zstd'"):
        ckpt.convert(src, tmp_path / "z2.msgpack", compression="lz4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["z.msgpack"]


class Streamed(LazySource):
    """A tensor that streams its bytes in pieces of ``piece`` bytes (cut anywhere), as a
    conversion's or an average's sources do; ``extra`` bytes too many (or too few, negative)."""

    def __init__(self, value: np.ndarray, piece: int, extra: int = 0) -> None:
        self.dtype, self.shape = value.dtype, value.shape
        self._raw, self._piece, self._extra = value.reshape(-1).view(np.uint8), piece, extra

    def __array__(self, dtype=None, copy=None):
        raise AssertionError("a streaming writer reads the chunks")

    def chunks(self):
        raw = self._raw if self._extra <= 0 else np.concatenate([self._raw, np.zeros(self._extra, np.uint8)])
        raw = raw[:len(raw) + self._extra] if self._extra < 0 else raw
        buf = np.empty(self._piece, np.uint8)  # reused: each piece is valid until the next is asked for
        for start in range(0, len(raw), self._piece):
            n = len(raw[start:start + self._piece])
            buf[:n] = raw[start:start + self._piece]
            yield buf[:n]
            buf[:n] = 0xAA  # a writer still holding the last piece would see this


@pytest.mark.parametrize("piece", [BLOCK, 3 * BLOCK, 1000, BLOCK + 1, 2 * BLOCK - 3])
def test_streamed_sources_are_written_compressed(tmp_path, piece):
    values = tensors()
    lazy = {k: Streamed(np.asarray(v), piece) if k in BIG else v for k, v in values.items()}
    path = str(tmp_path / "s.msgpack")
    MsgpackFormat().write(path, list(lazy.items()), {}, compression="zstd")  # as convert and average write
    assert compressed_keys(path) == BIG
    check_same(values, path)
    assert CliRunner().invoke(main, ["verify", path]).exit_code == 0  # block checksums too


@pytest.mark.parametrize("extra", [5, -5])
def test_a_streamed_source_of_the_wrong_size_is_refused(tmp_path, extra):
    value = tensors()["big/f32"]
    with pytest.raises(ValueError, match=r"s\.msgpack: tensor 'w' gave"):
        MsgpackFormat().write(str(tmp_path / "s.msgpack"), [("w", Streamed(value, 4096, extra))], {},
                              compression="zstd")


def test_convert_of_a_compressed_source_recompresses(tmp_path):
    values = tensors()
    src, dst = str(tmp_path / "a.msgpack"), str(tmp_path / "b.msgpack")
    ckpt.save_file(values, src, compression="zstd")
    ckpt.convert(src, dst, compression="zstd", chunk_bytes=BLOCK // 2 + 5)  # pieces cut off the chunks
    assert compressed_keys(dst) == BIG
    check_same(values, dst)
    assert pathlib.Path(dst).stat().st_size == pathlib.Path(src).stat().st_size


def test_average_writes_compressed_msgpack(tmp_path):
    rng = np.random.default_rng(8)
    inputs = [{"w": (rng.standard_normal((3, BLOCK // 2 + 5)) * 0.02).astype(ckpt.dtypes.bfloat16),  # 4 chunks
               "step": np.int64(7)} for _ in range(2)]
    paths = [str(tmp_path / f"{i}.msgpack") for i in range(2)]
    for values, path in zip(inputs, paths):
        ckpt.save_file(values, path, compression="zstd" if path.endswith("0.msgpack") else None)
    plain, packed = str(tmp_path / "avg.msgpack"), str(tmp_path / "avgz.msgpack")
    ckpt.average_checkpoints(paths, plain)
    result = CliRunner().invoke(main, ["average", *paths, "-o", packed, "--compression", "zstd"])
    assert result.exit_code == 0, result.output
    assert compressed_keys(plain) == set() and compressed_keys(packed) == {"w"}
    check_same(ckpt.load_file(plain), packed)  # the same mean, bit for bit


def test_average_refuses_compression_for_targets_that_cannot_compress(tmp_path):
    path = str(tmp_path / "a.msgpack")
    ckpt.save_file({"w": np.ones(3, np.float32)}, path)
    with pytest.raises(ckpt.UnsupportedCheckpointError, match=r"avg\.h5.*does not compress"):
        ckpt.average_checkpoints([path, path], tmp_path / "avg.h5", compression="zstd")
    result = CliRunner().invoke(main, ["average", path, path, "-o", str(tmp_path / "avg.safetensors"),
                                       "--compression", "zstd"])
    assert result.exit_code == 2 and "avg.safetensors" in result.output and "--compression" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.msgpack"]
