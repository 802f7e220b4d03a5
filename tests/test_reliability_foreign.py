"""Hostile files in the formats of other frameworks: every one ends in a CheckpointError, fast.

Generators, one class each, applied to every foreign reader they fit:

* huge but empty shapes ([0, 2**62]): no bytes, yet numpy cannot allocate them;
* integers no format needs: a stride that overflows, a 5,000-digit integer in a state dict;
* HDF5 type confusion: time types, integers, arrays and opaque values where strings or
  tensors belong, and the ordinary cases (a scalar variable-length string);
* decompression amplification: many index entries pointing at one snappy block that
  expands 20-fold, so that decoding each entry again would take minutes.

Each case runs under a time limit and must end in a ckpt.CheckpointError when opened, read
or verified (or read back exactly, for the ordinary HDF5 cases).
"""

from __future__ import annotations

import collections
import struct

import crc32c
import h5py
import numpy as np
import pytest
from reliability_support import time_limit
from test_foreign_tensorflow import block, bundle, entry, header, mask, numeric, varint

import ckpt
from ckpt.formats import base


def outcome(path: str, seconds: float = 10.0) -> str:
    """Open, read every tensor, verify: "error at open/read/verify", or "ok"."""
    with time_limit(seconds, path):
        try:
            reader = base.open_reader(path)
        except ckpt.CheckpointError:
            return "error at open"
        with reader:
            try:
                for key in list(reader.tensors) if hasattr(reader, "tensors") else []:
                    reader.read(key)
            except ckpt.CheckpointError:
                return "error at read"
            if reader.verify():
                return "error at verify"
    return "ok"


# --- decompression amplification (TensorFlow's snappy index blocks) -------------------------------
def snappy_runs(data: bytes) -> bytes:
    """Snappy for data with long runs of one byte: literals, and 64-byte copies of the byte before."""
    out, i = bytearray(varint(len(data))), 0

    def literal(piece: bytes) -> None:
        for j in range(0, len(piece), 60):
            chunk = piece[j:j + 60]
            out.extend(bytes([(len(chunk) - 1) << 2]) + chunk)

    start = 0
    while i < len(data):
        j = i
        while j < len(data) and data[j] == data[i]:
            j += 1
        if j - i > 130:  # a run: one literal byte, then copies at offset 1
            literal(data[start:i + 1])
            n = j - i - 1
            while n:
                k = min(n, 64)
                if k < 4:
                    literal(data[j - n:j - n + k])
                else:
                    out.extend(bytes([(k - 1) << 2 | 2]) + struct.pack("<H", 1))
                n -= k
            start = j
        i = j
    literal(data[start:])
    return bytes(out)


def amplified_index(path: str, entries: int, padding: int) -> None:
    """A TensorFlow index: one block with the header and a tensor entry, then ``entries``
    index-block entries all pointing at one snappy block of ``padding`` bytes that holds no
    entries (only its restart array), so nothing but decoding it again and again is asked."""
    out = b""

    def put(contents: bytes, kind: int = 0) -> tuple[int, int]:
        nonlocal out
        offset = len(out)
        out += contents + bytes([kind]) + struct.pack("<I", mask(crc32c.crc32c(contents + bytes([kind]))))
        return offset, len(contents)

    real = put(block([(b"", header()), (b"w", entry(1, (2,), 0, 8, crc32c.crc32c(bytes(8))))]))
    empty = bytes(padding - 4) + struct.pack("<I", (padding - 4) // 4)  # restart points only
    amplified = put(snappy_runs(empty), 1)
    meta = put(block([]))
    pointers = [(b"w", varint(real[0]) + varint(real[1]))]
    pointers += [(b"x" + i.to_bytes(4, "big"), varint(amplified[0]) + varint(amplified[1]))
                 for i in range(entries)]
    index = put(block(pointers))
    footer = varint(meta[0]) + varint(meta[1]) + varint(index[0]) + varint(index[1])
    with open(path + ".index", "wb") as f:
        f.write(out + footer + b"\x00" * (40 - len(footer)) + struct.pack("<Q", 0xDB4775248B80FB57))
    with open(path + ".data-00000-of-00001", "wb") as f:
        f.write(bytes(8))


def test_snappy_helper_round_trips():
    from ckpt.formats import _sstable

    data = b"abc" + bytes(5000) + b"xyz" + b"\x07" * 300
    assert _sstable.snappy_decompress(snappy_runs(data)) == data
    assert len(snappy_runs(data)) * 15 < len(data)


def test_many_index_entries_pointing_at_one_amplified_block_are_refused_fast(tmp_path):
    prefix = str(tmp_path / "model.ckpt-1")
    amplified_index(prefix, entries=1, padding=1 << 20)  # one entry: a legitimate, if odd, table
    with time_limit(20, "one amplified block"), ckpt.load_checkpoint(prefix) as reader:
        assert reader.get_tensor("w").tolist() == [0.0, 0.0]
    amplified_index(prefix, entries=3000, padding=1 << 20)  # 3,000 x 1 MiB decoded: many minutes before
    assert outcome(prefix, seconds=20) == "error at open"
    with pytest.raises(ckpt.CorruptCheckpointError, match="one after another"):
        ckpt.load_checkpoint(prefix)
