"""compression="zstd": msgpack version 4 files whose numeric tensors are stored as zstd-compressed
byte planes, chunk by chunk; read, sliced, verified, inspected, diffed and converted like any other."""

from __future__ import annotations

import pathlib

import ml_dtypes
import msgpack
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import assert_bit_exact, every_dtype_tensors

import ckpt
from ckpt import distributed
from ckpt.cli import main
from ckpt.formats import _blocks
from ckpt.formats import msgpack as mpfmt

BLOCK = _blocks.BLOCK_BYTES


def weights(shape, dtype=np.float32, seed=0):
    """Weights as training leaves them: N(0, 0.02)."""
    return (np.random.default_rng(seed).standard_normal(shape) * 0.02).astype(dtype)


def big_of_every_dtype() -> dict[str, np.ndarray]:
    """Every numeric dtype, a chunk and a few elements long (so it crosses a chunk boundary)."""
    out = {}
    rng = np.random.default_rng(1)
    for name in ckpt.dtypes.NAMES:
        dtype = ckpt.dtypes.as_dtype(name)
        if name == "string":
            continue
        n = BLOCK // dtype.itemsize + 3
        raw = rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8)
        raw.reshape(n, dtype.itemsize)[:, -1] &= 0x3F  # a compressible top byte, as floats have
        out[f"big/{name}"] = raw.view(dtype)
    out["edge/exactly_one_chunk"] = weights(BLOCK // 4)
    out["edge/two_chunks"] = weights((2, BLOCK // 4))
    out["edge/threshold"] = weights(mpfmt.COMPRESS_MIN // 4)
    out["edge/below_threshold"] = weights(mpfmt.COMPRESS_MIN // 4 - 1)
    out["edge/random"] = np.random.default_rng(2).integers(0, 2 ** 63, 40_000, dtype=np.int64)  # incompressible
    return out


@pytest.fixture(scope="module")
def tensors():
    return {**dict(every_dtype_tensors()), **big_of_every_dtype()}


@pytest.fixture(scope="module")
def compressed(tmp_path_factory, tensors):
    path = tmp_path_factory.mktemp("z") / "model.msgpack"
    ckpt.save_file(tensors, path, {"step": 3}, compression="zstd")
    return str(path)


def test_every_dtype_round_trips_bit_exact(compressed, tensors):
    loaded = ckpt.load_file(compressed)
    assert list(loaded) == list(tensors)
    for key, value in tensors.items():
        assert_bit_exact(np.asarray(value), loaded[key])
    with ckpt.load_checkpoint(compressed) as reader:
        assert reader.metadata == {"step": 3}


def test_index_records_the_planes_of_the_tensors_it_compresses(compressed, tensors):
    header, *_, index, _ = msgpack.unpackb(pathlib.Path(compressed).read_bytes(), raw=False,
                                           max_bin_len=1 << 30)
    assert header == {"format": "ckpt-msgpack", "version": 4} and index["version"] == 4
    assert index["compression"] == "zstd"
    big = {k for k, v in tensors.items() if v.dtype.kind != "O" and v.nbytes >= mpfmt.COMPRESS_MIN}
    assert set(index["compressed"]) == big
    for key in big:
        value = tensors[key]
        chunks = -(-value.nbytes // BLOCK)
        sizes = np.frombuffer(index["compressed"][key], "<u4").reshape(chunks, value.dtype.itemsize)
        extents = index["tensors"][key][2]
        assert [n for _, n in extents] == sizes.sum(axis=1).tolist()
    # the exponent plane of N(0, 0.02) weights compresses, the low mantissa planes are stored raw
    sizes = np.frombuffer(index["compressed"]["edge/two_chunks"], "<u4").reshape(2, 4)
    assert (sizes[:, :2] == BLOCK // 4).all() and (sizes[:, 3] < BLOCK // 8).all()


def test_uncompressed_saves_still_write_version_3(tmp_path):
    path = ckpt.save_file({"w": weights(10_000)}, tmp_path / "m.msgpack")
    assert pathlib.Path(path).read_bytes()[mpfmt.DATA_START - 1] == 3


def test_weights_get_smaller(tmp_path):
    bf16 = {"w": weights((1024, 1024), ml_dtypes.bfloat16)}
    f32 = {"w": weights((512, 1024))}
    for tensors, ratio in ((bf16, 1.25), (f32, 1.1)):
        plain = ckpt.save_file(tensors, tmp_path / "plain.msgpack")
        packed = ckpt.save_file(tensors, tmp_path / "packed.msgpack", compression="zstd")
        assert pathlib.Path(plain).stat().st_size / pathlib.Path(packed).stat().st_size >= ratio
        assert_bit_exact(tensors["w"], ckpt.load_file(packed)["w"])


@pytest.mark.parametrize("index", [np.s_[1, BLOCK // 4 - 5: BLOCK // 4], np.s_[:, 7], np.s_[0, 3:9],
                                   np.s_[1]])
def test_slices_decode_only_the_chunks_they_touch(compressed, tensors, index):
    with ckpt.load_checkpoint(compressed) as reader:
        part = reader.get_slice("edge/two_chunks", index)
    assert_bit_exact(tensors["edge/two_chunks"][index], part)
    raw = ckpt.formats.base.open_reader(compressed)
    with raw:
        raw.read_slice("edge/two_chunks", np.s_[1, :10])
        assert raw.bytes_read == BLOCK  # one of the two chunks


def test_slices_of_every_dtype_across_a_chunk_boundary(compressed, tensors):
    with ckpt.load_checkpoint(compressed) as reader:
        for key, value in tensors.items():
            if key.startswith("big/"):
                n = value.shape[0]
                assert_bit_exact(value[n - 10:], reader.get_slice(key, np.s_[n - 10:]))


def _flip(path, offset):
    raw = bytearray(pathlib.Path(path).read_bytes())
    raw[offset] ^= 0x01
    pathlib.Path(path).write_bytes(raw)


@pytest.mark.parametrize("plane", [0, 3])  # a raw mantissa plane, the compressed exponent plane
def test_a_damaged_chunk_is_refused_naming_file_and_key(tmp_path, plane):
    path = str(tmp_path / "d.msgpack")
    good = weights((2, BLOCK // 4), seed=5)
    ckpt.save_file({"w": good, "other": weights(5000, seed=6)}, path, compression="zstd")
    with ckpt.formats.base.open_reader(path) as reader:
        (offset, _), _ = reader.tensors["w"].extra.extents
        sizes = reader._planes["w"][0]
    _flip(path, offset + int(sizes[:plane].sum()) + int(sizes[plane]) // 2)
    with ckpt.load_checkpoint(path) as reader:
        with pytest.raises(ckpt.CorruptCheckpointError, match=r"d\.msgpack.*'w'") as info:
            reader.get_tensor("w")
        assert info.value.key == "w" or "'w'" in str(info.value)
        with pytest.raises(ckpt.CorruptCheckpointError, match=r"d\.msgpack.*'w'"):
            reader.get_slice("w", np.s_[0, :4])
        assert_bit_exact(good[1], reader.get_slice("w", np.s_[1]))  # the other chunk is sound
        assert_bit_exact(weights(5000, seed=6), reader.get_tensor("other"))
    result = CliRunner().invoke(main, ["verify", path])
    assert result.exit_code != 0 and "'w'" in result.output and "'other'" not in result.output


def test_chunks_decoded_beside_the_first_group_round_trip_and_are_checked(tmp_path):
    """Chunks past the first group are decoded on the I/O threads, their checksums combined."""
    path = str(tmp_path / "d.msgpack")
    good = weights((mpfmt._DECODE_GROUP + 2) * BLOCK // 4, seed=9)  # a second group of chunks
    ckpt.save_file({"w": good}, path, compression="zstd")
    assert_bit_exact(good, ckpt.load_file(path)["w"])
    with ckpt.formats.base.open_reader(path) as reader:
        offset, n = reader.tensors["w"].extra.extents[mpfmt._DECODE_GROUP]
    _flip(path, offset + n // 3)  # in a raw mantissa plane: decodes, to wrong values
    with ckpt.load_checkpoint(path) as reader, \
            pytest.raises(ckpt.CorruptCheckpointError, match=r"d\.msgpack.*'w'"):
        reader.get_tensor("w")


def test_a_task_reads_its_chunks_in_one_read_and_never_the_gaps_of_a_scattered_index(tmp_path, monkeypatch):
    """Chunks stored back to back are one read per task (one GET on an object store); chunks an
    index places apart are read one by one."""
    path = str(tmp_path / "r.msgpack")
    good = weights(6 * BLOCK // 4, seed=11)
    ckpt.save_file({"a": good, "b": good}, path, compression="zstd")
    with ckpt.formats.base.open_reader(path) as reader:
        reads = []
        source = reader._source
        real = source.read_into
        monkeypatch.setattr(source, "read_into", lambda view, offset, what: (reads.append(len(view)),
                                                                              real(view, offset, what)))
        assert_bit_exact(good, reader.read("a"))
        stored = [n for _, n in reader.tensors["a"].extra.extents]
        group = mpfmt._decode_group(len(stored))
        assert len(reads) == -(-len(stored) // group)
        reads.clear()
        assert reader.verify() == []
        chunk_reads = [n for n in reads if n > 5]  # (not the bin headers verify's framing check reads)
        assert len(chunk_reads) == 2 * -(-len(stored) // group)  # "a" and "b" verified, a task at a time
        reads.clear()
        reader.tensors["a"].extra.extents[1] = reader.tensors["b"].extra.extents[1]  # the same bytes, far away
        assert_bit_exact(good, reader.read("a"))
        assert sum(reads) <= sum(stored) + 5 * len(stored)  # (the bin headers between chunks)


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("n", [1, 3, 4097])
def test_byte_planes_split_and_join_every_width(itemsize, n):
    from ckpt.formats import _planes

    rng = np.random.default_rng(itemsize * n)
    chunks = {"mixed": rng.integers(0, 256, n * itemsize, dtype=np.uint8),
              "constant": np.full(n * itemsize, 7, np.uint8)}  # every plane compresses
    chunks["mixed"].reshape(n, itemsize)[:, -1] &= 0x03  # a compressible top plane, random others
    for raw in chunks.values():
        planes = raw.reshape(n, itemsize).T.reshape(-1)
        assert_bit_exact(planes, _planes._split(raw, itemsize))
        stored, sizes = _planes.encode_chunk(memoryview(raw), itemsize)
        out = np.zeros_like(raw)
        _planes.decode_chunk(memoryview(stored), sizes, itemsize, memoryview(out), "x")
        assert_bit_exact(raw, out)


def test_hdf5_refuses_compression_and_writes_nothing(tmp_path):
    with pytest.raises(ckpt.UnsupportedCheckpointError, match=r"m\.h5.*hdf5 format does not compress"):
        ckpt.save_file({"w": weights(10)}, tmp_path / "m.h5", compression="zstd")
    saver = ckpt.Saver({"w": ckpt.Variable(weights(10))}, compression="zstd")
    with pytest.raises(ckpt.UnsupportedCheckpointError, match=r"model-1\.h5.*does not compress"):
        saver.save(tmp_path / "model.h5", global_step=1)
    assert list(tmp_path.iterdir()) == []


def test_unknown_compression_is_refused(tmp_path):
    with pytest.raises(ValueError, match="lz4"):
        ckpt.Saver({"w": ckpt.Variable(weights(10))}, compression="lz4")
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="lz4"):
        ckpt.save_file({"w": weights(10)}, tmp_path / "m.msgpack", compression="lz4")


@pytest.mark.parametrize("mode", ["blocking", "async", "sharded"])
def test_saver_compresses_every_kind_of_save(tmp_path, mode):
    values = {"dense/kernel": weights((300, 1000), seed=7), "dense/bias": weights(1000, seed=8)}
    variables = {k: ckpt.Variable(v) for k, v in values.items()}
    comm = distributed.local() if mode == "sharded" else None
    saver = ckpt.Saver(variables, compression="zstd", format="msgpack", comm=comm)
    path = saver.save(tmp_path / "model", global_step=1, blocking=mode != "async")
    path = path.result() if mode == "async" else path
    for v in variables.values():
        v.assign(np.zeros(v.shape, v.dtype))
    saver.restore(tmp_path)
    for key, value in values.items():
        assert_bit_exact(value, variables[key].numpy())
    shard_files = list(pathlib.Path(path).rglob("*.msgpack")) if mode == "sharded" else [pathlib.Path(path)]
    assert shard_files and all(p.read_bytes()[mpfmt.DATA_START - 1] == 4 for p in shard_files)


def test_cli_reads_compressed_files(tmp_path, compressed, tensors):
    runner = CliRunner()
    assert runner.invoke(main, ["verify", compressed]).exit_code == 0
    shown = runner.invoke(main, ["inspect", compressed])
    assert shown.exit_code == 0 and "edge/two_chunks" in shown.output
    plain = str(tmp_path / "plain.msgpack")
    converted = runner.invoke(main, ["convert", compressed, plain])
    assert converted.exit_code == 0, converted.output
    loaded = ckpt.load_file(plain)
    for key, value in tensors.items():
        assert_bit_exact(np.asarray(value), loaded[key])
    assert pathlib.Path(plain).read_bytes()[mpfmt.DATA_START - 1] == 3
    same = runner.invoke(main, ["diff", compressed, plain])
    assert same.exit_code == 0, same.output
