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
import pathlib
import re
import shutil
import struct
import zipfile

import crc32c
import h5py
import msgpack
import numpy as np
import pytest
from reliability_support import time_limit
from test_foreign_safetensors import build as safetensors_file
from test_foreign_tensorflow import block, bundle, entry, header, mask, varint
from test_foreign_torch import MARK, glob, num, ordered_dict, state_dict, text, torch_zip

import ckpt
from ckpt.formats import base
from conftest import TESTS


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


# --- huge but empty shapes, and integers no format needs ----------------------------------------------
HUGE = 2 ** 62


def long1(i: int) -> bytes:
    """Pickle's LONG1 (LONG4 above 255 bytes): any int, little-endian two's complement."""
    raw = i.to_bytes((i.bit_length() + 8) // 8, "little", signed=True)
    if len(raw) > 255:  # LONG4
        return b"\x8b" + struct.pack("<I", len(raw)) + raw
    return b"\x8a" + bytes([len(raw)]) + raw


def torch_tensor(key: str, numel: int, offset: int, shape: tuple, stride: tuple) -> bytes:
    """What torch.save pickles for a float32 tensor (ints of any width)."""
    def ints(values: tuple) -> bytes:
        return MARK + b"".join(long1(v) for v in values) + b"t"

    storage = MARK + text("storage") + glob("torch", "FloatStorage") + text(key) + text("cpu") + num(numel) + b"tQ"
    return (glob("torch._utils", "_rebuild_tensor_v2") + MARK + storage + long1(offset) + ints(shape) + ints(stride)
            + b"\x89" + ordered_dict() + b"tR")


def torch_file(directory, name: str, items: list[tuple[str, bytes]], storages: dict[str, bytes]) -> str:
    return torch_zip(directory / name, state_dict(items), storages)


EMPTY_SHAPES = [(0, HUGE), (HUGE, 0), (0, 2 ** 31, 2 ** 31), (1, 0, 2 ** 49), (0,) * 63 + (2 ** 60,)]


def huge_empty_cases(directory, shape: tuple) -> dict[str, str]:
    """One file per foreign format holding a float32 tensor of ``shape`` (no elements, no bytes)."""
    paths = {}
    paths["safetensors"] = safetensors_file(directory / "huge.safetensors", [("w", "F32", list(shape), b"")])
    paths["tensorflow"] = bundle(directory, [("w", 1, shape, b"", crc32c.crc32c(b""))])
    flax = msgpack.ExtType(1, msgpack.packb((list(shape), "float32", b""), use_bin_type=True))
    (directory / "huge.msgpack").write_bytes(msgpack.packb({"params": {"w": flax}}, use_bin_type=True))
    paths["flax"] = str(directory / "huge.msgpack")
    stride = tuple(1 for _ in shape)
    paths["torch"] = torch_file(directory, "huge.pt", [("w", torch_tensor("0", 0, 0, shape, stride))], {"0": b""})
    if len(shape) <= 32:  # HDF5's rank limit
        with h5py.File(directory / "huge.h5", "w") as f:
            f.create_dataset("w", shape=shape, maxshape=(None,) * len(shape), chunks=(1,) * len(shape), dtype="<f4")
        paths["foreign hdf5"] = str(directory / "huge.h5")
    return paths


@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=lambda s: "x".join(map(str, s[-3:])))
def test_huge_but_empty_shapes_are_refused_by_every_foreign_reader(tmp_path, shape, h5_in_process):
    cases = huge_empty_cases(tmp_path, shape)
    for fmt, path in cases.items():
        assert outcome(path) == "error at open", fmt
        with pytest.raises(ckpt.CorruptCheckpointError, match="elements"):
            base.open_reader(path)
    assert len(cases) == (5 if len(shape) <= 32 else 4)


TORCH_INTS = {  # label: (numel, offset, shape, stride) of a float32 view of a 4-element storage
    "stride 2**70 on a dimension of 1": (4, 0, (1, 4), (2 ** 70, 1)),
    "stride 2**62 on a dimension of 1": (4, 0, (1, 4), (HUGE, 1)),
    "offset 2**70 of an empty view": (4, 2 ** 70, (0,), (1,)),
    "stride 2**64 of an empty view": (4, 0, (0, 3), (2 ** 64, 1)),
    "shape [2**40, 2**40]": (4, 0, (2 ** 40, 2 ** 40), (0, 0)),
    "offset 2**63 - 1": (4, 2 ** 63 - 1, (1,), (1,)),
}


@pytest.mark.parametrize("label", TORCH_INTS)
def test_torch_views_with_overflowing_offsets_strides_or_shapes_are_refused(tmp_path, label):
    numel, offset, shape, stride = TORCH_INTS[label]
    path = torch_file(tmp_path, "v.pt", [("w", torch_tensor("0", numel, offset, shape, stride))],
                      {"0": np.arange(4, dtype=np.float32).tobytes()})
    assert outcome(path) == "error at open"


def test_a_5000_digit_integer_in_a_torch_state_dict(tmp_path):
    """Kept as metadata (described, since no JSON number holds it), the tensors read fine."""
    huge = 7 ** 6000  # 5,071 digits: str() refuses it
    items = [("w", torch_tensor("0", 2, 0, (2,), (1,))), ("step", long1(huge)), ("neg", long1(-huge))]
    path = torch_file(tmp_path, "i.pt", items, {"0": np.arange(2, dtype=np.float32).tobytes()})
    assert outcome(path) == "ok"
    with ckpt.load_checkpoint(path) as reader:
        assert reader.metadata["step"].startswith("<int of ") and reader.get_tensor("w").tolist() == [0.0, 1.0]


# --- HDF5 type confusion (files ckpt did not write, read through h5py) ----------------------------------
def confusing_values() -> dict[str, object]:
    """Values of HDF5 types where ckpt or Keras expect something else (None: an HDF5 time type)."""
    return {"time": None, "int": np.int64(7), "int array": np.array([1, 2]), "float": 1.5,
            "string array": np.array([b"a", b"b"]), "opaque": np.void(b"\x00\x01"), "non-UTF-8": b"\xff\xfe",
            "empty array": np.zeros(0), "bool": True}


def put_attr(obj, name: str, value: object) -> None:
    if value is None:
        from h5py import h5a, h5s, h5t

        if name in obj.attrs:
            del obj.attrs[name]
        h5a.create(obj.id, name.encode(), h5t.UNIX_D64LE, h5s.create(h5s.SCALAR))
    else:
        obj.attrs[name] = value


def keras_legacy(f) -> None:
    f.attrs["layer_names"] = np.array([b"dense"])
    f.attrs["keras_version"], f.attrs["backend"] = b"2.1.6", b"tensorflow"
    g = f.create_group("dense")
    g.attrs["weight_names"] = np.array([b"dense/kernel:0"])
    g.create_dataset("dense/kernel:0", data=np.ones((2, 2), np.float32))


PLACES = {  # where the confusing value goes: (build the ordinary file, the object holding the attribute)
    "root ckpt_version": (lambda f: f.create_dataset("w", data=np.arange(3.0)), "/", "ckpt_version"),
    "root ckpt_metadata": (lambda f: f.create_dataset("w", data=np.arange(3.0)), "/", "ckpt_metadata"),
    "dataset ckpt_dtype": (lambda f: f.create_dataset("w", data=np.arange(3.0)), "w", "ckpt_dtype"),
    "dataset dtype (Keras 3's tag)": (lambda f: f.create_dataset("w", data=np.arange(3.0)), "w", "dtype"),
    "string dataset ckpt_lengths": (lambda f: f.create_dataset("s", data=np.array([b"ab", b"c"])), "s",
                                    "ckpt_lengths"),
    "Keras layer_names": (keras_legacy, "/", "layer_names"),
    "Keras weight_names": (keras_legacy, "dense", "weight_names"),
    "Keras 3 vars name": (lambda f: f.create_group("layers/dense/vars").create_dataset("0", data=np.ones(2)),
                          "layers/dense/vars", "name"),
}


@pytest.fixture
def h5_in_process(monkeypatch):
    """These HDF5 files are well-formed (h5py wrote them): no need for the crash-guard child."""
    from ckpt.formats import _h5child

    monkeypatch.setattr(_h5child, "ENABLED", False)


def test_foreign_hdf5_type_confusion_never_escapes_as_a_raw_error(tmp_path, h5_in_process):
    counts: collections.Counter = collections.Counter()
    for place, (build, owner, name) in PLACES.items():
        for kind, value in confusing_values().items():
            path = str(tmp_path / f"{len(counts)}.h5")
            with h5py.File(path, "w") as f:
                build(f)
                put_attr(f[owner], name, value)
            try:
                got = outcome(path)
            except Exception as exc:  # the property: never anything but a CheckpointError
                raise AssertionError(f"{place} = {kind}: {type(exc).__name__}: {exc}") from exc
            counts[place, got] += 1
    print(f"\nforeign HDF5 type confusion: {sum(counts.values())} files")
    for (place, got), n in sorted(counts.items()):
        print(f"  {place:32} {got:16} {n}")
    assert sum(counts.values()) == len(PLACES) * len(confusing_values())


def test_foreign_hdf5_datasets_of_types_numpy_lacks_are_refused(tmp_path, h5_in_process):
    from h5py import h5d, h5s, h5t

    path = str(tmp_path / "time.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("w", data=np.arange(3.0))
        h5d.create(f.id, b"t", h5t.UNIX_D64LE, h5s.create_simple((2,)))
    assert outcome(path) == "error at open"


@pytest.mark.parametrize("data", ["hello", b"bytes", ["a", "bc"], [b"x", b""]])
def test_ordinary_variable_length_string_datasets_read_exactly(tmp_path, data, h5_in_process):
    path = str(tmp_path / "s.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("s", data=data, dtype=h5py.string_dtype("utf-8" if isinstance(data, str) or
                                                                 isinstance(data[0], str) else "ascii"))
    expected = [x.encode() if isinstance(x, str) else x for x in (data if isinstance(data, list) else [data])]
    assert outcome(path) == "ok"
    with ckpt.load_checkpoint(path) as reader:
        value = reader.get_tensor("s")
        assert value.reshape(-1).tolist() == expected and all(type(x) is bytes for x in value.reshape(-1))
        assert value.shape == (() if not isinstance(data, list) else (len(data),))


def huge_integer_cases(directory) -> dict[str, str]:
    """Integers past anything a file needs, where each foreign format keeps its sizes and offsets."""
    paths = {}

    def st(name: str, header: str) -> None:
        path = directory / f"{name}.safetensors"
        raw = header.encode()
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
        paths[f"safetensors {name}"] = str(path)

    st("dimension 2**64", '{"w": {"dtype": "F32", "shape": [18446744073709551616], "data_offsets": [0, 8]}}')
    st("dimension of 5000 digits", '{"w": {"dtype": "F32", "shape": [' + "9" * 5000 + '], "data_offsets": [0, 8]}}')
    st("offsets 2**64", '{"w": {"dtype": "F32", "shape": [2], "data_offsets": [18446744073709551616, '
       '18446744073709551624]}}')
    st("negative offset", '{"w": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}')
    for name, shape in (("dimension 2**64 - 1", [2 ** 64 - 1]), ("dimensions 2**63 x 2", [2 ** 63, 2]),
                        ("dimension -1", [-1])):
        flax = msgpack.ExtType(1, msgpack.packb((shape, "float32", bytes(8)), use_bin_type=True))
        path = directory / f"flax {name}.msgpack"
        path.write_bytes(msgpack.packb({"params": {"w": flax}}, use_bin_type=True))
        paths[f"flax {name}"] = str(path)
    for name, (shape, offset, size) in {"dimension 2**63": ((2 ** 63,), 0, 8),
                                        "offset 2**64 - 1": ((2,), 2 ** 64 - 1, 8),
                                        "size 2**63": ((2,), 0, 2 ** 63)}.items():
        sub = directory / f"tf {name}"
        sub.mkdir()
        index = [(b"w", entry(1, shape, offset, size, crc32c.crc32c(bytes(8))))]
        paths[f"tensorflow {name}"] = bundle(sub, [], extra_entries=index)
        with open(paths[f"tensorflow {name}"] + ".data-00000-of-00001", "wb") as f:
            f.write(bytes(8))
    return paths


def test_huge_integers_in_every_foreign_format_are_refused(tmp_path):
    cases = huge_integer_cases(tmp_path)
    for name, path in cases.items():
        assert outcome(path) == "error at open", name
    assert len(cases) == 10


# --- integers past Python's 4,300-digit limit for int <-> str (issue 24) --------------------------------
def digits(n: int) -> str:
    """An n-digit integer literal (str() of such an int raises, so it is written as text)."""
    return "9" * n


@pytest.mark.parametrize("n", [5000, 9000])
def test_integer_keys_past_the_digit_limit_in_a_torch_state_dict(tmp_path, n):
    huge = 10 ** n - 1
    w = torch_tensor("0", 2, 0, (2,), (1,))
    data = {"0": np.arange(2, dtype=np.float32).tobytes()}
    top = torch_zip(tmp_path / "top.pt", b"\x80\x02}(" + long1(huge) + w + b"u.", data)
    nested = torch_zip(tmp_path / "nested.pt", b"\x80\x02}(" + text("opt") + b"}(" + long1(-huge) + w + b"uu.", data)
    for path, where in ((top, "the top level"), (nested, "opt")):
        with pytest.raises(ckpt.UnsupportedCheckpointError, match=f"{path}: {where} has an integer key of "):
            ckpt.load_checkpoint(path)
    small = torch_zip(tmp_path / "small.pt", b"\x80\x02}(" + text("opt") + b"}(" + long1(0) + w + b"uu.", data)
    with ckpt.load_checkpoint(small) as reader:  # optimizer state numbers its parameters: those stay keys
        assert reader.get_tensor("opt/0").tolist() == [0.0, 1.0]


def test_integers_past_the_digit_limit_inside_a_torch_pickle_are_named(tmp_path):
    huge = 7 ** 6000
    storage = MARK + text("storage") + glob("torch", "FloatStorage") + text("0") + text("cpu") + long1(huge) + b"tQ"
    view = (glob("torch._utils", "_rebuild_tensor_v2") + MARK + storage + num(0) + MARK + num(2) + b"t" + MARK
            + num(1) + b"t" + b"\x89" + ordered_dict() + b"tR")
    path = torch_zip(tmp_path / "numel.pt", state_dict([("w", view)]), {"0": bytes(8)})
    with pytest.raises(ckpt.CorruptCheckpointError, match=f"{path}: storage '0' declares <int of {huge.bit_length()} bits> elem"):
        ckpt.load_checkpoint(path)
    storage = MARK + text("storage") + glob("torch", "FloatStorage") + long1(huge) + text("cpu") + num(2) + b"tQ"
    path = torch_zip(tmp_path / "key.pt", state_dict([("w", storage)]), {"0": bytes(8)})
    with pytest.raises(ckpt.UnsupportedCheckpointError, match=f"{path}: .*external object <a tuple holding an int"):
        ckpt.load_checkpoint(path)
    legacy = tmp_path / "legacy.pt"  # the legacy format's system info, shown in its error
    legacy.write_bytes(b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19." + b"\x80\x02M\xe9\x03."
                       + b"\x80\x02}(X\x0d\x00\x00\x00little_endian\x89X\x01\x00\x00\x00x" + long1(huge) + b"u.")
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="little-endian machine .*holding an integer too long"):
        ckpt.load_checkpoint(str(legacy))


def json_cases(directory, n: int) -> dict[str, tuple[str, str]]:
    """name: (path to open, the JSON file named in the error) with an n-digit integer in JSON a reader parses."""
    fixtures = pathlib.Path(TESTS) / "fixtures" / "foreign"
    big = digits(n)
    cases = {}
    for name, head in (("shape", '{"w": {"dtype": "F32", "shape": [' + big + '], "data_offsets": [0, 8]}}'),
                       ("metadata", '{"__metadata__": {"x": ' + big + '}, "w": {"dtype": "F32", "shape": [2], '
                                    '"data_offsets": [0, 8]}}')):
        path = directory / f"{name}.safetensors"
        path.write_bytes(struct.pack("<Q", len(head)) + head.encode() + bytes(8))
        cases[f"safetensors {name}"] = (str(path), str(path))
    for layout, index in (("hf_sharded_safetensors", "model.safetensors.index.json"),
                          ("keras_sharded", "model.weights.json")):
        copy = directory / layout
        shutil.copytree(fixtures / layout, copy)
        raw = (copy / index).read_text()
        (copy / index).write_text(re.sub(r'"total_size":\s*[0-9.]+', f'"total_size": {big}', raw))
        cases[layout] = (str(copy / index), str(copy / index))
    copy = directory / "orbax_zarr"
    shutil.copytree(fixtures / "orbax_zarr", copy)
    meta = copy / "_METADATA"
    meta.write_text(meta.read_text().replace("{", '{"step": ' + big + ", ", 1))
    cases["orbax _METADATA"] = (str(copy), str(meta))
    copy = directory / "orbax_zarray"
    shutil.copytree(fixtures / "orbax_zarr", copy)
    zarray = copy / "params.emb" / ".zarray"
    zarray.write_text(re.sub(r'"shape":\s*\[\d+', '"shape": [' + big, zarray.read_text()))
    cases["orbax .zarray"] = (str(copy), str(zarray))
    keras = directory / "m.keras"
    with zipfile.ZipFile(fixtures / "keras3_model.keras") as src, zipfile.ZipFile(keras, "w") as out:
        for name in src.namelist():
            out.writestr(name, '{"date_saved": ' + big + "}" if name == "metadata.json" else src.read(name))
    cases["keras metadata.json"] = (str(keras), str(keras) + ": metadata.json")
    return cases


@pytest.mark.parametrize("n", [5000, 9000])
def test_json_integers_past_the_digit_limit_name_the_file_and_the_number(tmp_path, n):
    cases = json_cases(tmp_path, n)
    for name, (path, named) in cases.items():
        with pytest.raises(ckpt.CorruptCheckpointError) as info:
            ckpt.load_checkpoint(path)
        assert named in str(info.value) and f"an integer of {n} digits" in str(info.value), name
    assert len(cases) == 7
