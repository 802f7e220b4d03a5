"""Statistics of local tensors read piece by piece on the threads that use them (ckpt.tools.fused):
the same bits as the chunked path, and a damaged piece anywhere refuses the tensor."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import ckpt
from ckpt.tools import stats as _stats
from ckpt.tools.chunks import tensor_chunks
from ckpt.tools.fused import local_layout, piece_bounds

MiB = 1 << 20
PIECE = _stats.PIECE


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(29)
    odd = (rng.standard_normal(2 * MiB + 5 * PIECE // 2 + 123) + 1e4).astype(np.float32)  # far from 0: the shift
    odd[[7, 1000, 2_000_000]] = [np.nan, np.inf, 0.0]
    return {"odd": odd,  # more than two 4 MiB chunks, the odd one first, not a multiple of a piece
            "pieces": rng.standard_normal(3 * PIECE).astype(np.float32),
            "small": rng.standard_normal(1000).astype(np.float32),  # under one piece
            "half": rng.standard_normal(PIECE + 17).astype(np.float16),
            "ints": rng.integers(-50, 50, PIECE * 2 + 1).astype(np.int8),
            "scalar": np.array(3.5, dtype=np.float64), "empty": np.zeros((0, 4), np.float32)}


@pytest.fixture(params=[".msgpack", ".h5"])
def saved(request, tmp_path) -> tuple[str, dict[str, np.ndarray]]:
    tensors = _tensors()
    path = str(tmp_path / f"m{request.param}")
    ckpt.save_file(tensors, path)
    return path, tensors


def _chunked(reader, key: str, chunk_bytes: int | None) -> ckpt.TensorStats:
    """The statistics through tensor_chunks: the path every other source takes."""
    info = reader.tensors[key]
    return _stats._stats_of_chunks(_stats._kind(info.dtype), info.size, info.dtype,
                                   lambda: tensor_chunks(reader, key, chunk_bytes=chunk_bytes))


@pytest.mark.parametrize("chunk_bytes", [None, 4 * MiB])
def test_statistics_read_piece_by_piece_are_the_same_bits_as_the_chunked_ones(saved, chunk_bytes):
    path, tensors = saved
    with ckpt.load_checkpoint(path) as reader:
        for key in tensors:
            assert local_layout(reader, key) is not None, key  # the fused path is the one taken
            assert _stats.stats_of(reader, key, chunk_bytes=chunk_bytes) == _chunked(reader, key, chunk_bytes), key
    got = ckpt.tensor_stats(path, chunk_bytes=chunk_bytes)
    assert (got["odd"].nan, got["odd"].inf, got["scalar"].mean, got["empty"].count) == (1, 1, 3.5, 0)
    assert got["ints"] == ckpt.array_stats(tensors["ints"])


def test_compressed_tensors_keep_the_chunked_path(tmp_path):
    x = np.random.default_rng(3).standard_normal(PIECE + 5).astype(np.float32)
    path = ckpt.save_file({"x": x}, str(tmp_path / "m.msgpack"), compression="zstd")
    with ckpt.load_checkpoint(path) as reader:
        assert local_layout(reader, "x") is None
    assert ckpt.tensor_stats(path)["x"] == ckpt.array_stats(x)


def test_pieces_are_cut_where_the_chunks_and_their_pieces_are():
    assert piece_bounds(0, 4, 2) == [] and piece_bounds(1, 4, 2) == [(0, 1)]
    assert piece_bounds(9, 4, 2) == [(0, 1), (1, 3), (3, 5), (5, 7), (7, 9)]
    assert piece_bounds(8, 4, 3) == [(0, 3), (3, 4), (4, 7), (7, 8)]


def _damaged(path: str, at: int, out: pathlib.Path) -> str:
    """A copy of ``path`` with one bit flipped in tensor "odd"'s value ``at``."""
    with ckpt.load_checkpoint(path) as reader:
        (offset, _), = reader._reader.data_extents("odd")
    data = bytearray(pathlib.Path(path).read_bytes())
    data[offset + 4 * at + 1] ^= 0x10
    out.write_bytes(bytes(data))
    return str(out)


@pytest.mark.parametrize("at", [PIECE * 5 + 3, 2 * MiB + 5 * PIECE // 2 + 120])  # a middle piece, the last one
def test_a_damaged_piece_refuses_the_tensor(saved, tmp_path, at):
    path, _ = saved
    bad = _damaged(path, at, tmp_path / f"bad{pathlib.Path(path).suffix}")
    with pytest.raises(ckpt.CorruptCheckpointError, match="'odd' fails its checksum") as caught:
        ckpt.tensor_stats(bad, ["odd"])
    assert (caught.value.path, caught.value.key) == (bad, "odd")
    assert ckpt.tensor_stats(bad, ["pieces"])["pieces"] == ckpt.tensor_stats(path, ["pieces"])["pieces"]


def test_a_truncated_file_is_refused(saved, tmp_path):
    path, _ = saved
    with ckpt.load_checkpoint(path) as reader:
        (offset, _), = reader._reader.data_extents("odd")
    cut = tmp_path / f"cut{pathlib.Path(path).suffix}"
    cut.write_bytes(pathlib.Path(path).read_bytes()[:offset + 3 * MiB])
    with pytest.raises(ckpt.CorruptCheckpointError):
        ckpt.tensor_stats(str(cut), ["odd"])
