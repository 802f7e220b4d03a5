"""Flax msgpack: the file flax.serialization.to_bytes wrote, hand-built variants, hostile files."""

from __future__ import annotations

import os

import ml_dtypes
import msgpack
import numpy as np
import pytest
from conftest import assert_bit_exact, TESTS

import ckpt
from ckpt.formats import base

FIXTURES = os.path.join(TESTS, "fixtures", "foreign")


def ndarray(arr, code=1):
    """An array as flax.serialization packs it: ext 1 (3 for numpy scalars) of [shape, dtype, bytes]."""
    return msgpack.ExtType(code, msgpack.packb((arr.shape, arr.dtype.name, arr.tobytes()), use_bin_type=True))


def write(path, obj):
    path.write_bytes(msgpack.packb(obj, use_bin_type=True))
    return str(path)


def test_the_file_flax_wrote():
    expected = np.load(os.path.join(FIXTURES, "flax_expected.npz"))
    with ckpt.load_checkpoint(os.path.join(FIXTURES, "flax_state.msgpack")) as reader:
        assert reader.format == "flax" and reader.metadata == {}
        assert sorted(reader.tensors) == sorted(k.replace("__", "/") for k in expected.files)
        for key in reader.tensors:
            value, want = reader.get_tensor(key), expected[key.replace("/", "__")]
            if key == "params/emb":  # bfloat16, stored in the npz as float32
                assert value.dtype == ckpt.dtypes.bfloat16
                value = value.astype(np.float32)
            assert_bit_exact(want, value)
        assert reader.get_tensor("step").shape == ()


def test_nested_maps_scalars_lists_and_dtypes(tmp_path):
    kernel = np.arange(12, dtype=np.float32).reshape(3, 4)
    state = {
        "params": {"Dense_0": {"kernel": ndarray(kernel), "bias": ndarray(np.zeros(4, np.float64))},
                   "emb": ndarray(np.array([[1.5, -2]], dtype=ml_dtypes.bfloat16)),
                   "f8": ndarray(np.array([0.5, 448], dtype=ml_dtypes.float8_e4m3fn))},
        "step": ndarray(np.array(7, np.int32), code=3),
        "lr": 0.25, "count": 3, "flag": True, "big": 2 ** 63 + 1, "name": "adam", "raw": b"\x00\xff",
        "z": msgpack.ExtType(2, msgpack.packb((1.5, -2.0))),
        "layers": {"0": {"w": ndarray(np.ones(2, np.int8))}, "1": {}},
        "nothing": None, "empty": {},
        "as_list": [ndarray(np.array([1, 2], np.uint16))],
    }
    path = write(tmp_path / "state.msgpack", state)
    with ckpt.load_checkpoint(path) as reader:
        got = {key: reader.get_tensor(key) for key in reader.tensors}
    assert list(got) == ["params/Dense_0/kernel", "params/Dense_0/bias", "params/emb", "params/f8", "step", "lr",
                         "count", "flag", "big", "name", "raw", "z", "layers/0/w", "as_list/0"]
    assert_bit_exact(kernel, got["params/Dense_0/kernel"])
    assert_bit_exact(np.array([[1.5, -2]], dtype=ml_dtypes.bfloat16), got["params/emb"])
    assert_bit_exact(np.array([0.5, 448], dtype=ml_dtypes.float8_e4m3fn), got["params/f8"])
    assert_bit_exact(np.array(7, np.int32), got["step"])
    assert_bit_exact(np.array(0.25), got["lr"])
    assert_bit_exact(np.array(3, np.int64), got["count"])
    assert_bit_exact(np.array(True), got["flag"])
    assert_bit_exact(np.array(2 ** 63 + 1, np.uint64), got["big"])
    assert_bit_exact(np.array(b"adam", dtype=object), got["name"])
    assert_bit_exact(np.array(b"\x00\xff", dtype=object), got["raw"])
    assert_bit_exact(np.array(1.5 - 2j), got["z"])
    assert_bit_exact(np.array([1, 2], np.uint16), got["as_list/0"])


def test_chunked_arrays_are_reassembled(tmp_path):
    big = np.arange(100, dtype=np.float64).reshape(10, 10)
    flat = big.reshape(-1)  # what flax writes for arrays over MAX_CHUNK_SIZE, here in chunks of 91
    chunked = {"__msgpack_chunked_array__": True, "shape": {"0": 10, "1": 10},
               "chunks": {"0": ndarray(flat[:91]), "1": ndarray(flat[91:])}}
    path = write(tmp_path / "chunked.msgpack", {"a": chunked, "b": ndarray(np.ones(3, np.float32))})
    with ckpt.load_checkpoint(path) as reader:
        assert reader.get_variable_to_shape_map() == {"a": [10, 10], "b": [3]}
        assert_bit_exact(big, reader.get_tensor("a"))
        out = np.zeros((10, 10))
        reader._reader.read_into("a", out)
        assert_bit_exact(big, out)


def test_ckpt_msgpack_and_flax_are_told_apart(tmp_path):
    own = tmp_path / "own.msgpack"
    ckpt.Saver({"w": ckpt.Variable([1.0, 2.0])}).save(str(own))
    with ckpt.load_checkpoint(str(own)) as reader:
        assert reader.format == "msgpack"
    flax = write(tmp_path / "flax.msgpack", {"w": ndarray(np.ones(2, np.float32))})
    with ckpt.load_checkpoint(flax) as reader:
        assert reader.format == "flax"
    fmt = base.get_format("flax")
    assert not fmt.sniff(own.read_bytes()[:4096])
    assert not fmt.sniff(msgpack.packb([1, 2]))  # not a state dict
    empty = write(tmp_path / "empty.msgpack", {})
    with ckpt.load_checkpoint(empty) as reader:
        assert reader.format == "flax" and reader.tensors == {}


def test_opening_reads_no_tensor_data(tmp_path, monkeypatch):
    data = np.arange(1 << 20, dtype=np.float32)  # 4 MiB per tensor
    path = write(tmp_path / "lazy.msgpack", {"a": ndarray(data), "b": ndarray(data + 1)})
    from ckpt.formats import _io
    sizes = []
    original = _io.pread
    monkeypatch.setattr(_io, "pread", lambda fd, off, n, *a: sizes.append(n) or original(fd, off, n, *a))
    with ckpt.load_checkpoint(path) as reader:
        # the sniffed first bytes (open_reader reads them through the blob too) and the headers, through a
        # 64 KiB buffer: not the 8 MiB of data
        assert sum(sizes) <= base.SNIFF_BYTES + 2 * (1 << 16)
        assert_bit_exact(data + 1, reader.get_tensor("b"))


def ext_header(code, n):
    return b"\xc9" + n.to_bytes(4, "big") + bytes([code])


@pytest.mark.parametrize("raw, error, message", [
    (b"\x81\xa1w" + ext_header(5, 1) + b"\x00", ckpt.UnsupportedCheckpointError, "'?w'? is a msgpack extension of type 5"),
    (b"\x81\xa1w\xc6\xff\xff\xff\xff", ckpt.CorruptCheckpointError, "declares 4294967295 bytes"),
    (b"\x81\xa1w" + ext_header(1, 2 ** 31), ckpt.CorruptCheckpointError, "declares 2147483648 bytes"),
    (b"\xdf\xff\xff\xff\xff\xa1w\x01", ckpt.CorruptCheckpointError, "declares 4294967295 entries"),
    (b"\x81\x01\x02", ckpt.UnsupportedCheckpointError, "not a string"),
    (b"\x82\xa1w\x01\xa1w\x02", ckpt.CorruptCheckpointError, "key 'w' twice"),
    (b"\x81\xa1w\x01\x00", ckpt.CorruptCheckpointError, "1 bytes follow"),
    (b"\x81\xa1w\xc1", ckpt.CorruptCheckpointError, "not msgpack"),
    (b"\x81\xa1w", ckpt.CorruptCheckpointError, "truncated"),
    (b"\x81\xa0\x01", ckpt.UnsupportedCheckpointError, "cannot be a ckpt key"),
    (b"\x81\xa2..\x01", ckpt.UnsupportedCheckpointError, "cannot be a ckpt key"),
    (b"\x81\xa1w" + b"\x81\xa1w" * 150 + b"\x01", ckpt.CorruptCheckpointError, "nested more than 100 levels"),
])
def test_hostile_structures(tmp_path, raw, error, message):
    path = tmp_path / "bad.msgpack"
    path.write_bytes(raw)
    with pytest.raises(error, match=message) as info:
        base.get_format("flax").open(str(path))
    assert "bad.msgpack" in str(info.value)


@pytest.mark.parametrize("payload, message", [
    (msgpack.packb(((2,), "object", b"\x00" * 16)), "dtype 'object'"),
    (msgpack.packb(((2,), "float32", b"\x00" * 4)), r"float32 \[2\] needs 8 bytes, the file holds 4"),
    (msgpack.packb(((-2,), "float32", b"")), "invalid shape"),
    (msgpack.packb((("2",), "float32", b"\x00" * 8)), "expected an integer"),
    (msgpack.packb(((2,), "float32", b"\x00" * 8, 1)), "not \\[shape, dtype, data\\]"),
    (msgpack.packb(((2,), "float32", "text")), "not a bin object"),
])
def test_hostile_array_payloads(tmp_path, payload, message):
    path = write(tmp_path / "bad.msgpack", {"w": msgpack.ExtType(1, payload)})
    with pytest.raises(ckpt.CheckpointError, match=message):
        ckpt.load_checkpoint(path)


def test_a_payload_longer_than_its_contents(tmp_path):
    payload = msgpack.packb(((1,), "int8", b"\x01")) + b"\x00"
    path = write(tmp_path / "bad.msgpack", {"w": msgpack.ExtType(1, payload)})
    with pytest.raises(ckpt.CorruptCheckpointError, match="payload is 12 bytes but its contents take 11"):
        ckpt.load_checkpoint(path)


def test_malformed_chunked_arrays(tmp_path):
    part = ndarray(np.ones(3, np.float32))
    for chunked, message in [
        ({"__msgpack_chunked_array__": True, "shape": {"0": 4}, "chunks": {"0": part}}, "do not add up"),
        ({"__msgpack_chunked_array__": True, "shape": {"0": 6},
          "chunks": {"0": part, "1": ndarray(np.ones(3, np.int32))}}, "different dtypes"),
        ({"__msgpack_chunked_array__": True, "shape": {"0": 3}}, "malformed chunked array"),
    ]:
        path = write(tmp_path / "chunked.msgpack", {"a": chunked})
        with pytest.raises(ckpt.CorruptCheckpointError, match=message):
            ckpt.load_checkpoint(path)


def test_a_single_array_is_not_a_state_dict(tmp_path):
    path = write(tmp_path / "one.msgpack", ndarray(np.ones(2, np.float32)))
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="not a Flax state dict"):
        base.get_format("flax").open(path)
