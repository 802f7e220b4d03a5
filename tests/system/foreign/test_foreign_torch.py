"""PyTorch: the file torch.save wrote, hand-assembled torch.save zips, and hostile pickles.

Pickles are assembled opcode by opcode here (no torch, and nothing here ever unpickles).
"""

from __future__ import annotations

import os
import pathlib
import struct
import zipfile

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_bit_exact, TESTS

import ckpt
from ckpt.formats import base

FIXTURES = os.path.join(TESTS, "fixtures", "foreign")
MARK, TUPLE, REDUCE, STOP, SETITEMS, SETITEM = b"(", b"t", b"R", b".", b"u", b"s"
EMPTY_DICT, EMPTY_TUPLE, EMPTY_LIST, APPEND, BUILD, NEWFALSE = b"}", b")", b"]", b"a", b"b", b"\x89"


def glob(module, name):
    return b"c" + f"{module}\n{name}\n".encode()


def text(s):
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def num(i):
    return b"J" + struct.pack("<i", i)


def ints(values):
    return MARK + b"".join(num(v) for v in values) + TUPLE


def ordered_dict():
    return glob("collections", "OrderedDict") + EMPTY_TUPLE + REDUCE


def tensor(storage_type, key, numel, offset, shape, stride, v3_dtype=None, metadata=b""):
    """What torch.save pickles for a tensor: a rebuild call over a persistent storage id."""
    storage = MARK + text("storage") + glob("torch", storage_type) + text(key) + text("cpu") + num(numel) + TUPLE + b"Q"
    args = storage + num(offset) + ints(shape) + ints(stride) + NEWFALSE + ordered_dict()
    if v3_dtype:
        return glob("torch._utils", "_rebuild_tensor_v3") + MARK + args + glob("torch", v3_dtype) + metadata + TUPLE + REDUCE
    return glob("torch._utils", "_rebuild_tensor_v2") + MARK + args + metadata + TUPLE + REDUCE


def state_dict(items):
    """A pickled dict {key: pickled value}."""
    return b"\x80\x02" + EMPTY_DICT + MARK + b"".join(text(k) + v for k, v in items) + SETITEMS + STOP


def torch_zip(path, pickled, storages, compress=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickled)
        z.writestr("archive/byteorder", b"little")
        for key, raw in storages.items():
            z.writestr(f"archive/data/{key}", raw, compress_type=compress)
        z.writestr("archive/version", b"3\n")
    return str(path)


def test_the_file_torch_saved():
    expected = np.load(os.path.join(FIXTURES, "torch_expected.npz"))
    with ckpt.load_checkpoint(os.path.join(FIXTURES, "torch_state.pt")) as reader:
        assert reader.format == "pytorch" and reader.metadata == {} and reader._reader.checksummed
        assert list(reader.tensors) == ["fc1.weight", "fc1.bias", "emb", "counts", "t_view"]
        for key in reader.tensors:
            value = reader.get_tensor(key)
            if key == "emb":  # bfloat16, stored in the npz as float32
                assert value.dtype == ckpt.dtypes.bfloat16
                value = value.astype(np.float32)
            assert_bit_exact(expected[key.replace(".", "__")], value)
        # t_view is a transposed view: strides (1, 4) over a storage laid out as (3, 4)
        assert_bit_exact(np.arange(12, dtype=np.float32).reshape(3, 4).T, reader.get_tensor("t_view"))
        assert reader.verify() == []


def test_views_shared_storages_parameters_and_values(tmp_path):
    storage = np.arange(10, dtype=np.float32)
    f8 = np.array([0.5, -2.0, 448.0], dtype=ml_dtypes.float8_e4m3fn)
    shared = tensor("FloatStorage", "0", 10, 0, (2, 3), (3, 1))
    pickled = (b"\x80\x02" + EMPTY_DICT + MARK
               + text("model") + ordered_dict() + MARK
               + text("a") + shared + b"q\x01"  # memoised: the same tensor again below
               + text("tail") + tensor("FloatStorage", "0", 10, 6, (4,), (1,))
               + text("expanded") + tensor("FloatStorage", "0", 10, 8, (3, 2), (0, 1))
               + text("param") + glob("torch._utils", "_rebuild_parameter") + MARK
               + tensor("LongStorage", "1", 2, 0, (2,), (1,)) + NEWFALSE + ordered_dict() + TUPLE + REDUCE
               + text("f8") + tensor("UntypedStorage", "2", 3, 0, (3,), (1,), v3_dtype="float8_e4m3fn")
               + SETITEMS + EMPTY_DICT + text("_metadata") + ordered_dict() + SETITEM + BUILD
               + text("tied") + b"h\x01"
               + text("epoch") + num(12)
               + text("optimizer") + EMPTY_DICT + MARK
               + num(0) + EMPTY_DICT + text("step") + num(5) + SETITEM
               + text("param_groups") + EMPTY_LIST + EMPTY_DICT + text("lr") + b"G" + struct.pack(">d", 0.5)
               + SETITEM + APPEND
               + SETITEMS
               + text("blob") + glob("_codecs", "encode") + text("\xff\x00") + text("latin1") + b"\x86" + REDUCE
               + SETITEMS + STOP)
    path = torch_zip(tmp_path / "m.pt", pickled, {"0": storage.tobytes(), "1": np.array([7, -1]).tobytes(),
                                                  "2": f8.tobytes()})
    with ckpt.load_checkpoint(path) as reader:
        assert list(reader.tensors) == ["model/a", "model/tail", "model/expanded", "model/param", "model/f8", "tied"]
        assert_bit_exact(storage[:6].reshape(2, 3), reader.get_tensor("model/a"))
        assert_bit_exact(storage[:6].reshape(2, 3), reader.get_tensor("tied"))
        assert_bit_exact(storage[6:], reader.get_tensor("model/tail"))
        assert_bit_exact(np.array([[8, 9]] * 3, np.float32), reader.get_tensor("model/expanded"))
        assert_bit_exact(np.array([7, -1], np.int64), reader.get_tensor("model/param"))
        assert_bit_exact(f8, reader.get_tensor("model/f8"))
        assert reader.metadata == {"epoch": 12, "optimizer/0/step": 5, "optimizer/param_groups/0/lr": 0.5,
                                   "blob": "<2 bytes>"}


def test_opening_runs_nothing_a_hostile_pickle_names(tmp_path):
    marker = tmp_path / "pwned"
    attack = b"\x80\x02" + glob("os", "system") + text(f"touch {marker}") + b"\x85" + REDUCE + STOP
    path = torch_zip(tmp_path / "evil.pt", attack, {})
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="global os.system, which ckpt refuses") as info:
        ckpt.load_checkpoint(path)
    assert "evil.pt" in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize("pickled, error, message", [
    # protocol 4's STACK_GLOBAL, as pickle.dumps writes an object reducing to builtins.eval
    (b"\x80\x04\x95\x20\x00\x00\x00\x00\x00\x00\x00\x8c\x08builtins\x94\x8c\x04eval\x94\x93\x94"
     b"\x8c\x041+1\x94\x85\x94R\x94.", ckpt.UnsupportedCheckpointError, "global builtins.eval"),
    (b"\x80\x02" + glob("numpy.core.multiarray", "_reconstruct") + STOP, ckpt.UnsupportedCheckpointError,
     "numpy.core.multiarray._reconstruct"),
    (b"\x80\x02" + glob("collections", "OrderedDict") + EMPTY_TUPLE + b"\x81" + STOP,
     ckpt.UnsupportedCheckpointError, "opcode NEWOBJ"),
    (b"\x80\x02(ios\nsystem\n" + STOP, ckpt.UnsupportedCheckpointError, "opcode INST"),
    (b"\x80\x02" + EMPTY_LIST + EMPTY_DICT + BUILD + STOP, ckpt.UnsupportedCheckpointError, "state of a list"),
    (b"\x80\x02" + EMPTY_DICT + num(1) + APPEND + STOP, ckpt.CorruptCheckpointError, "appends to a dict"),
    (b"\x80\x02" + b"h\x07" + STOP, ckpt.CorruptCheckpointError, "memo entry 7"),
    (b"\x80\x02" + EMPTY_DICT, ckpt.CorruptCheckpointError, "malformed"),
    (b"\x80\x02" + EMPTY_DICT + EMPTY_DICT + STOP, ckpt.CorruptCheckpointError, "2 values on its stack"),
    (b"\x80\x02" + MARK + text("storage") + num(1) + TUPLE + b"Q" + STOP, ckpt.UnsupportedCheckpointError,
     "external object"),
    (b"\x80\x02" + glob("torch", "FloatStorage") + EMPTY_TUPLE + REDUCE + STOP, ckpt.UnsupportedCheckpointError,
     "calls a _ElementType"),
    (state_dict([("w", tensor("FloatStorage", "9", 2, 0, (2,), (1,)))]), ckpt.CorruptCheckpointError,
     "storage '9' .* is missing"),
    (state_dict([("w", tensor("FloatStorage", "0", 3, 0, (3,), (1,)))]), ckpt.CorruptCheckpointError,
     "should hold 3 elements .* holds 8"),
    (state_dict([("w", tensor("FloatStorage", "0", 2, 1, (2,), (1,)))]), ckpt.CorruptCheckpointError,
     "reaches beyond its storage"),
    (state_dict([("w", tensor("FloatStorage", "0", 2, 0, (2,), (1,), metadata=EMPTY_DICT + EMPTY_DICT))]),
     ckpt.CorruptCheckpointError, "malformed .*TypeError"),  # _rebuild_tensor_v2 with 8 arguments
    (b"\x80\x02" + EMPTY_DICT + MARK + num(1) + SETITEMS + STOP, ckpt.CorruptCheckpointError, "odd number"),
    (state_dict([("w", tensor("FloatStorage", "0", 2, 0, (2,), (1,), metadata=EMPTY_DICT + text("conj")
                              + b"\x88" + SETITEM))]), ckpt.CorruptCheckpointError, "marked as a conjugate view"),
    (state_dict([("w", tensor("FloatStorage", "0", 2, 0, (2,), (1,), metadata=EMPTY_DICT + text("sparse")
                              + b"\x88" + SETITEM))]), ckpt.UnsupportedCheckpointError, "carries metadata"),
    (state_dict([("w", tensor("FloatStorage", "0", 2, 0, (10 ** 6, 10 ** 6), (0, 1)))]), ckpt.CorruptCheckpointError,
     "reaches beyond its storage"),
    (state_dict([("w", tensor("FloatStorage", "0", 2, 0, (10 ** 6, 10 ** 6), (0, 0)))]),
     ckpt.UnsupportedCheckpointError, "larger than the whole file"),  # legal in torch, but not allocated here
    (state_dict([("a//b", tensor("FloatStorage", "0", 2, 0, (2,), (1,)))]), ckpt.UnsupportedCheckpointError,
     "cannot be a ckpt key"),
    (b"\x80\x02" + EMPTY_DICT + MARK + ints((1, 2)) + num(1) + SETITEMS + STOP, ckpt.UnsupportedCheckpointError,
     "uses a tuple as a dict key"),
    # a key nested 200000 deep: hashing it would overflow the C stack, so it is refused unhashed
    (b"\x80\x02" + EMPTY_DICT + EMPTY_TUPLE + b"\x85" * 200000 + num(1) + SETITEM + STOP,
     ckpt.UnsupportedCheckpointError, "uses a tuple as a dict key"),
    (b"\x80\x02" + MARK + EMPTY_TUPLE + b"\x85" * 200000 + b"\x91" + STOP, ckpt.UnsupportedCheckpointError,
     "uses a tuple as a dict key or set item"),
    (b"\x80\x02" + tensor("FloatStorage", "0", 2, 0, (2,), (1,)) + STOP, ckpt.UnsupportedCheckpointError,
     "holds a single tensor, not a state dict"),
    (b"\x80\x02" + EMPTY_LIST + b"q\x00h\x00" + APPEND + STOP, ckpt.UnsupportedCheckpointError, "contains itself"),
])
def test_hostile_or_broken_pickles(tmp_path, pickled, error, message):
    path = torch_zip(tmp_path / "bad.pt", pickled, {"0": b"\x00" * 8})
    with pytest.raises(error, match=message):
        ckpt.load_checkpoint(path)


def test_shared_containers_cannot_blow_up(tmp_path):
    # l0 = [t, t]; l_i = [l_{i-1}, l_{i-1}]: 2**41 paths to a tensor from a few hundred bytes
    body = EMPTY_LIST + MARK + tensor("FloatStorage", "0", 2, 0, (2,), (1,)) + b"q\x01h\x01e" + b"q\x02" + b"0"
    for level in range(2, 42):
        body += EMPTY_LIST + MARK + b"h" + bytes([level]) + b"h" + bytes([level]) + b"e" + b"q" + bytes([level + 1]) + b"0"
    pickled = b"\x80\x02" + EMPTY_DICT + text("x") + body + b"h" + bytes([42]) + SETITEM + STOP
    path = torch_zip(tmp_path / "bomb.pt", pickled, {"0": b"\x00" * 8})
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="shares containers"):
        ckpt.load_checkpoint(path)


def test_damaged_storage_and_pickle(tmp_path):
    pickled = state_dict([("w", tensor("FloatStorage", "0", 2, 0, (2,), (1,))),
                          ("v", tensor("FloatStorage", "0", 2, 1, (1,), (1,)))])
    path = tmp_path / "d.pt"
    torch_zip(path, pickled, {"0": np.array([1.5, 2.5], np.float32).tobytes()})
    raw = bytearray(path.read_bytes())
    at = raw.index(np.array([1.5, 2.5], np.float32).tobytes())
    raw[at] ^= 1
    path.write_bytes(bytes(raw))
    with ckpt.load_checkpoint(str(path)) as reader:
        for key in ("w", "v"):  # the whole storage, and a view of part of it
            with pytest.raises(ckpt.CorruptCheckpointError, match=rf"the storage of tensor '{key}' fails its checksum \(CRC-32"):
                reader.get_tensor(key)
        problems = reader.verify()  # each tensor of the damaged storage, by name
        assert len(problems) == 2 and "'w'" in problems[0] and "'v'" in problems[1]
    raw = bytearray(path.read_bytes())
    raw[raw.index(b"storage")] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"data.pkl' fails its checksum \(CRC-32"):
        ckpt.load_checkpoint(str(path))


def test_compressed_storages_legacy_files_and_other_zips(tmp_path):
    pickled = state_dict([("w", tensor("FloatStorage", "0", 2, 0, (2,), (1,)))])
    path = torch_zip(tmp_path / "z.pt", pickled, {"0": b"\x00" * 8}, compress=zipfile.ZIP_DEFLATED)
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="'archive/data/0' is compressed"):
        ckpt.load_checkpoint(path)
    legacy = tmp_path / "old.pt"
    legacy.write_bytes(b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19" + b".")
    with pytest.raises(ckpt.CorruptCheckpointError, match="malformed .*exhausted"):  # the magic number, then nothing
        ckpt.load_checkpoint(str(legacy))
    other = tmp_path / "other.zip"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("notes.txt", "hello")
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="not a checkpoint in any supported format"):
        ckpt.load_checkpoint(str(other))
    assert base.get_format("pytorch").sniff(pathlib.Path(path).read_bytes()[:4096])
