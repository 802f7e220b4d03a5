"""Whole-checkpoint functions read tensors in bounded chunks, checked as they stream (ckpt/tools/chunks.py)."""

from __future__ import annotations

import dataclasses
import pathlib
import tracemalloc

import numpy as np
import pytest

import ckpt
from ckpt.lazy import LazySource
from ckpt.tools import chunks as _chunks

MiB = 1 << 20


def damaged_copy(path: str, marker: np.ndarray, out: pathlib.Path) -> str:
    data = bytearray(pathlib.Path(path).read_bytes())
    data[data.index(marker.tobytes()) + 1] ^= 0x10
    out.write_bytes(bytes(data))
    return str(out)


@pytest.fixture(params=[".msgpack", ".h5", ".safetensors"])
def big(request, tmp_path):
    """A checkpoint with one 10 MiB tensor (3 chunks of 4 MiB, the odd one first) and a small one."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal(10 * MiB // 4 + 123).astype(np.float32)
    x[[7, 1000, 2_000_000]] = [np.nan, np.inf, 0.0]
    path = str(tmp_path / f"big{request.param}")
    ckpt.save_file({"x": x, "small": np.arange(5, dtype=np.int16)}, path)
    return path, x


def test_chunks_stream_the_whole_tensor_in_order(big):
    path, x = big
    with ckpt.load_checkpoint(path) as reader:
        chunks = [c.copy() for c in _chunks.tensor_chunks(reader, "x", chunk_elements=MiB)]
        small = [c.copy() for c in _chunks.tensor_chunks(reader, "small", chunk_elements=MiB)]
    assert [c.size for c in chunks] == [x.size - 2 * MiB, MiB, MiB]
    assert np.array_equal(np.concatenate(chunks).view(np.uint32), x.view(np.uint32))
    assert np.concatenate(small).tolist() == [0, 1, 2, 3, 4]


def test_streamed_chunks_are_page_aligned_and_reused(big):
    """The kernel copies file pages fastest into page-aligned memory (ckpt.buffers); a
    reusing_buffers() block hands the same aligned buffers to the next tensor."""
    path, _ = big
    with ckpt.load_checkpoint(path) as reader, _chunks.reusing_buffers():
        first = [c.ctypes.data for c in _chunks.tensor_chunks(reader, "x", chunk_elements=MiB)]
        again = [c.ctypes.data for c in _chunks.tensor_chunks(reader, "x", chunk_elements=MiB)]
    assert len(first) == 3 and all(address % 4096 == 0 for address in first)
    assert set(again) == set(first)


def test_chunk_bytes_sets_the_chunks_of_every_stream(big):
    path, x = big
    odd = x.size - 2 * MiB  # 4 MiB of float32 is MiB elements: the odd chunk first
    with ckpt.load_checkpoint(path) as ra, ckpt.load_checkpoint(path) as rb:
        assert [c.size for c in _chunks.tensor_chunks(ra, "x", chunk_bytes=4 * MiB)] == [odd, MiB, MiB]
        assert [c.size for c in _chunks.tensor_chunks(ra, "x")] == [odd, 2 * MiB]  # CHUNK_BYTES, 8 MiB
        assert [a.size for a, _ in _chunks.paired_chunks(ra, rb, "x", chunk_bytes=4 * MiB)] == [odd, MiB, MiB]
        assert [p[0].size for p in _chunks.aligned_chunks([ra, rb], "x", chunk_bytes=4 * MiB)] == [odd, MiB, MiB]


def test_statistics_from_chunks_match_the_array(big):
    path, x = big
    # three chunks, one pass (the histogram merges their grids)
    streamed = ckpt.tensor_stats(path, ["x"], chunk_bytes=4 * MiB)["x"]
    expected = ckpt.array_stats(x)
    assert streamed.mean == pytest.approx(expected.mean, rel=1e-12) and streamed.std == pytest.approx(expected.std)
    assert dataclasses.replace(streamed, mean=0.0, std=0.0) == dataclasses.replace(expected, mean=0.0, std=0.0)
    assert (streamed.nan, streamed.inf) == (1, 1) and sum(streamed.histogram) == x.size - 2


def test_a_damaged_chunk_fails_the_tensor(big, tmp_path):
    path, x = big
    bad = damaged_copy(path, x[2_500_000:2_500_004], tmp_path / f"bad{pathlib.Path(path).suffix}")
    with pytest.raises(ckpt.CorruptCheckpointError, match="'x' fails its checksum"):
        ckpt.tensor_stats(bad, ["x"], chunk_bytes=4 * MiB)
    with pytest.raises(ckpt.CorruptCheckpointError, match="'x' fails its checksum"):
        ckpt.compare(path, bad, chunk_bytes=4 * MiB)
    with pytest.raises(ckpt.CorruptCheckpointError, match="'x' fails its checksum"):
        ckpt.compare(bad, path, chunk_bytes=4 * MiB)


def test_compare_across_formats_and_chunkings(big, tmp_path):
    path, x = big
    other = x.copy()
    other[2_600_000] += 1.0
    ckpt.save_file({"x": other, "small": np.arange(5, dtype=np.int16)}, tmp_path / "other.h5")
    result = ckpt.compare(path, tmp_path / "other.h5", chunk_bytes=4 * MiB)
    vd = result.tensor("x").values
    assert result.differ == ["x"] and (vd.count, vd.unequal) == (x.size, 1) and vd.max_abs == pytest.approx(1.0)
    copy = ckpt.convert(path, tmp_path / "copy.msgpack", chunk_bytes=4 * MiB).path
    assert ckpt.compare(path, copy, chunk_bytes=4 * MiB).same


def test_convert_checks_the_copy_by_checksums_without_reading_the_source_again(big, tmp_path, monkeypatch):
    path, x = big
    from ckpt.tools import conversion

    reads = []
    real = conversion.paired_chunks  # the check's read of both files (the copy's writer streams the source once)
    monkeypatch.setattr(conversion, "paired_chunks",
                        lambda ra, rb, key, *a, **kw: reads.append((ra.path, key)) or real(ra, rb, key, *a, **kw))
    done = ckpt.convert(path, tmp_path / "copy.h5")
    assert reads == []  # both files store crc32c of the same bytes: the new file's own verify is the check
    assert np.array_equal(ckpt.load_variable(done.path, "x").view(np.uint32), x.view(np.uint32))


@pytest.mark.parametrize("ext", [".msgpack", ".h5"])
def test_memory_is_bounded_by_chunks_not_by_the_tensor(tmp_path, ext):
    """tensor_stats and compare of a 64 MiB tensor with 4 MiB chunks allocate far less than the tensor:
    two chunks (read ahead) per stream and little more (the default 8 MiB chunks would take twice that)."""
    x = np.random.default_rng(2).standard_normal(16 * MiB).astype(np.float32)
    a, b = str(tmp_path / f"a{ext}"), str(tmp_path / f"b{ext}")
    ckpt.save_file({"x": x}, a)
    x[-1] += 1
    ckpt.save_file({"x": x}, b)
    del x
    chunk = 4 * MiB
    for work, streams in ((lambda: ckpt.tensor_stats(a, chunk_bytes=chunk), 1),
                          (lambda: ckpt.compare(a, b, chunk_bytes=chunk), 2)):
        work()  # the threads' scratch buffers (a few MiB whatever the tensor) exist from here on, as after
        # any earlier call: the measured peak is what depends on the chunks, in any test order
        tracemalloc.start()
        try:
            work()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 3 * streams * chunk, peak / MiB  # whole tensors would take 64 MiB (128 MiB for two)
    assert ckpt.compare(a, b).tensor("x").values.unequal == 1


class Chunked(LazySource):
    """A lazy source that streams its bytes in pieces of ``step`` bytes (cut anywhere)."""

    def __init__(self, value: np.ndarray, step: int, extra: bytes = b"") -> None:
        self.dtype, self.shape, self._value, self._step, self._extra = value.dtype, value.shape, value, step, extra

    def chunks(self):
        raw = self._value.reshape(-1).view(np.uint8)
        for start in range(0, raw.size, self._step):
            yield raw[start:start + self._step]
        if self._extra:
            yield np.frombuffer(self._extra, np.uint8)

    def __array__(self, dtype=None, copy=None):
        return self._value


@pytest.mark.parametrize("ext", [".msgpack", ".safetensors", ".h5"])
def test_a_streamed_source_writes_the_same_file_as_its_array(tmp_path, ext):
    from ckpt.formats import base

    values = {"w": np.random.default_rng(3).standard_normal(50_001).astype(np.float32), "empty": np.zeros(0, np.int8),
              "b": np.arange(7, dtype=ckpt.dtypes.bfloat16)}
    fmt = base.format_for_path("x" + ext)
    if ext != ".safetensors":  # (safetensors files have no checksum blocks)
        fmt = type(fmt)(block_bytes=4096)  # many blocks, cut across by the chunks
    fmt.write(str(tmp_path / f"array{ext}"), list(values.items()), {"m": 1})
    fmt.write(str(tmp_path / f"chunks{ext}"), [(k, Chunked(v, 999)) for k, v in values.items()], {"m": 1})
    assert (tmp_path / f"array{ext}").read_bytes() == (tmp_path / f"chunks{ext}").read_bytes()
    assert ckpt.verify(tmp_path / f"chunks{ext}").ok


@pytest.mark.parametrize("ext", [".msgpack", ".safetensors", ".h5"])
def test_an_h5py_dataset_is_a_lazy_source_whose_chunks_attribute_is_not_a_stream(tmp_path, ext):
    """Any object with dtype, shape and __array__ may be handed to a writer; only a LazySource
    streams (an h5py dataset's ``chunks`` is its chunk shape, a tuple, not a method)."""
    import h5py

    from ckpt.formats import base

    value = np.arange(1000, dtype=np.float32).reshape(10, 100)
    with h5py.File(tmp_path / "src.h5", "w") as f:
        f.create_dataset("w", data=value, chunks=(5, 100))
    fmt = base.format_for_path("x" + ext)
    with h5py.File(tmp_path / "src.h5", "r") as f:
        assert f["w"].chunks == (5, 100)
        fmt.write(str(tmp_path / f"out{ext}"), [("w", f["w"])], {})
    assert np.array_equal(ckpt.load_file(tmp_path / f"out{ext}")["w"], value)


@pytest.mark.parametrize("ext", [".msgpack", ".safetensors", ".h5"])
def test_a_streamed_source_of_the_wrong_size_is_refused(tmp_path, ext):
    from ckpt.formats import base

    fmt = base.format_for_path("x" + ext)
    with pytest.raises(ValueError, match="tensor 'w' gave"):
        fmt.write(str(tmp_path / f"long{ext}"), [("w", Chunked(np.ones(10, np.float32), 7, b"x"))], {})
    short = Chunked(np.ones(10, np.float32), 7)
    short.shape = (11,)
    with pytest.raises(ValueError, match="tensor 'w' gave 40 bytes"):
        fmt.write(str(tmp_path / f"short{ext}"), [("w", short)], {})


@pytest.mark.parametrize("src_ext, dst_ext", [(".h5", ".msgpack"), (".msgpack", ".safetensors"), (".msgpack", ".h5")])
def test_convert_streams_in_bounded_memory(tmp_path, src_ext, dst_ext):
    """A 64 MiB tensor goes through in 4 MiB chunks: the writer never holds the tensor (nor two 8 MiB chunks)."""
    x = np.random.default_rng(4).standard_normal(16 * MiB).astype(np.float32)
    src = str(tmp_path / f"src{src_ext}")
    ckpt.save_file({"x": x}, src)
    tracemalloc.start()
    try:
        done = ckpt.convert(src, tmp_path / f"dst{dst_ext}", chunk_bytes=4 * MiB)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12 * MiB, peak / MiB
    with ckpt.load_checkpoint(done.path) as reader:
        assert np.array_equal(reader.get_tensor("x").view(np.uint32), x.view(np.uint32))


def test_a_damaged_source_stops_a_streamed_convert(tmp_path):
    x = np.random.default_rng(6).standard_normal(3 * MiB).astype(np.float32)
    src = str(tmp_path / "src.msgpack")
    ckpt.save_file({"x": x}, src)
    bad = damaged_copy(src, x[2 * MiB:2 * MiB + 4], tmp_path / "bad.msgpack")
    with pytest.raises(ckpt.CorruptCheckpointError, match="'x' fails its checksum"):
        ckpt.convert(bad, tmp_path / "out.safetensors", chunk_bytes=4 * MiB)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.msgpack", "src.msgpack"]
