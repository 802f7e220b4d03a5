"""TensorFlow bundles: the checkpoints TF1 and TF2 wrote, hand-built bundles, damaged and hostile ones."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct

import crc32c
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import assert_bit_exact, TESTS

import ckpt
from ckpt.cli import main
from ckpt.formats import _sstable

FIXTURES = os.path.join(TESTS, "fixtures", "foreign")


# --- a minimal bundle writer, from the format's description -------------------------------
def varint(n):
    n &= (1 << 64) - 1
    out = b""
    while True:
        out += bytes([n & 0x7F | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            return out


def mask(crc):
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def f_int(number, value):
    return varint(number << 3) + varint(value)


def f_bytes(number, data):
    return varint(number << 3 | 2) + varint(len(data)) + data


def entry(dtype, shape, offset, size, crc, shard=0, slices=0, unknown_rank=False):
    shape_msg = b"".join(f_bytes(2, f_int(1, d)) for d in shape) + (f_int(3, 1) if unknown_rank else b"")
    return (f_int(1, dtype) + f_bytes(2, shape_msg) + f_int(3, shard) + f_int(4, offset) + f_int(5, size)
            + varint(6 << 3 | 5) + struct.pack("<I", mask(crc)) + f_bytes(7, b"") * slices)


def header(shards=1, big_endian=False):
    return f_int(1, shards) + f_int(2, int(big_endian)) + f_bytes(3, f_int(1, 1))


def block(entries):
    body = b"".join(varint(0) + varint(len(k)) + varint(len(v)) + k + v for k, v in entries)
    return body + struct.pack("<II", 0, 1)  # one restart point, at 0


def snappy_literal(data):
    """Snappy 'compression' with literals only (tag 61: a 2-byte length)."""
    out = varint(len(data))
    for i in range(0, len(data), 65536):
        piece = data[i:i + 65536]
        out += bytes([61 << 2]) + struct.pack("<H", len(piece) - 1) + piece
    return out


def table(entries, snappy=False):
    out = b""

    def put(contents, kind=0):
        nonlocal out
        offset = len(out)
        out += contents + bytes([kind]) + struct.pack("<I", mask(crc32c.crc32c(contents + bytes([kind]))))
        return offset, len(contents)

    data = block(sorted(entries))
    handle = put(snappy_literal(data), 1) if snappy else put(data)
    meta = put(block([]))
    index = put(block([(b"\xff", varint(handle[0]) + varint(handle[1]))]))
    footer = varint(meta[0]) + varint(meta[1]) + varint(index[0]) + varint(index[1])
    return out + footer + b"\x00" * (40 - len(footer)) + struct.pack("<Q", 0xDB4775248B80FB57)


def tf_strings(items):
    """TensorFlow's string tensor layout and its crc32c."""
    lengths = b"".join(varint(len(x)) for x in items)
    crc = crc32c.crc32c(b"".join(struct.pack("<I", len(x)) for x in items))
    length_crc = struct.pack("<I", mask(crc))
    crc = crc32c.crc32c(length_crc, crc)
    data = b"".join(items)
    return lengths + length_crc + data, crc32c.crc32c(data, crc)


def bundle(directory, tensors, extra_entries=(), snappy=False, shards=1, big_endian=False):
    """Write prefix.index and prefix.data-00000-of-00001; tensors: [(key, dtype enum, shape, raw, crc)]."""
    prefix = os.path.join(str(directory), "model.ckpt-1")
    data, entries = b"", [(b"", header(shards, big_endian))]
    for key, dtype, shape, raw, crc in tensors:
        entries.append((key.encode(), entry(dtype, shape, len(data), len(raw), crc)))
        data += raw
    entries += list(extra_entries)
    with open(prefix + ".index", "wb") as f:
        f.write(table(entries, snappy))
    with open(prefix + f".data-00000-of-{shards:05d}", "wb") as f:
        f.write(data)
    return prefix


def numeric(key, value, dtype_enum):
    raw = value.tobytes()
    return key, dtype_enum, value.shape, raw, crc32c.crc32c(raw)


# --- the real files ------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["tf1_saver", "tf1_saver/model.ckpt-7", "tf1_saver/model.ckpt-7.index",
                                   "tf1_saver/model.ckpt-7.data-00000-of-00001"])
def test_the_checkpoint_a_tf1_saver_wrote(where):
    expected = np.load(os.path.join(FIXTURES, "tf1_saver_expected.npz"))
    with ckpt.load_checkpoint(os.path.join(FIXTURES, where)) as reader:
        assert reader.format == "tensorflow"
        assert reader.path == os.path.join(FIXTURES, "tf1_saver", "model.ckpt-7")
        assert sorted(reader.tensors) == sorted(k.replace("__", "/") for k in expected.files)
        for key in reader.tensors:
            assert_bit_exact(expected[key.replace("/", "__")], reader.get_tensor(key))
        assert reader.metadata == {} and reader.verify() == []


def test_the_checkpoint_tf2_wrote():
    expected = np.load(os.path.join(FIXTURES, "tf2_object_expected.npz"))
    path = os.path.join(FIXTURES, "tf2_object")
    assert ckpt.latest_checkpoint(path) == os.path.join(path, "ckpt-1")
    with ckpt.load_checkpoint(path) as reader:
        assert sorted(reader.tensors) == sorted(k.replace("__", "/") for k in expected.files)
        for key in reader.tensors:
            assert_bit_exact(expected[key.replace("/", "__")], reader.get_tensor(key))
        graph = reader.metadata["non_tensors"]["_CHECKPOINTABLE_OBJECT_GRAPH"]
        assert "object graph" in graph
        with pytest.raises(ckpt.KeyNotFoundError, match="'_CHECKPOINTABLE_OBJECT_GRAPH' is not a tensor.*object graph"):
            reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH")
    value = ckpt.load_variable(path, "model/w/.ATTRIBUTES/VARIABLE_VALUE")
    assert_bit_exact(expected["model__w__.ATTRIBUTES__VARIABLE_VALUE"], value)


# --- a directory copied from another machine ---------------------------------------------------
#: Where the run lived on the machine that wrote it (exists nowhere here).
ELSEWHERE = ["/home/ckpt-elsewhere/run", "C:\\Users\\ckpt-elsewhere\\run"]


def tf_state(directory, *prefixes):
    """A TensorFlow state file as the v1 Saver writes it: absolute paths, the last one latest."""
    quoted = [json.dumps(p) for p in prefixes]  # TF's text format escapes like JSON here
    lines = [f"model_checkpoint_path: {quoted[-1]}"] + [f"all_model_checkpoint_paths: {q}" for q in quoted]
    (directory / "checkpoint").write_text("\n".join(lines) + "\n")


def run_cli(*args):
    try:
        runner = CliRunner(mix_stderr=False)
    except TypeError:  # click >= 8.2 always keeps stderr apart
        runner = CliRunner()
    return runner.invoke(main, [str(a) for a in args], prog_name="ckpt", catch_exceptions=False)


@pytest.mark.parametrize("elsewhere", ELSEWHERE)
def test_a_copied_directory_whose_state_file_names_the_old_machines_paths(tmp_path, elsewhere):
    """The prefix the state file names is gone, the same name sits beside the state file: that one."""
    copy = tmp_path / "copied"
    shutil.copytree(os.path.join(FIXTURES, "tf1_saver"), copy, copy_function=shutil.copyfile)
    sep = "\\" if "\\" in elsewhere else "/"
    tf_state(copy, f"{elsewhere}{sep}model.ckpt-5", f"{elsewhere}{sep}model.ckpt-7")
    assert ckpt.latest_checkpoint(copy) == str(copy / "model.ckpt-7")
    with ckpt.load_checkpoint(copy) as reader, np.load(os.path.join(FIXTURES, "tf1_saver_expected.npz")) as want:
        assert reader.path == str(copy / "model.ckpt-7")
        assert_bit_exact(want["encoder__dense__kernel"], reader.get_tensor("encoder/dense/kernel"))
    rows = {(c.path, c.note) for c in ckpt.list_checkpoints(copy)}
    assert rows == {("model.ckpt-7", "latest"), (f"{elsewhere}{sep}model.ckpt-5", "missing")}
    inspected = run_cli("inspect", copy)
    assert inspected.exit_code == 0 and "encoder/dense/kernel" in inspected.stdout
    listed = run_cli("ls", copy)
    assert listed.exit_code == 0 and "model.ckpt-7" in listed.stdout and "latest" in listed.stdout


def test_a_state_file_whose_paths_match_nothing_names_the_missing_path(tmp_path):
    copy = tmp_path / "copied"
    shutil.copytree(os.path.join(FIXTURES, "tf1_saver"), copy, copy_function=shutil.copyfile)
    missing = f"{ELSEWHERE[0]}/model.ckpt-9"  # step 9 was never copied
    tf_state(copy, missing)
    assert ckpt.latest_checkpoint(copy) is None
    with pytest.raises(ckpt.CheckpointNotFoundError, match=f"{re.escape(missing)}.*does not exist"):
        ckpt.load_checkpoint(copy)
    inspected = run_cli("inspect", copy)
    assert inspected.exit_code == 1 and missing in inspected.stderr
    rows = ckpt.list_checkpoints(copy)
    assert (rows[0].path, rows[0].note) == (missing, "missing")


def test_an_existing_absolute_path_is_used_as_it_is(tmp_path):
    """A state file beside a same-named copy still reads the path it names when that exists."""
    original = tmp_path / "original"
    shutil.copytree(os.path.join(FIXTURES, "tf1_saver"), original, copy_function=shutil.copyfile)
    other = tmp_path / "other"
    shutil.copytree(os.path.join(FIXTURES, "tf1_saver"), other, copy_function=shutil.copyfile)
    tf_state(other, str(original / "model.ckpt-7"))
    assert ckpt.latest_checkpoint(other) == str(original / "model.ckpt-7")


# --- hand-built bundles ----------------------------------------------------------------------
@pytest.mark.parametrize("snappy", [False, True])
def test_hand_built_bundle_with_strings_bfloat16_and_non_tensors(tmp_path, snappy):
    kernel = np.arange(6, dtype=np.float32).reshape(2, 3)
    bf = np.array([1.5, -3.0], dtype=ckpt.dtypes.bfloat16)
    strings = [b"abc", b"", b"\x00\xff" * 40]
    raw, crc = tf_strings(strings)
    prefix = bundle(tmp_path, [numeric("dense/kernel", kernel, 1), numeric("bf", bf, 14),
                               ("names", 7, (3,), raw, crc)],
                    extra_entries=[(b"iterator", entry(21, (), 0, 0, 0))], snappy=snappy)
    with ckpt.load_checkpoint(prefix) as reader:
        assert list(reader.tensors) == ["bf", "dense/kernel", "names"]
        assert_bit_exact(kernel, reader.get_tensor("dense/kernel"))
        assert_bit_exact(bf, reader.get_tensor("bf"))
        assert_bit_exact(np.array(strings, dtype=object), reader.get_tensor("names"))
        assert set(reader.metadata["non_tensors"]) == {"iterator"}  # sliced variables: test_foreign_tf_slices
        with pytest.raises(ckpt.KeyNotFoundError, match="variant value"):
            reader.get_tensor("iterator")


def test_snappy_decompression():
    assert _sstable.snappy_decompress(b"\x0d\x08abc\x15\x03\x00X") == b"abcabcabcabcX"  # overlapping copy
    assert _sstable.snappy_decompress(b"\x06\x08abc\x0a\x03\x00") == b"abcabc"  # 2-byte offset
    for bad, message in [(b"\x06\x08abc\x0a\x00\x00", "outside"), (b"\x06\x08abc\x0a\x09\x00", "outside"),
                         (b"\x10\x08abc", "not the 16"), (b"\xff\xff\xff\x7f\x08abc", "claims"),
                         (b"\x05\x10ab", "past the end")]:
        with pytest.raises(_sstable.SSTableError, match=message):
            _sstable.snappy_decompress(bad)


# --- damaged copies of the real checkpoint ---------------------------------------------------
@pytest.fixture
def tf1_copy(tmp_path):
    shutil.copytree(os.path.join(FIXTURES, "tf1_saver"), tmp_path / "tf1", copy_function=shutil.copyfile)
    return tmp_path / "tf1" / "model.ckpt-7"


def flip(path, offset):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x10
    path.write_bytes(bytes(raw))


def test_damaged_data_fails_the_checksum(tf1_copy):
    flip(tf1_copy.parent / "model.ckpt-7.data-00000-of-00001", 0)
    with ckpt.load_checkpoint(str(tf1_copy)) as reader:
        problems = reader.verify()
        assert len(problems) == 1 and "fails its checksum" in problems[0]
        damaged = next(k for k in reader.tensors if f"tensor {k!r}" in problems[0])
        with pytest.raises(ckpt.CorruptCheckpointError, match=f"'{damaged}' fails its checksum"):
            reader.get_tensor(damaged)
        for key in reader.tensors:
            if key != damaged:
                reader.get_tensor(key)


def test_truncated_or_missing_data_file(tf1_copy):
    data = tf1_copy.parent / "model.ckpt-7.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[:50])
    with pytest.raises(ckpt.CorruptCheckpointError, match="truncated"):
        ckpt.load_checkpoint(str(tf1_copy))
    data.unlink()
    with pytest.raises(ckpt.CorruptCheckpointError, match="data file of .* is missing"):
        ckpt.load_checkpoint(str(tf1_copy))


def test_damaged_index(tf1_copy):
    index = tf1_copy.parent / "model.ckpt-7.index"
    flip(index, 20)
    with pytest.raises(ckpt.CorruptCheckpointError, match="model.ckpt-7.index: the block at offset 0 fails its checksum"):
        ckpt.load_checkpoint(str(tf1_copy))
    flip(index, 20)
    flip(index, index.stat().st_size - 1)
    with pytest.raises(ckpt.CorruptCheckpointError, match="no table magic"):
        ckpt.load_checkpoint(str(tf1_copy))
    index.write_bytes(b"short")
    with pytest.raises(ckpt.CorruptCheckpointError, match="too short"):
        ckpt.load_checkpoint(str(tf1_copy))


# --- hostile hand-built bundles --------------------------------------------------------------
def test_hostile_entries(tmp_path):
    cases = [
        (dict(tensors=[("w", 1, (2,), b"\x00" * 4, 0)]), ckpt.CorruptCheckpointError, r"float32 \[2\] needs 8 bytes"),
        (dict(tensors=[], extra_entries=[(b"w", entry(1, (2,), 0, 8, 0, unknown_rank=True))]),
         ckpt.CorruptCheckpointError, "unknown rank"),
        (dict(tensors=[], extra_entries=[(b"w", entry(1, (2,), 0, 8, 0, shard=3))]),
         ckpt.CorruptCheckpointError, "shard 3 of 1"),
        (dict(tensors=[], extra_entries=[(b"w", entry(7, (10 ** 12,), 0, 8, 0))]),
         ckpt.CorruptCheckpointError, "1000000000000 strings cannot fit in 8 bytes"),
        (dict(tensors=[], extra_entries=[(b"w", entry(1, (2 ** 40, 2 ** 40), 0, 8, 0))]),
         ckpt.CorruptCheckpointError, "needs 4835703278458516698824704 bytes"),
        (dict(tensors=[numeric("a//b", np.zeros(1, np.float32), 1)]), ckpt.UnsupportedCheckpointError,
         "'a//b' cannot be a ckpt key"),
        (dict(tensors=[], big_endian=True), ckpt.UnsupportedCheckpointError, "big-endian"),
        (dict(tensors=[], extra_entries=[(b"w", b"\x0a\xff")]), ckpt.CorruptCheckpointError, "entry of 'w' is damaged"),
    ]
    for i, (kwargs, error, message) in enumerate(cases):
        directory = tmp_path / str(i)
        directory.mkdir()
        prefix = bundle(directory, **kwargs)
        with pytest.raises(error, match=message) as info:
            ckpt.load_checkpoint(prefix)
        assert "model.ckpt-1" in str(info.value)


def test_an_index_without_a_header_entry(tmp_path):
    prefix = os.path.join(str(tmp_path), "model.ckpt-1")
    with open(prefix + ".index", "wb") as f:
        f.write(table([(b"w", entry(1, (1,), 0, 4, 0))]))
    open(prefix + ".data-00000-of-00001", "wb").close()
    with pytest.raises(ckpt.CorruptCheckpointError, match="no header entry"):
        ckpt.load_checkpoint(prefix)


def test_damaged_string_lengths(tmp_path):
    raw, crc = tf_strings([b"ab", b"cd"])
    raw = raw[:2] + bytes([raw[2] ^ 1]) + raw[3:]  # the length checksum
    prefix = bundle(tmp_path, [("s", 7, (2,), raw, crc)])
    with ckpt.load_checkpoint(prefix) as reader:
        with pytest.raises(ckpt.CorruptCheckpointError, match="'s': the string lengths are damaged"):
            reader.get_tensor("s")


def test_inspect_shows_the_object_graph_as_a_non_tensor():
    from click.testing import CliRunner

    from ckpt.cli.main import main

    listing = CliRunner().invoke(main, ["inspect", os.path.join(FIXTURES, "tf2_object")])
    assert listing.exit_code == 0
    assert "non-tensor: _CHECKPOINTABLE_OBJECT_GRAPH (TensorFlow's object graph" in listing.output
    asked = CliRunner().invoke(main, ["inspect", os.path.join(FIXTURES, "tf2_object"), "--tensor",
                                      "_CHECKPOINTABLE_OBJECT_GRAPH"])
    assert asked.exit_code == 1 and "is not a tensor: TensorFlow's object graph" in asked.output
