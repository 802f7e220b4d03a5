"""formats/_io: piecewise parallel reads and the crc32c arithmetic behind them."""

from __future__ import annotations

import os
import pathlib

import crc32c
import numpy as np
import pytest

import ckpt
from ckpt.formats import _io


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
    fd = os.open(path, os.O_RDONLY)
    try:
        small, big = bytearray(10), bytearray(size)
        crcs = _io.read_spans(fd, [(7, memoryview(big)), (0, memoryview(small))], path, lambda i: f"span {i}")
    finally:
        os.close(fd)
    assert bytes(big) == data[7:7 + size] and bytes(small) == data[:10]
    assert crcs == [crc32c.crc32c(data[7:7 + size]), crc32c.crc32c(data[:10])]


def test_a_short_file_fails_every_piece_cleanly(tmp_path):
    path = str(tmp_path / "short")
    pathlib.Path(path).write_bytes(bytes(_io.PIECE + 10))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ckpt.CorruptCheckpointError, match="span 0.*truncated"):
            _io.read_spans(fd, [(0, memoryview(bytearray(3 * _io.PIECE)))], path, lambda i: f"span {i}")
    finally:
        os.close(fd)
