"""A conversion's writer stores the checksums the source's bytes were checked against as they
streamed, instead of a crc32c pass of its own; the read-back of the new file still checks them."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import ckpt
from ckpt.tools import conversion

MiB = 1 << 20
PAIRS = [(".msgpack", ".h5"), (".h5", ".msgpack"), (".msgpack", ".safetensors"), (".h5", ".safetensors")]


def tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(29)
    return {"big": rng.standard_normal(3 * MiB // 4 + 123).astype(np.float32),  # 4 blocks, the last one short
            "exact": rng.standard_normal(2 * MiB // 8).astype(np.float64),  # exactly 2 blocks
            "small": np.arange(7, dtype=np.int16), "empty": np.zeros((0, 3), np.float32)}


@pytest.mark.parametrize("src_ext, dst_ext", PAIRS)
def test_a_converted_file_is_the_file_a_save_writes(tmp_path, src_ext, dst_ext):
    values = tensors()
    src = tmp_path / f"src{src_ext}"
    ckpt.save_file(values, src)
    done = ckpt.convert(src, tmp_path / f"out{dst_ext}", chunk_bytes=MiB)
    ckpt.save_file(values, tmp_path / f"saved{dst_ext}")
    assert pathlib.Path(done.path).read_bytes() == (tmp_path / f"saved{dst_ext}").read_bytes()
    assert ckpt.verify(done.path).ok


@pytest.mark.parametrize("src_ext, dst_ext", PAIRS)
def test_a_wrong_checksum_from_the_source_is_caught_by_the_read_back(tmp_path, monkeypatch, src_ext, dst_ext):
    src = tmp_path / f"src{src_ext}"
    ckpt.save_file(tensors(), src)
    real = conversion._Source.checked_crc32c

    def wrong(self: conversion._Source, block_bytes: int) -> tuple[int, bytes | None] | None:
        known = real(self, block_bytes)
        return None if known is None else (known[0] ^ 1, known[1])  # the writer stores what it is given

    monkeypatch.setattr(conversion._Source, "checked_crc32c", wrong)
    with pytest.raises(ckpt.CheckpointWriteError, match=r"out.*does not read back as written.*not replaced"):
        ckpt.convert(src, tmp_path / f"out{dst_ext}", chunk_bytes=MiB)
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]  # no destination, no temporary file


@pytest.mark.parametrize("src_ext, dst_ext", PAIRS)
def test_a_damaged_source_is_refused_naming_the_tensor_and_the_file(tmp_path, src_ext, dst_ext):
    values = tensors()
    bad = tmp_path / f"bad{src_ext}"
    ckpt.save_file(values, bad)
    data = bytearray(bad.read_bytes())
    data[data.index(values["big"][600_000:600_004].tobytes()) + 2] ^= 0x04  # in the tensor's third block
    bad.write_bytes(bytes(data))
    with pytest.raises(ckpt.CorruptCheckpointError, match="'big' fails its checksum") as err:
        ckpt.convert(bad, tmp_path / f"out{dst_ext}", chunk_bytes=MiB)
    assert str(bad) in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [bad.name]


def test_the_source_offers_block_checksums_only_in_its_own_block_size(tmp_path):
    values = tensors()
    src = tmp_path / "src.msgpack"
    ckpt.save_file(values, src)
    with ckpt.load_checkpoint(src) as reader:
        def source(key: str) -> conversion._Source:
            return conversion._Source(reader, reader.tensors[key], None, [np.empty(0, np.uint8)])

        whole = ckpt.checksums.crc32c(values["big"].tobytes())
        crc, packed = source("big").checked_crc32c(MiB)
        assert crc == whole and packed is not None and len(packed) == 4 * 4
        assert source("big").checked_crc32c(4096) is None  # blocks the file does not store: computed by the writer
        assert source("big").checked_crc32c(values["big"].nbytes) == (whole, None)  # one block: the tensor's crc32c
        assert source("small").checked_crc32c(MiB) == (ckpt.checksums.crc32c(values["small"].tobytes()), None)
