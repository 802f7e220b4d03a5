"""formats/_io: piecewise parallel reads and the crc32c arithmetic behind them."""

from __future__ import annotations

import pathlib

import crc32c
import numpy as np
import pytest

import ckpt
from ckpt.formats import _io
from ckpt.storage import ReadableBlob


@pytest.mark.parametrize("head", [1, 100, 4096, _io.PIECE])
def test_crc32c_combine_matches_the_checksum_of_the_concatenation(head):
    rng = np.random.default_rng(head)
    a, b = rng.bytes(head), rng.bytes(_io.PIECE)
    assert _io.crc32c_combine_piece(crc32c.crc32c(a), crc32c.crc32c(b)) == crc32c.crc32c(a + b)


@pytest.mark.parametrize("size", [_io.BIG, 2 * _io.PIECE, 3 * _io.PIECE + 12345, _io.PIECE + 1])
def test_large_spans_are_read_in_pieces_with_the_whole_checksum(tmp_path, size):
    data = np.random.default_rng(size).bytes(3 * _io.PIECE + 20000)
    path = str(tmp_path / "data")
    pathlib.Path(path).write_bytes(data)
    with _io.LocalFile(path) as source:
        small, big = bytearray(10), bytearray(size)
        crcs = source.read_spans([(7, memoryview(big)), (0, memoryview(small))], lambda i: f"span {i}")
    assert bytes(big) == data[7:7 + size] and bytes(small) == data[:10]
    assert crcs == [crc32c.crc32c(data[7:7 + size]), crc32c.crc32c(data[:10])]


def test_a_short_file_fails_every_piece_cleanly(tmp_path):
    path = str(tmp_path / "short")
    pathlib.Path(path).write_bytes(bytes(_io.PIECE + 10))
    with _io.LocalFile(path) as source, pytest.raises(ckpt.CorruptCheckpointError, match="short: file ends in the middle of span 0.*truncated"):
        source.read_spans([(0, memoryview(bytearray(3 * _io.PIECE)))], lambda i: f"span {i}")


def test_local_files_are_readable_blobs_named_in_errors(tmp_path):
    path = str(tmp_path / "blob")
    pathlib.Path(path).write_bytes(b"0123456789")
    with _io.LocalFile(path, name="shown-name") as source:
        assert isinstance(source, ReadableBlob) and source.name == "shown-name" and source.size == 10
        assert _io.pread(source, 3, 4, "four bytes") == b"3456"
        assert _io.checksum_range(source, 0, 10, "all") == crc32c.crc32c(b"0123456789")
        with pytest.raises(ckpt.CorruptCheckpointError, match="^shown-name: file ends in the middle of the tail"):
            _io.pread(source, 8, 4, "the tail")
        with _io.stream(source) as f:  # a buffered file object over the blob, for zipfile and pickles
            f.seek(2)
            assert f.read(3) == b"234" and f.read() == b"56789"
