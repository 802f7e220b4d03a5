"""TensorFlow's sliced variables: TF1 partitioners and TF2's MaxShardSizePolicy, reassembled as
tf.train.load_checkpoint returns them, and read in blocks with get_slice.

Fixtures written by tensorflow-cpu 2.21 (tests/fixtures/foreign/generators/gen_tf_keras.py).
"""

from __future__ import annotations

import pathlib
import os
import shutil

import numpy as np
import pytest
from conftest import assert_bit_exact, TESTS

import ckpt
from ckpt.formats import _sstable, tensorflow

FIXTURES = os.path.join(TESTS, "fixtures", "foreign")
CASES = [("tf1_partitioned", "tf1_partitioned_expected.npz", 4), ("tf2_sliced/ckpt", "tf2_sliced_expected.npz", 4)]


def expected(npz):
    data = np.load(os.path.join(FIXTURES, npz))
    out = {}
    for name in data.files:
        value = data[name]
        if name.endswith("__bits"):
            name, value = name[:-len("__bits")], value.view(ckpt.dtypes.bfloat16)
        out[name] = value
    return out


def npz_key(key):
    return key.replace("/", "__").replace(".", "__")


@pytest.mark.parametrize("directory, npz, count", CASES)
def test_sliced_variables_reassemble_bit_exact(directory, npz, count):
    want = expected(npz)
    with ckpt.load_checkpoint(os.path.join(FIXTURES, directory)) as reader:
        keys = reader.get_variable_to_shape_map()
        assert (len(keys) == count and "non_tensors" not in reader.metadata) or \
            set(reader.metadata["non_tensors"]) == {"_CHECKPOINTABLE_OBJECT_GRAPH"}
        for key in keys:
            assert_bit_exact(want[npz_key(key)], reader.get_tensor(key))
        assert reader.verify() == []


@pytest.mark.parametrize("directory, npz, count", CASES)
def test_get_slice_reads_blocks(directory, npz, count):
    want = expected(npz)
    rng = np.random.default_rng(7)
    with ckpt.load_checkpoint(os.path.join(FIXTURES, directory)) as reader:
        for key, shape in reader.get_variable_to_shape_map().items():
            full = want[npz_key(key)]
            for _ in range(25):
                index = []
                for dim in shape:
                    a = int(rng.integers(0, dim + 1))
                    b = int(rng.integers(a, dim + 1))
                    index.append(slice(a, b) if rng.random() < 0.8 or a == dim else a)
                index = tuple(index)
                assert_bit_exact(np.array(full[index]), reader.get_slice(key, index))
            assert_bit_exact(full, reader.get_slice(key, ()))
            with pytest.raises(IndexError):
                reader.get_slice(key, (slice(None, None, 2),) * max(len(shape), 1))


def test_get_slice_reads_only_the_slices_it_needs(monkeypatch):
    path = os.path.join(FIXTURES, "tf2_sliced", "ckpt")
    reads = []
    original = tensorflow.TensorFlowReader._read_entry

    def spy(self, entry, out, what):
        reads.append(entry)
        return original(self, entry, out, what)

    monkeypatch.setattr(tensorflow.TensorFlowReader, "_read_entry", spy)
    with ckpt.load_checkpoint(path) as reader:
        key = "model/big/.ATTRIBUTES/VARIABLE_VALUE"  # 12 rows in 5 slices: rows 0-3, 4, 5-8, 9, 10-11
        reader.get_slice(key, np.s_[5:7, :])
        assert len(reads) == 1
        reads.clear()
        reader.get_tensor(key)
        assert len(reads) == 5


def test_slice_keys_decode():
    name, extents = tensorflow.decode_slice_key(b"\x00a\x00\xff\x00\x01\x01\x02\x82\x7f\xc0\x40\x3f\xbf")
    assert name == "a\x00" and extents == ((2, -1), (64, -65))
    for raw in [b"a", b"\x00abc", b"\x00a\x00\x01\x09", b"\x00a\x00\x01\x01\x01\x80", b"\x00a\x00\x01\x01\x01\x80\x80\x80",
                b"\x00a\x00\x02", b"\x00a\x00\x01\x01\x41"]:
        with pytest.raises(_sstable.SSTableError):
            tensorflow.decode_slice_key(raw)


@pytest.mark.parametrize("regions, shape, ok", [
    ([((0, 2), (0, 3)), ((2, 2), (0, 3))], (4, 3), True),
    ([((0, 2), (0, 3)), ((1, 3), (0, 3))], (4, 3), False),  # overlap
    ([((0, 2), (0, 3)), ((3, 1), (0, 3))], (4, 3), False),  # hole
    ([((0, 2), (0, 3)), ((2, 3), (0, 3))], (4, 3), False),  # outside
    ([((0, 2), (0, 2)), ((0, 2), (2, 1)), ((2, 2), (0, 1)), ((2, 2), (1, 2))], (4, 3), True),
    ([((0, 0), (0, 3))], (0, 3), True),
])
def test_tiling_check(regions, shape, ok):
    if ok:
        tensorflow.check_tiling(regions, shape, "x")
    else:
        with pytest.raises(_sstable.SSTableError):
            tensorflow.check_tiling(regions, shape, "x")


def copy(tmp_path, directory="tf1_partitioned"):
    target = tmp_path / directory
    shutil.copytree(os.path.join(FIXTURES, directory), target)
    return target


def test_a_missing_slice_data_file_is_named(tmp_path):
    target = copy(tmp_path, "tf2_sliced")
    os.remove(target / "ckpt.data-00004-of-00011")
    with pytest.raises(ckpt.CorruptCheckpointError, match="data-00004-of-00011"):
        ckpt.load_checkpoint(str(target / "ckpt"))


def test_a_damaged_slice_fails_its_checksum(tmp_path):
    target = copy(tmp_path, "tf2_sliced")
    data = target / "ckpt.data-00001-of-00011"
    raw = bytearray(data.read_bytes())
    raw[5] ^= 1
    data.write_bytes(bytes(raw))
    with ckpt.load_checkpoint(str(target / "ckpt")) as reader:
        with pytest.raises(ckpt.CorruptCheckpointError, match="big.*fails its checksum"):
            reader.get_tensor("model/big/.ATTRIBUTES/VARIABLE_VALUE")
        assert reader.verify()


# --- hand-built bundles: slices that do not add up -------------------------------------------------
def ordered_signed(value):
    """OrderedCode's signed encoding, for the small values used here (|value| < 8192)."""
    if -64 <= value < 64:
        return bytes([(0x80 ^ value) & 0xFF])
    raw = (value & 0xFFFF).to_bytes(2, "big")
    return bytes([raw[0] ^ 0xC0, raw[1]])


def slice_key(name, extents):
    return (b"\x00" + name.encode() + b"\x00\x01" + bytes([1, len(extents)])
            + b"".join(ordered_signed(s) + ordered_signed(n) for s, n in extents))


def slice_proto(extents):
    from test_foreign_tensorflow import f_bytes, f_int

    return b"".join(f_bytes(1, f_int(1, s) + (f_int(2, n) if n != -1 else b"")) for s, n in extents)


def sliced_bundle(tmp_path, value, pieces, declared=None, dtype_enum=1):
    """A bundle holding variable "v" = ``value`` saved as ``pieces`` [(start, length) per dim]."""
    import crc32c
    from test_foreign_tensorflow import entry, f_bytes, header, table

    data, entries = b"", [(b"", header())]
    for extents in pieces:
        region = tuple(slice(s, s + (value.shape[d] if n == -1 else n)) for d, (s, n) in enumerate(extents))
        raw = np.ascontiguousarray(value[region]).tobytes()
        entries.append((slice_key("v", extents), entry(dtype_enum, value[region].shape, len(data), len(raw),
                                                       crc32c.crc32c(raw))))
        data += raw
    full = entry(dtype_enum, value.shape, 0, 0, 0) + b"".join(f_bytes(7, slice_proto(e))
                                                              for e in (declared or pieces))
    entries.append((b"v", full))
    prefix = str(tmp_path / "model.ckpt-1")
    with open(prefix + ".index", "wb") as f:
        f.write(table(entries))
    with open(prefix + ".data-00000-of-00001", "wb") as f:
        f.write(data)
    return prefix


def test_hand_built_slices_with_full_extents(tmp_path):
    value = np.arange(200, 224, dtype=np.float32).reshape(4, 6)
    prefix = sliced_bundle(tmp_path, value, [((0, 1), (0, -1)), ((1, 3), (0, 2)), ((1, 3), (2, 4))])
    assert_bit_exact(value, ckpt.load_variable(prefix, "v"))
    with ckpt.load_checkpoint(prefix) as reader:
        assert_bit_exact(value[2:, 1:3], reader.get_slice("v", np.s_[2:, 1:3]))


@pytest.mark.parametrize("pieces, declared, words", [
    ([((0, 2), (0, -1))], [((0, 2), (0, -1)), ((2, 2), (0, -1))], "slice .* is missing"),
    ([((0, 2), (0, -1)), ((2, 2), (0, -1))], [((0, 2), (0, -1))], "holds 2 slices of it, its entry lists 1"),
    ([((0, 2), (0, -1)), ((1, 3), (0, -1))], None, "overlap"),
    ([((0, 2), (0, -1)), ((3, 1), (0, -1))], None, "leave holes"),
    ([((0, 2), (0, -1)), ((2, 2), (0, 3))], [((0, 2), (0, -1)), ((2, 2), (0, 6))], "slice .* is missing"),
    ([((0, 4), (0, -1))], [((0, 4),)], "1 dimensions for a tensor of 2"),
])
def test_hand_built_slices_that_do_not_tile(tmp_path, pieces, declared, words):
    value = np.arange(24, dtype=np.float32).reshape(4, 6)
    prefix = sliced_bundle(tmp_path, value, pieces, declared)
    with pytest.raises(ckpt.CorruptCheckpointError, match=words):
        ckpt.load_checkpoint(prefix)


def test_orphan_slices_are_refused(tmp_path):
    import crc32c
    from test_foreign_tensorflow import entry, header, table

    raw = np.zeros(2, np.float32).tobytes()
    entries = [(b"", header()), (slice_key("ghost", [(0, 2)]), entry(1, (2,), 0, 8, crc32c.crc32c(raw)))]
    prefix = str(tmp_path / "model.ckpt-1")
    pathlib.Path(prefix + ".index").write_bytes(table(entries))
    pathlib.Path(prefix + ".data-00000-of-00001").write_bytes(raw)
    with pytest.raises(ckpt.CorruptCheckpointError, match="slices of 'ghost'"):
        ckpt.load_checkpoint(prefix)


def read_all(path):
    with ckpt.load_checkpoint(path) as reader:
        for key in reader.get_variable_to_shape_map():
            reader.get_tensor(key)


def test_index_truncated_at_every_byte_and_bit_flips(tmp_path):
    """The sliced checkpoint's index: every truncation, and seeded single-bit flips, end in a value or
    a CheckpointError (the index blocks carry crc32c, so nearly all flips are caught there)."""
    target = copy(tmp_path, "tf2_sliced")
    index = target / "ckpt.index"
    raw = index.read_bytes()
    for n in range(len(raw)):
        index.write_bytes(raw[:n])
        with pytest.raises(ckpt.CheckpointError):
            read_all(str(target / "ckpt"))
    rng = np.random.default_rng(16)
    for _ in range(300):
        flipped = bytearray(raw)
        flipped[int(rng.integers(len(raw)))] ^= 1 << int(rng.integers(8))
        index.write_bytes(bytes(flipped))
        try:
            read_all(str(target / "ckpt"))
        except ckpt.CheckpointError:
            pass


def test_read_box_into_reads_blocks_for_a_distributed_restore():
    """A reader's read_box_into (what a sharded restore uses) takes the sliced reader's own path."""
    want = expected("tf2_sliced_expected.npz")
    with ckpt.load_checkpoint(os.path.join(FIXTURES, "tf2_sliced", "ckpt")) as reader:
        key = "model/wide/.ATTRIBUTES/VARIABLE_VALUE"
        out = np.empty((2, 30), np.float64)
        reader._reader.read_box_into(key, (1, 10), out)
        assert_bit_exact(want[npz_key(key)][1:3, 10:40], out)
        with pytest.raises(ckpt.MismatchError, match="does not lie inside"):
            reader._reader.read_box_into(key, (2, 30), out)
