"""The built-in formats: round trips, plain h5py / msgpack as independent oracles, damage."""

from __future__ import annotations

import json
import os
import pathlib
import struct
import sys
import threading

import h5py
import msgpack
import numpy as np
import pytest
from conftest import assert_bit_exact, data_offset, every_dtype_tensors

import ckpt
from ckpt.formats import base, h5plain
from ckpt.formats import msgpack as mpfmt


def write(fmt, path, tensors, metadata=None):
    fmt.write(str(path), tensors, metadata or {})
    return str(path)


def test_every_dtype_round_trips_bit_exactly(tmp_path, fmt, tensors):
    path = write(fmt, tmp_path / f"all{fmt.extensions[0]}", tensors, {"step": 7, "nested": {"a": [1, 2.5]}})
    with base.open_reader(path) as reader:
        assert reader.format_name == fmt.name
        assert list(reader.tensors) == [k for k, _ in tensors]  # file order = write order
        assert reader.metadata == {"step": 7, "nested": {"a": [1, 2.5]}}
        for key, value in tensors:
            info = reader.tensors[key]
            assert info.shape == value.shape and info.dtype == value.dtype
            assert_bit_exact(value, reader.read(key))
        assert reader.verify() == []


def test_read_into_existing_buffer(tmp_path, fmt):
    value = np.arange(12, dtype=np.float32).reshape(3, 4)
    path = write(fmt, tmp_path / f"x{fmt.extensions[0]}", [("w", value)])
    out = np.zeros((3, 4), np.float32)
    with base.open_reader(path) as reader:
        reader.read_into("w", out)
        np.testing.assert_array_equal(out, value)
        with pytest.raises(ckpt.MismatchError):
            reader.read_into("w", np.zeros((4, 3), np.float32))
        with pytest.raises(ckpt.KeyNotFoundError, match="closest keys: w"):
            reader.read("ww")


# --- plain h5py as an oracle ----------------------------------------------------------------
def test_plain_h5py_sees_the_real_values(tmp_path, tensors):
    path = write(base.get_format("hdf5"), tmp_path / "oracle.h5", tensors, {"lr": 0.5})
    with h5py.File(path, "r") as f:
        assert f.attrs["ckpt_format"] == "ckpt-hdf5"
        assert int(f.attrs["ckpt_version"]) == 2
        assert json.loads(f.attrs["ckpt_metadata"]) == {"lr": 0.5}
        for key, value in tensors:
            ds = f[key]
            assert ds.shape == value.shape
            assert ds.chunks is None and ds.compression is None  # contiguous, uncompressed
            got = ds[()]
            if value.dtype == ckpt.dtypes.bfloat16:
                assert ds.attrs["ckpt_dtype"] == "bfloat16"
                np.testing.assert_array_equal(got, value.astype(np.float32))
            elif value.dtype.kind == "O":
                assert ds.attrs["ckpt_dtype"] == "string"
                # fixed-width strings: numpy strips trailing NULs; ckpt_lengths restores them
                assert [bytes(x) for x in np.asarray(got).reshape(-1)] == \
                    [x.rstrip(b"\x00") for x in value.reshape(-1)]
            else:
                assert got.dtype == value.dtype
                assert np.asarray(got).tobytes() == value.tobytes()
        assert "encoder" not in f  # groups only where keys put them
        assert isinstance(f["dtypes"], h5py.Group)


def test_hdf5_groups_follow_key_paths(tmp_path):
    path = write(base.get_format("hdf5"), tmp_path / "g.h5",
                 [("encoder/dense/kernel", np.ones((2, 3), np.float32)), ("encoder/dense/bias", np.zeros(3))])
    with h5py.File(path, "r") as f:
        assert list(f) == ["encoder"] and list(f["encoder"]) == ["dense"]
        assert sorted(f["encoder/dense"]) == ["bias", "kernel"]


def test_h5py_reader_reads_files_without_ckpt_index(tmp_path):
    path = tmp_path / "plain.h5"
    with h5py.File(path, "w") as f:
        f["a/b"] = np.arange(6.0).reshape(2, 3)
        f["s"] = np.array([b"x", b"yz"])
        f.create_dataset("v", data=np.array(["p", "qq"], dtype=object), dtype=h5py.string_dtype())
        f["scalar"] = np.int8(4)
    with ckpt.load_checkpoint(path) as reader:
        assert sorted(reader.get_variable_to_shape_map()) == ["a/b", "s", "scalar", "v"]
        np.testing.assert_array_equal(reader.get_tensor("a/b"), np.arange(6.0).reshape(2, 3))
        assert reader.get_tensor("s").tolist() == [b"x", b"yz"]
        assert reader.get_tensor("v").tolist() == [b"p", b"qq"]
        assert reader.get_tensor("scalar") == 4


def test_repacked_ckpt_file_is_read_through_its_attributes(tmp_path, tensors):
    """A ckpt file copied by h5py (no user block) still gives exact values."""
    path = write(base.get_format("hdf5"), tmp_path / "orig.h5", tensors)
    copy = tmp_path / "copy.h5"
    with h5py.File(path, "r") as src, h5py.File(copy, "w") as dst:
        for name in src:
            src.copy(src[name], dst, name=name)
        for k, v in src.attrs.items():
            dst.attrs[k] = v
    with base.open_reader(copy) as reader:
        assert isinstance(reader, h5plain.H5pyReader) and not reader.checksummed
        for key, value in tensors:
            assert_bit_exact(value, reader.read(key))


@pytest.mark.parametrize("kind", ["external_link", "soft_link", "external_storage", "virtual"])
def test_h5py_reader_refuses_links_and_foreign_storage(tmp_path, kind):
    path = tmp_path / "bad.h5"
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.arange(3.0)
    (tmp_path / "raw.bin").write_bytes(np.arange(3.0).tobytes())
    with h5py.File(path, "w") as f:
        f["ok"] = np.zeros(2)
        if kind == "external_link":
            f["link"] = h5py.ExternalLink(str(other), "x")
        elif kind == "soft_link":
            f["link"] = h5py.SoftLink("/ok")
        elif kind == "external_storage":
            f.create_dataset("ext", shape=(3,), dtype="f8", external=[(str(tmp_path / "raw.bin"), 0, 24)])
        else:
            layout = h5py.VirtualLayout(shape=(3,), dtype="f8")
            layout[:] = h5py.VirtualSource(str(other), "x", shape=(3,))
            f.create_virtual_dataset("virt", layout)
    with pytest.raises(ckpt.UnsupportedCheckpointError, match=r"bad\.h5"):
        ckpt.load_checkpoint(path)


# --- plain msgpack as an oracle ---------------------------------------------------------------
def plain_objects(path):
    """The file's objects as plain msgpack decodes them: the whole file is one array."""
    with open(path, "rb") as f:
        return msgpack.unpackb(f.read(), raw=False)


def test_plain_msgpack_unpackb_and_a_streaming_unpacker_decode_the_file(tmp_path, tensors):
    path = write(base.get_format("msgpack"), tmp_path / "oracle.msgpack", tensors, {"k": "v"})
    objects = plain_objects(path)  # one object: unpackb raises ExtraData on anything after it
    with open(path, "rb") as f:  # streaming, one element at a time, with a small buffer
        unpacker = msgpack.Unpacker(f, raw=False, max_buffer_size=1 << 20)
        assert [unpacker.unpack() for _ in range(unpacker.read_array_header())] == objects
        with pytest.raises(msgpack.OutOfData):
            unpacker.unpack()
    with open(path, "rb") as f:
        assert list(msgpack.Unpacker(f, raw=False)) == [objects]
    header, payloads, index, footer = objects[0], objects[1:-2], objects[-2], objects[-1]
    assert header == {"format": "ckpt-msgpack", "version": 3} and index["version"] == 3
    assert index["format"] == "ckpt-msgpack" and index["metadata"] == {"k": "v"}
    assert footer[0] == b"ckpt-idx"
    assert len(payloads) == len(tensors)
    for (key, value), payload in zip(tensors, payloads):
        dtype, shape, _extents, _crc = index["tensors"][key]
        assert dtype == ckpt.dtypes.dtype_name(value.dtype) and shape == list(value.shape)
        if value.dtype.kind == "O":
            assert payload == value.reshape(-1).tolist()
        else:
            assert payload == value.tobytes()
    size = os.path.getsize(path)
    raw = pathlib.Path(path).read_bytes()
    assert footer[1] + footer[2] + mpfmt.FOOTER_SIZE == size
    assert msgpack.unpackb(raw[footer[1]:footer[1] + footer[2]], raw=False) == index


def test_msgpack_splits_tensors_larger_than_one_bin(tmp_path):
    from ckpt.formats.builtin import MsgpackFormat

    value = np.arange(10, dtype=np.float32)  # 40 bytes -> 6 bin objects
    path = write(MsgpackFormat(max_bin=7), tmp_path / "split.msgpack", [("v", value), ("w", np.ones(2))])
    objects = plain_objects(path)
    extents = objects[-2]["tensors"]["v"][2]
    assert [n for _, n in extents] == [7, 7, 7, 7, 7, 5]
    assert b"".join(objects[1:7]) == value.tobytes()
    with base.open_reader(path) as reader:
        np.testing.assert_array_equal(reader.read("v"), value)
        assert reader.verify() == []


def checks_run(work) -> list[str]:
    """The key and metadata checks (formats/_validation.py) that ``work()`` runs, on any thread."""
    from ckpt.formats import _validation

    codes = {_validation.validate_keys.__code__: "keys", _validation.normalize_metadata.__code__: "metadata"}
    seen: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            seen.append(codes[frame.f_code])

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        work()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return sorted(seen)


@pytest.mark.parametrize("ext", [".h5", ".msgpack", ".safetensors"])
def test_keys_and_metadata_are_checked_once_per_save_path(tmp_path, ext):
    """The Saver checks keys when it is made and metadata once per save; save_file, convert and
    ``Format.write`` check them once before writing; the writer (``write_blob``) does not check again."""
    saver = ckpt.Saver({"a/w": ckpt.Variable(np.ones(3, np.float32))})
    assert checks_run(lambda: saver.save(str(tmp_path / f"m{ext}"), metadata={"x": 1})) == ["metadata"]
    src = tmp_path / f"f{ext}"
    assert checks_run(lambda: ckpt.save_file({"a/w": np.ones(3)}, src, {"x": 1})) == ["keys", "metadata"]
    assert checks_run(lambda: ckpt.convert(src, tmp_path / f"c{ext}")).count("keys") == 1
    fmt = base.format_for_path("x" + ext)
    assert checks_run(lambda: write(fmt, tmp_path / f"w{ext}", [("a", np.ones(2))])) == ["keys", "metadata"]


@pytest.mark.parametrize("ext", [".h5", ".msgpack", ".safetensors"])
def test_a_formats_write_still_checks_what_it_is_handed(tmp_path, ext):
    """A third party calling ``Format.write`` directly gets the checks a save makes."""
    fmt = base.format_for_path("x" + ext)
    with pytest.raises(ValueError, match=r"bad\.\w+: invalid key 'a//b'"):
        write(fmt, tmp_path / f"bad{ext}", [("a//b", np.ones(2))])
    with pytest.raises(ckpt.InvalidMetadataError, match=r"bad\.\w+"):
        write(fmt, tmp_path / f"bad{ext}", [("a", np.ones(2))], {"x": object()})


# --- versions, damage -------------------------------------------------------------------------
def test_newer_msgpack_version_is_a_clear_error(tmp_path):
    path = write(base.get_format("msgpack"), tmp_path / "v.msgpack", [("a", np.zeros(2))])
    raw = bytearray(pathlib.Path(path).read_bytes())
    raw[mpfmt.DATA_START - 1] = mpfmt.COMPRESSED_VERSION + 1  # the header's version
    pathlib.Path(path).write_bytes(raw)
    with pytest.raises(ckpt.UnsupportedCheckpointError, match=f"newer ckpt.*version {mpfmt.COMPRESSED_VERSION + 1}"):
        ckpt.load_checkpoint(path)


def test_newer_hdf5_version_is_a_clear_error(tmp_path):
    path = write(base.get_format("hdf5"), tmp_path / "v.h5", [("a", np.zeros(2))])
    raw = bytearray(pathlib.Path(path).read_bytes())
    raw[8:12] = struct.pack("<I", 3)
    raw[28:32] = struct.pack("<I", ckpt.formats._io.crc32c(bytes(raw[:28])))
    pathlib.Path(path).write_bytes(raw)
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="newer ckpt.*version 3"):
        ckpt.load_checkpoint(path)


def test_flipped_bit_in_tensor_data_is_caught_and_named(tmp_path, fmt):
    path = write(fmt, tmp_path / f"flip{fmt.extensions[0]}",
                 [("good", np.ones(8, np.float32)), ("bad", np.arange(8, dtype=np.float32))])
    offset = data_offset(path, np.arange(8, dtype=np.float32)) + 5
    raw = bytearray(pathlib.Path(path).read_bytes())
    raw[offset] ^= 0x10
    pathlib.Path(path).write_bytes(raw)
    with ckpt.load_checkpoint(path) as reader:
        np.testing.assert_array_equal(reader.get_tensor("good"), np.ones(8))
        with pytest.raises(ckpt.CorruptCheckpointError, match=r"flip.*'bad'.*checksum"):
            reader.get_tensor("bad")
        problems = reader.verify()
        assert len(problems) == 1 and "'bad'" in problems[0]


@pytest.mark.parametrize("bit", [0, 9, 63])
def test_damaged_hdf5_magic_never_reaches_libhdf5(tmp_path, bit, monkeypatch):
    path = write(base.get_format("hdf5"), tmp_path / "magic.h5", [("a", np.ones(4, np.float32))])
    raw = bytearray(pathlib.Path(path).read_bytes())
    raw[bit // 8] ^= 1 << (bit % 8)
    pathlib.Path(path).write_bytes(raw)
    monkeypatch.setattr(h5plain, "H5pyReader", None)  # any route to libhdf5 would fail loudly
    with pytest.raises(ckpt.CorruptCheckpointError, match="magic bytes are damaged"):
        ckpt.load_checkpoint(path)


def test_hdf5_open_refuses_a_damaged_structure(tmp_path):
    path = write(base.get_format("hdf5"), tmp_path / "meta.h5", [("a", np.ones(4, np.float32))])
    raw = bytearray(pathlib.Path(path).read_bytes())
    userblock = struct.unpack_from("<I", raw, 12)[0]
    raw[userblock + 20] ^= 0x01  # inside HDF5's superblock: h5py would read this structure
    pathlib.Path(path).write_bytes(raw)
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"meta\.h5: the HDF5 structure .* changed"):
        ckpt.load_checkpoint(path)


@pytest.mark.parametrize("cut", [1, 10, 33, 100])
def test_truncated_files_are_corrupt(tmp_path, fmt, cut):
    path = write(fmt, tmp_path / f"t{fmt.extensions[0]}", [("a", np.arange(64, dtype=np.float64))])
    raw = pathlib.Path(path).read_bytes()
    pathlib.Path(path).write_bytes(raw[:-cut])
    with pytest.raises(ckpt.CheckpointError, match=r"t\.(h5|msgpack)"):
        with ckpt.load_checkpoint(path) as reader:
            reader.get_tensor("a")


def test_unknown_and_empty_files(tmp_path):
    (tmp_path / "x.h5").write_bytes(b"")
    (tmp_path / "y.bin").write_bytes(b"hello world, not a checkpoint")
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="empty file.*hdf5.*msgpack"):
        ckpt.load_checkpoint(tmp_path / "x.h5")
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="supported formats"):
        ckpt.load_checkpoint(tmp_path / "y.bin")
    with pytest.raises(ckpt.CheckpointNotFoundError, match="nope.h5"):
        ckpt.load_checkpoint(tmp_path / "nope.h5")


def test_format_is_recognised_by_content_not_extension(tmp_path):
    path = write(base.get_format("msgpack"), tmp_path / "misnamed.h5", [("a", np.ones(2))])
    with ckpt.load_checkpoint(path) as reader:
        assert reader.format == "msgpack"


# --- reading only what is asked for --------------------------------------------------------------
def test_single_tensor_read_touches_only_its_bytes(tmp_path, fmt, monkeypatch):
    big = [(f"t{i}", np.full(1000, i, np.float64)) for i in range(5)]
    path = write(fmt, tmp_path / f"sel{fmt.extensions[0]}", big)
    reads = []
    real = os.preadv

    def spy(fd, buffers, offset):
        n = real(fd, buffers, offset)
        reads.append((offset, n))
        return n

    with base.open_reader(path) as reader:
        monkeypatch.setattr(os, "preadv", spy)
        value = reader.read("t3")
        monkeypatch.undo()
        start = data_offset(path, np.full(1000, 3.0))
    np.testing.assert_array_equal(value, np.full(1000, 3.0))
    assert reads == [(start, 8000)]


# --- registry and keys -----------------------------------------------------------------------
def test_registry_lookup_and_plugins():
    assert base.format_for_path("a/b.HDF5").name == "hdf5"
    assert base.format_for_path("a/b.msgpack").name == "msgpack"
    assert base.format_for_path("a/b.npz") is None
    with pytest.raises(ValueError, match="unknown checkpoint format"):
        base.get_format("zip")
    with pytest.raises(ValueError, match="already registered"):
        base.register_format(base.get_format("hdf5"))
    with pytest.raises(TypeError):
        base.register_format(object())


@pytest.mark.parametrize("keys, message", [
    (["x//y"], "empty"), (["/x"], "empty"), (["x/"], "empty"), (["a/../b"], r"'\.\.'"),
    (["."], r"'\.'"), (["a\x00b"], "NUL"), (["\udcff"], "UTF-8"), (["a", "a"], "duplicate"), ([""], "empty"),
])
def test_key_rules(tmp_path, fmt, keys, message):
    with pytest.raises(ValueError, match=message):
        fmt.write(str(tmp_path / "k"), [(k, np.zeros(1)) for k in keys], {})


def test_metadata_is_normalized_and_validated():
    assert base.normalize_metadata({"a": np.float32(1.5), "b": (1, 2), "c": np.arange(2)}, "p") == \
        {"a": 1.5, "b": [1, 2], "c": [0, 1]}
    with pytest.raises(ValueError, match="metadata keys must be strings"):
        base.normalize_metadata({1: 2}, "p")
    with pytest.raises(ValueError, match="object"):
        base.normalize_metadata({"x": object()}, "p")
    with pytest.raises(ValueError, match="dict"):
        base.normalize_metadata([1], "p")


def test_hdf5_files_are_deterministic(tmp_path):
    tensors = every_dtype_tensors()
    a = write(base.get_format("hdf5"), tmp_path / "a.h5", tensors, {"x": 1})
    b = write(base.get_format("hdf5"), tmp_path / "b.h5", tensors, {"x": 1})
    assert pathlib.Path(a).read_bytes() == pathlib.Path(b).read_bytes()


def test_large_tensors_start_page_aligned(tmp_path, fmt):
    """Matching file offsets and buffer addresses modulo the page size give the fastest copies."""
    big = np.arange(1 << 16, dtype=np.float32)  # 256 KiB
    tensors = [("small", np.ones(3, np.int8)), ("big", big), ("big2", big[::-1].copy())]
    path = write(fmt, tmp_path / f"aligned{fmt.extensions[0]}", tensors)
    assert data_offset(path, big) % 4096 == 0 and data_offset(path, big[::-1].copy()) % 4096 == 0
    with base.open_reader(path) as reader:
        assert reader.verify() == []
        np.testing.assert_array_equal(reader.read("big"), big)
    if fmt.name == "msgpack":  # padding is zero-filled bin objects, outside every tensor
        objects = plain_objects(path)
        payloads = list(objects[1:-2])
        assert payloads[0] == b"\x01\x01\x01" and payloads[2] == big.tobytes()
        assert not any(payloads[1]) and not any(payloads[3])  # the padding before each big tensor


def test_damaged_msgpack_padding_is_reported_by_verify(tmp_path):
    big = np.arange(1 << 16, dtype=np.float32)
    path = write(base.get_format("msgpack"), tmp_path / "pad.msgpack", [("small", np.ones(3, np.int8)), ("big", big)])
    raw = bytearray(pathlib.Path(path).read_bytes())
    padding_header = raw.index(b"\xc5", mpfmt.DATA_START + 5)  # the bin 16 padding after "small"
    raw[padding_header] ^= 0x01
    pathlib.Path(path).write_bytes(raw)
    with base.open_reader(path) as reader:
        np.testing.assert_array_equal(reader.read("big"), big)  # the data is intact...
        assert any("framing" in p for p in reader.verify())  # ...but plain msgpack could not decode it


def test_unreadable_files_are_not_reported_as_missing(tmp_path, monkeypatch):
    """Code that starts afresh on CheckpointNotFoundError must not do so on an I/O error."""
    path = write(base.get_format("msgpack"), tmp_path / "m.msgpack", [("a", np.ones(2))])
    real_open = os.open

    def failing(name, *args, **kwargs):
        if str(name) == path:
            raise OSError(5, "Input/output error")
        return real_open(name, *args, **kwargs)

    monkeypatch.setattr(os, "open", failing)  # LocalFile opens with os.open (non-blocking, then fstat)
    with pytest.raises(ckpt.CorruptCheckpointError, match="Input/output error") as info:
        base.open_reader(path)
    assert not isinstance(info.value, FileNotFoundError)


def test_register_format_is_one_public_contract(tmp_path):
    """Plugins register through ckpt.register_format, as the built-ins do: a Format subclass, checked."""
    assert all(isinstance(f, ckpt.Format) for f in base.formats())
    assert {f.name for f in base.formats() if isinstance(f, ckpt.WritableFormat)} >= {"hdf5", "msgpack"}

    class Marked(ckpt.Format):
        name, extensions, can_write = "marked", (".marked",), False

        def sniff(self, head: bytes) -> bool:
            return head.startswith(b"MARKED")

        def open(self, path: str, blob=None, declined=None) -> base.Reader:
            raise ckpt.UnsupportedCheckpointError(f"{path}: marked files hold no tensors")

    path = tmp_path / "x.bin"
    path.write_bytes(b"MARKED")
    ckpt.register_format(Marked())
    try:
        assert not Marked().claims(str(path))  # inherited from ckpt.Format
        with pytest.raises(ckpt.UnsupportedCheckpointError, match="marked files hold no tensors"):
            ckpt.load_checkpoint(str(path))
    finally:
        ckpt.unregister_format("marked")

    class NoClaims:  # duck-typed: not a Format
        name, extensions, can_write = "noclaims", (".nc",), False

        def claims(self, path: str) -> bool:
            return False

        def sniff(self, head: bytes) -> bool:
            return False

        def open(self, path: str, blob=None, declined=None) -> base.Reader:
            raise NotImplementedError

    with pytest.raises(TypeError, match="is not a Format: subclass ckpt.Format"):
        ckpt.register_format(NoClaims())  # type: ignore[arg-type]

    class Liar(Marked):
        name, can_write = "liar", True

    with pytest.raises(TypeError, match="can_write is True but it is not a ckpt.WritableFormat"):
        ckpt.register_format(Liar())
    assert "noclaims" not in {f.name for f in base.formats()} and "liar" not in {f.name for f in base.formats()}


class _MiniReader(base.BaseReader):
    """A third-party reader with only what BaseReader requires: no optional ability overridden."""

    format_name, checksummed = "mini", False

    def __init__(self, path: str, parsed: dict) -> None:
        self.path, self._metadata = path, {}
        self._arrays = {k: np.asarray(v["data"], v["dtype"]).reshape(v["shape"]) for k, v in parsed.items()}
        self._tensors = {k: base.TensorInfo(k, a.dtype, a.shape, a.nbytes) for k, a in self._arrays.items()}

    def _read_into(self, info: base.TensorInfo, out: np.ndarray) -> None:
        out[...] = self._arrays[info.key]


class _Mini(ckpt.Format):
    name, extensions = "mini", (".mini",)

    def sniff(self, head: bytes) -> bool:
        return head.startswith(b"MINI\n")

    def open(self, path: str, blob=None, declined=None) -> base.Reader:
        blob = base.open_blob(path) if blob is None else blob
        try:
            raw = bytearray(blob.size)
            blob.read_into(memoryview(raw), 0, "the file")
        finally:
            blob.close()
        return _MiniReader(path, json.loads(bytes(raw[5:])))


def _write_mini(path, tensors: dict) -> str:
    body = {k: {"dtype": v.dtype.str, "shape": list(v.shape), "data": v.reshape(-1).tolist()} for k, v in tensors.items()}
    pathlib.Path(path).write_bytes(b"MINI\n" + json.dumps(body).encode())
    return str(path)


@pytest.fixture
def mini():
    ckpt.register_format(_Mini())
    yield
    ckpt.unregister_format("mini")


def test_a_minimal_third_party_reader_works_everywhere_through_the_default_abilities(mini, tmp_path):
    """restore, get_slice, read_box_into, chunked reads, inspect --stats, diff and convert use the
    abilities BaseReader declares (read_slice, read_box_into, stored_crc32c, ...) with their defaults."""
    from click.testing import CliRunner

    from ckpt.cli.main import main
    from ckpt.tools.chunks import stored_crc32c, tensor_chunks

    tensors = {"w": np.arange(24, dtype=np.float32).reshape(4, 6), "b": np.array([1, -2, 3], np.int64)}
    path = _write_mini(tmp_path / "m.mini", tensors)
    w, b = ckpt.Variable(np.zeros((4, 6), np.float32), name="w"), ckpt.Variable(np.zeros(3, np.int64), name="b")
    ckpt.Saver([w, b]).restore(path)
    assert_bit_exact(tensors["w"], w.numpy())
    assert_bit_exact(tensors["b"], b.numpy())

    with ckpt.load_checkpoint(path) as reader:
        assert_bit_exact(tensors["w"][1:3, 2], reader.get_slice("w", np.s_[1:3, 2]))
        out = np.empty((2, 3), np.float32)
        reader._reader.read_box_into("w", (2, 3), out)
        assert_bit_exact(tensors["w"][2:4, 3:6], out)
        with pytest.raises(ckpt.MismatchError, match="does not lie inside"):  # not numpy's broadcast error
            reader._reader.read_box_into("w", (3, 3), out)
        assert stored_crc32c(reader, "w") is None and not reader._reader.partial_reads
        assert np.concatenate(list(tensor_chunks(reader, "w", chunk_elements=5))).tolist() == list(range(24))

    runner = CliRunner()
    h5 = str(tmp_path / "m.h5")
    converted = runner.invoke(main, ["convert", path, h5])
    assert converted.exit_code == 0, converted.output
    with ckpt.load_checkpoint(h5) as reader:
        assert_bit_exact(tensors["w"], reader.get_tensor("w"))
        assert_bit_exact(tensors["b"], reader["b"])
    assert runner.invoke(main, ["diff", path, h5]).exit_code == 0
    other = _write_mini(tmp_path / "o.mini", {**tensors, "b": np.array([1, -2, 4], np.int64)})
    assert runner.invoke(main, ["diff", path, other]).exit_code == 1
    stats = runner.invoke(main, ["inspect", "--stats", path])
    assert stats.exit_code == 0, stats.output
    assert stats.output == runner.invoke(main, ["inspect", "--stats", h5]).output


def test_open_must_return_a_base_reader(tmp_path):
    """Callers use the optional abilities BaseReader declares without probing: a format whose open()
    returns some other object is refused with a TypeError naming it, and that object is closed."""
    closed = []

    class Duck:
        path, format_name, checksummed = "x", "duck", False

        def close(self):
            closed.append(True)

    class Ducked(ckpt.Format):
        name, extensions = "ducked", (".duck",)

        def sniff(self, head: bytes) -> bool:
            return head.startswith(b"DUCK")

        def open(self, path: str, blob=None, declined=None) -> base.Reader:
            if blob is not None:
                blob.close()
            return Duck()  # type: ignore[return-value]

    path = tmp_path / "m.duck"
    path.write_bytes(b"DUCK")
    ckpt.register_format(Ducked())
    try:
        with pytest.raises(TypeError, match="format 'ducked': open\\(\\) returned a Duck, not a reader: subclass"):
            ckpt.load_checkpoint(str(path))
    finally:
        ckpt.unregister_format("ducked")
    assert closed == [True]


def test_a_format_registered_before_another_claims_some_of_its_files_and_declines_the_rest(tmp_path):
    """register_format(before=) puts a format ahead of another; ckpt.decline hands a file it opened and
    found not to be its own on to the next format that sniffs it (how "keras" sits before "hdf5")."""
    opened = []

    class Handle:
        def __init__(self, path):
            self.path, self.closed = path, False
            opened.append(self)

        def close(self):
            self.closed = True

    class Tagged(ckpt.Format):
        name, extensions, can_write = "tagged", (".tagged",), False

        def sniff(self, head: bytes) -> bool:
            return h5plain._h5head.foreign_hdf5(head)

        def open(self, path: str, blob=None, declined=None) -> base.Reader:
            with h5py.File(path, "r") as f:
                tagged = "tag" in f.attrs
            if not tagged:
                ckpt.decline(path, "no 'tag' attribute", Handle(path))
            raise ckpt.UnsupportedCheckpointError(f"{path}: tagged, and nothing more")

    plain, tagged = str(tmp_path / "plain.h5"), str(tmp_path / "tagged.h5")
    for path in (plain, tagged):
        with h5py.File(path, "w") as f:
            f["w"] = np.arange(3.0)
    with h5py.File(tagged, "a") as f:
        f.attrs["tag"] = 1
    with pytest.raises(ValueError, match="before 'nope'"):
        ckpt.register_format(Tagged(), before="nope")
    ckpt.register_format(Tagged(), before="keras")
    try:
        names = [f.name for f in base.formats()]
        assert names.index("tagged") + 1 == names.index("keras") < names.index("hdf5")
        with pytest.raises(ckpt.UnsupportedCheckpointError, match="tagged, and nothing more"):
            ckpt.load_checkpoint(tagged)
        with ckpt.load_checkpoint(plain) as reader:  # declined: hdf5 reads it (keras declines too)
            assert reader.format == "hdf5" and reader.get_tensor("w").tolist() == [0.0, 1.0, 2.0]
        assert [h.closed for h in opened] == [True]  # nobody took the handle: closed by the registry
        with pytest.raises(ckpt.UnsupportedCheckpointError, match="plain.h5: no 'tag' attribute") as declined:
            base.get_format("tagged").open(plain)  # asked directly: an UnsupportedCheckpointError
        assert declined.value.opened is opened[-1] and not opened[-1].closed  # handed to the caller
    finally:
        ckpt.unregister_format("tagged")


def test_a_foreign_hdf5_file_is_opened_once_though_keras_declines_it(tmp_path, monkeypatch):
    """keras is asked before hdf5; for a plain HDF5 file it hands its open reader on (base.decline):
    libhdf5 opens the file once in this process, and the hdf5 format reads it."""
    path = str(tmp_path / "plain.h5")
    with h5py.File(path, "w") as f:
        f["enc/w"] = np.arange(4.0)
    inits = []
    real_init = h5plain.H5pyReader.__init__

    def counting(self, *args, **kwargs):
        inits.append(args)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(h5plain.H5pyReader, "__init__", counting)
    with ckpt.load_checkpoint(path) as reader:
        assert reader.format == "hdf5" and reader.get_tensor("enc/w").tolist() == [0.0, 1.0, 2.0, 3.0]
    assert len(inits) == 1
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="without Keras's layout") as declined:
        base.get_format("keras").open(path)
    assert isinstance(declined.value.opened, h5plain.H5pyReader)  # what it opened, for the caller to close
    declined.value.opened.close()


def test_open_reader_sniffs_through_the_blob_the_reader_then_uses(tmp_path, fmt, monkeypatch):
    """open_reader reads the first bytes through open_blob and hands that blob to the format's open:
    a checkpoint file is opened once."""
    path = write(fmt, tmp_path / f"once{fmt.extensions[0]}", [("w", np.arange(3.0))])
    from ckpt.formats import _io

    opened = []
    real_init = _io.LocalFile.__init__

    def counting(self, *args, **kwargs):
        opened.append(args[0])
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(_io.LocalFile, "__init__", counting)
    with base.open_reader(path) as reader:
        assert reader.read("w").tolist() == [0.0, 1.0, 2.0]
    assert opened == [path]
