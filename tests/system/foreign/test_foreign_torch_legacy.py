"""PyTorch round two: _rebuild_tensor_v3 over torch.storage.UntypedStorage (uint16-64, float8), lazily
conjugated/negated views, and the legacy (pre-zip) torch.save format, read by the restricted machine.

The fixtures were written by torch 2.13 (tests/fixtures/foreign/generators/gen_torch_hf.py); the
expected values are what torch.load returned (views resolved).
"""

from __future__ import annotations

import os
import pathlib
import struct

import numpy as np
import pytest
from conftest import assert_bit_exact, TESTS

import ckpt

FIXTURES = os.path.join(TESTS, "fixtures", "foreign")
LEGACY = os.path.join(FIXTURES, "torch_legacy.pt")


def check_against(path, npz):
    want = np.load(os.path.join(FIXTURES, npz))
    with ckpt.load_checkpoint(path) as reader:
        keys = reader.get_variable_to_shape_map()
        for key in keys:
            name = key.replace("/", "__").replace(".", "__")
            value = reader.get_tensor(key)
            if name + "__bits" in want.files:
                bits = want[name + "__bits"]
                assert value.shape == bits.shape
                assert_bit_exact(bits, value.view(bits.dtype))
            else:
                assert_bit_exact(want[name], value)
        return reader, keys


def test_untyped_storage_dtypes_and_lazy_views():
    _reader, keys = check_against(os.path.join(FIXTURES, "torch_v3.pt"), "torch_v3_expected.npz")
    assert {k: str(ckpt.load_variable(os.path.join(FIXTURES, "torch_v3.pt"), k).dtype) for k in keys} == {
        "u16": "uint16", "u32": "uint32", "u64": "uint64", "f8_e4m3fn": "float8_e4m3fn", "f8_e5m2": "float8_e5m2",
        "f8_e4m3fnuz": "float8_e4m3fnuz", "f8_e5m2fnuz": "float8_e5m2fnuz", "conj": "complex64", "neg": "float32",
        "plain": "float32"}
    path = os.path.join(FIXTURES, "torch_v3.pt")
    plain, neg = ckpt.load_variable(path, "plain"), ckpt.load_variable(path, "neg")
    assert np.array_equal(neg, -plain)  # the storage holds plain's values; the view negates them


def test_legacy_format_reads_bit_exact():
    reader, keys = check_against(LEGACY, "torch_legacy_expected.npz")
    assert reader.format == "pytorch" and not reader.checksummed
    assert set(keys) == {"fc1.weight", "fc1.bias", "half", "bf16", "counts", "flags", "t_view", "tied", "row",
                         "scalar", "empty", "nested/m"}
    with ckpt.load_checkpoint(LEGACY) as reader:
        assert reader.metadata == {"nested/step": 7}
        assert_bit_exact(reader.get_tensor("fc1.weight"), reader.get_tensor("tied"))
        assert_bit_exact(reader.get_tensor("fc1.weight").T, reader.get_tensor("t_view"))
        assert reader._reader.verify() == []


def legacy_bytes():
    return bytearray(pathlib.Path(LEGACY).read_bytes())


def test_legacy_truncated_at_every_byte(tmp_path):
    raw = legacy_bytes()
    path = tmp_path / "t.pt"
    for n in range(2, len(raw)):  # b"\x80" alone is a valid, empty Flax msgpack file
        path.write_bytes(raw[:n])
        with pytest.raises(ckpt.CheckpointError):
            with ckpt.load_checkpoint(str(path)) as reader:
                for key in reader.get_variable_to_shape_map():
                    reader.get_tensor(key)


def test_legacy_bit_flips_give_values_or_checkpoint_errors(tmp_path):
    raw = legacy_bytes()
    rng = np.random.default_rng(16)
    path = tmp_path / "f.pt"
    outcomes = {"read": 0, "refused": 0}
    for _ in range(600):
        flipped = bytearray(raw)
        pos = int(rng.integers(len(raw)))
        flipped[pos] ^= 1 << int(rng.integers(8))
        path.write_bytes(flipped)
        try:
            with ckpt.load_checkpoint(str(path)) as reader:
                for key in reader.get_variable_to_shape_map():
                    reader.get_tensor(key)
            outcomes["read"] += 1
        except ckpt.CheckpointError:
            outcomes["refused"] += 1
    assert outcomes["read"] and outcomes["refused"]  # data flips read (no checksums), structure flips refuse


def storage_header_offset(raw):
    """Where the first storage's int64 element count sits: right after the keys-list pickle."""
    return raw.index(b"e.", raw.rindex(b"\x80\x02")) + 2


@pytest.mark.parametrize("edit, words", [
    (lambda raw: raw + b"\x00", "1 bytes follow the last storage"),
    (lambda raw: raw[:storage_header_offset(raw)] + struct.pack("<q", 2 ** 62) + raw[storage_header_offset(raw) + 8:],
     "holds 4611686018427387904 elements"),
    (lambda raw: raw[:storage_header_offset(raw)] + struct.pack("<q", -1) + raw[storage_header_offset(raw) + 8:],
     "holds -1 elements"),
    (lambda raw: raw.replace(b"little_endian\x71\x02\x88", b"little_endian\x71\x02\x89"), "little-endian"),
    (lambda raw: raw.replace(b"M\xe9\x03", b"M\xea\x03", 1), "unknown version"),
])
def test_legacy_hostile_edits(tmp_path, edit, words):
    path = tmp_path / "h.pt"
    path.write_bytes(bytes(edit(bytes(legacy_bytes()))))
    with pytest.raises(ckpt.CheckpointError, match=words):
        ckpt.load_checkpoint(str(path))


MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19."
HEADER = MAGIC + b"\x80\x02M\xe9\x03." + b"\x80\x02}(X\x0d\x00\x00\x00little_endian\x88u."


@pytest.mark.parametrize("body, error, words", [
    # a storage view (PyTorch < 0.4's sixth persistent-id item) is refused
    (b"\x80\x02}(X\x01\x00\x00\x00w(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00"
     b"\x00\x00cpuK\x02(X\x01\x00\x00\x000K\x00K\x02ttQu.", ckpt.UnsupportedCheckpointError, "external object"),
    # a BINBYTES8 claiming 2**60 bytes: never allocated
    (b"\x80\x04\x8e" + struct.pack("<Q", 2 ** 60) + b"xx", ckpt.CorruptCheckpointError, "malformed"),
    # a GLOBAL with no newline in the rest of the file
    (b"\x80\x02c" + b"x" * 100_000, ckpt.CorruptCheckpointError, "malformed"),
    (b"\x80\x02cos\nsystem\n.", ckpt.UnsupportedCheckpointError, "os.system"),
    (b"\x80\x02}.\x80\x02]X\x01\x00\x00\x000a.", ckpt.CorruptCheckpointError, "storage keys"),
])
def test_legacy_hostile_pickles(tmp_path, body, error, words):
    path = tmp_path / "p.pt"
    path.write_bytes(HEADER + body)
    with pytest.raises(error, match=words):
        ckpt.load_checkpoint(str(path))
