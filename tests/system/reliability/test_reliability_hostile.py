"""Hostile files: crafted to make a reader allocate, loop, escape the directory or execute.

Every crafted index below has valid checksums, so nothing but the reader's own checks stands
between it and the data. Each must end in a ckpt.CheckpointError raised while opening (before
any tensor data is read; a restore changes nothing) with memory bounded by the file's size,
not by a declared field. Nothing unpickles: the standard unpickler is booby-trapped for this
whole module, and a torch file whose pickle calls a function must be refused before the call.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import tracemalloc
import zipfile

import h5py
import numpy as np
import pytest
from reliability_support import (
    Restorer,
    hdf5_rebuild,
    hdf5_split,
    msgpack_rebuild,
    msgpack_split,
    packb,
    read_outcome,
    small_tensors,
    splice,
    write_checkpoint,
)

import ckpt
from ckpt.formats.base import open_reader
from conftest import OUTSIDE_CHECKOUT, ROOT

PLACE = "PLACEHOLDER-VALUE"
MEMORY_LIMIT = 16 << 20  # bytes a hostile file of at most ~300 KB may make the reader allocate


@pytest.fixture(autouse=True)
def no_unpickling(monkeypatch):
    """Fail the test if anything reaches Python's unpickler (or numpy's pickle loading)."""
    import _pickle
    import pickle

    calls = []

    def trap(*args, **kwargs):
        calls.append(args[:1])
        raise AssertionError("something tried to unpickle")

    for module in (pickle, _pickle):
        for name in ("load", "loads", "Unpickler"):
            monkeypatch.setattr(module, name, trap)
    yield
    assert not calls, "a reader unpickled"


def test_no_module_imports_an_unpickler():
    """Static check of every module of the package: no pickle-family import, no allow_pickle."""
    pattern = re.compile(r"^\s*(import|from)\s+(pickle|_pickle|cPickle|dill|cloudpickle|joblib)\b|allow_pickle\s*=\s*True"
                         r"|\bpickle\.(loads?|Unpickler)\b|torch\.load\(", re.M)
    checked = 0
    for package in ("ckpt", "formats", "cli"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                        source = f.read()
                    assert not pattern.search(source), f"{package}/{name}: {pattern.search(source).group(0)!r}"
                    checked += 1
    assert checked > 20


def assert_refused_on_open(path: str, expected: list, what: str, error=ckpt.CheckpointError) -> str:
    """Opening ``path`` raises ``error`` with bounded memory; a restore changes nothing."""
    tracemalloc.start()
    try:
        with pytest.raises(error) as info:
            open_reader(path).close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_LIMIT + os.path.getsize(path), f"{what}: opening allocated {peak} bytes"
    restored, detail = Restorer(expected).outcome(path)
    assert restored == "unchanged", f"{what}: restore {restored} ({detail})"
    return str(info.value)


# --- ckpt msgpack ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def msgpack_base(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hostile") / "base.msgpack")
    return write_checkpoint(path, small_tensors())


def msgpack_cases(raw: bytes) -> dict[str, bytes]:
    """name -> hostile index bytes (the footer is rebuilt around them with a valid checksum)."""
    index_offset, index = msgpack_split(raw)
    tensors = index["tensors"]
    kernel = tensors["dense/kernel"]
    (offset, n), = kernel[2]

    def with_entry(key: str, entry: object) -> bytes:
        return packb({**index, "tensors": {**tensors, key: entry}})

    def with_metadata_raw(raw_value: bytes) -> bytes:
        return splice(packb({**index, "metadata": {"x": PLACE}}), PLACE, raw_value)

    cases = {
        "shape whose element count overflows int64": with_entry("dense/kernel", [kernel[0], [2 ** 62, 2 ** 62], kernel[2], kernel[3]]),
        "shape claiming 4 TiB with a matching size": with_entry("dense/kernel", [kernel[0], [2 ** 40], [[offset, 2 ** 42]], kernel[3]]),
        "rank 10000 shape": with_entry("dense/kernel", [kernel[0], [1] * 10000, kernel[2], kernel[3]]),
        "negative offset": with_entry("dense/kernel", [kernel[0], kernel[1], [[-1, n]], kernel[3]]),
        "negative size": with_entry("dense/kernel", [kernel[0], kernel[1], [[offset, -n]], kernel[3]]),
        "offset far beyond the file": with_entry("dense/kernel", [kernel[0], kernel[1], [[2 ** 63, n]], kernel[3]]),
        "data reaching into the index": with_entry("dense/kernel", [kernel[0], kernel[1], [[index_offset - n + 4, n]], kernel[3]]),
        "two tensors sharing their bytes": with_entry("dense/kernel2", kernel),
        "4 billion extents claimed": with_entry("dense/kernel", [kernel[0], kernel[1], "EXTENTS", kernel[3]]).replace(
            packb("EXTENTS"), b"\xdd\xff\xff\xff\xff" + packb([offset, n])),
        "array claiming 2**32-1 items": with_metadata_raw(b"\xdd\xff\xff\xff\xff\xc0"),
        "map claiming 2**32-1 entries": with_metadata_raw(b"\xdf\xff\xff\xff\xff\xc0\xc0"),
        "str claiming 2**32-1 bytes": with_metadata_raw(b"\xdb\xff\xff\xff\xffabc"),
        "bin claiming 2**32-1 bytes": with_metadata_raw(b"\xc6\xff\xff\xff\xffabc"),
        "ext claiming 2**32-1 bytes": with_metadata_raw(b"\xc9\xff\xff\xff\xff\x05abc"),
        "arrays nested 100000 deep": with_metadata_raw(b"\x91" * 100_000 + b"\xc0"),
        "maps nested 50000 deep": with_metadata_raw(b"\x81\xa1k" * 50_000 + b"\xc0"),
        "ext type 5 in the metadata": with_metadata_raw(b"\xd4\x05\x00"),
        "ext type as a dtype": with_entry("dense/kernel", [PLACE, kernel[1], kernel[2], kernel[3]]).replace(
            packb(PLACE), b"\xd5\x07ab"),
        "duplicate tensor key": splice(packb({**index, "tensors": PLACE}), PLACE,
                                       b"\x82" + packb("dense/bias") + packb(tensors["dense/bias"]) * 0 +
                                       packb(tensors["dense/bias"]) + packb("dense/bias") + packb(tensors["dense/bias"])),
        "duplicate index field": b"\x85" + packb("format") + packb("ckpt-msgpack") + packb("format") +
                                 packb("ckpt-msgpack") + packb("version") + packb(1) + packb("metadata") + packb({}) +
                                 packb("tensors") + packb(tensors),
        "duplicate metadata key": with_metadata_raw(b"\xc0").replace(b"\x81\xa1x\xc0", b"\x82\xa1x\xc0\xa1x\xc0"),
        "non-UTF-8 key": splice(with_entry(PLACE, tensors["dense/bias"]), PLACE, b"\xa3\xff\xfe\xfd"),
        "key as bytes": splice(with_entry(PLACE, tensors["dense/bias"]), PLACE, b"\xc4\x03abc"),
        "key as an integer": splice(with_entry(PLACE, tensors["dense/bias"]), PLACE, b"\x07"),
        "dtype 'object' (numpy would unpickle it)": with_entry("dense/kernel", ["object", kernel[1], kernel[2], kernel[3]]),
        "bytes after the index": packb(index) + b"\xc0",
    }
    for key in ("..", "../escape", "a/../b", "/absolute", "nul\x00byte", "", "a/./b", "trail/", "a//b"):
        cases[f"key {key!r}"] = with_entry(key, tensors["dense/bias"])
    return cases


def test_hostile_msgpack_indexes_are_refused_on_open(tmp_path, msgpack_base):
    cases = msgpack_cases(msgpack_base)
    path = str(tmp_path / "hostile.msgpack")
    messages = {}
    for name, index in cases.items():
        with open(path, "wb") as f:
            f.write(msgpack_rebuild(msgpack_base, index))
        messages[name] = assert_refused_on_open(path, small_tensors(), name)
        assert path in messages[name], f"{name}: the message does not name the file: {messages[name]}"
    assert len(cases) >= 35
    # the messages say what is wrong, naming the tensor where there is one
    assert "dense/kernel" in messages["negative offset"] and "dense/kernel" in messages["rank 10000 shape"]
    assert "overlap" in messages["two tensors sharing their bytes"]
    assert "duplicate" in messages["duplicate tensor key"] and "'..'" in messages["key '..'"]


# --- ckpt HDF5 -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hdf5_base(tmp_path_factory):
    """A ckpt HDF5 file whose user block has room for a 250 KB crafted index."""
    path = str(tmp_path_factory.mktemp("hostile") / "base.h5")
    return write_checkpoint(path, small_tensors(), metadata={"pad": "x" * 250_000})


def hdf5_cases(raw: bytes) -> dict[str, bytes]:
    _head, index = hdf5_split(raw)
    entries = index["tensors"]
    k = next(i for i, e in enumerate(entries) if e[0] == "dense/kernel")
    kernel = entries[k]
    size = len(raw)

    def with_entry(entry: object, at: int = k) -> bytes:
        new = list(entries)
        new[at] = entry
        return packb({**index, "tensors": new})

    def with_metadata_raw(raw_value: bytes) -> bytes:
        return splice(packb({**index, "metadata": {"x": PLACE}}), PLACE, raw_value)

    def entry(**changes: object) -> list:
        fields = dict(zip(["key", "dtype", "shape", "offset", "nbytes", "crc"], kernel))
        fields.update(changes)
        return list(fields.values())

    cases = {
        "shape whose element count overflows int64": with_entry(entry(shape=[2 ** 62, 2 ** 62])),
        "shape claiming 4 TiB with a matching size": with_entry(entry(shape=[2 ** 40], nbytes=2 ** 42)),
        "rank 10000 shape": with_entry(entry(shape=[1] * 10000)),
        "negative offset": with_entry(entry(offset=-1)),
        "negative size": with_entry(entry(nbytes=-48)),
        "offset far beyond the file": with_entry(entry(offset=2 ** 63)),
        "data inside the user block": with_entry(entry(offset=64)),
        "data reaching past the end": with_entry(entry(offset=size - 8)),
        "two tensors sharing their bytes": packb({**index, "tensors": entries + [entry(key="dense/kernel2")]}),
        "tensor list claiming 2**32-1 entries": splice(packb({**index, "tensors": PLACE}), PLACE,
                                                       b"\xdd\xff\xff\xff\xff" + packb(kernel)),
        "array claiming 2**32-1 items": with_metadata_raw(b"\xdd\xff\xff\xff\xff\xc0"),
        "map claiming 2**32-1 entries": with_metadata_raw(b"\xdf\xff\xff\xff\xff\xc0\xc0"),
        "str claiming 2**32-1 bytes": with_metadata_raw(b"\xdb\xff\xff\xff\xffabc"),
        "arrays nested 100000 deep": with_metadata_raw(b"\x91" * 100_000 + b"\xc0"),
        "maps nested 50000 deep": with_metadata_raw(b"\x81\xa1k" * 50_000 + b"\xc0"),
        "ext type 5 in the metadata": with_metadata_raw(b"\xd4\x05\x00"),
        "duplicate tensor key": packb({**index, "tensors": entries + [kernel]}),
        "duplicate index field": splice(packb({**index, "version": PLACE}), PLACE, packb(1) + packb("version") + packb(1))
        .replace(b"\x86", b"\x87", 1),
        "non-UTF-8 key": splice(with_entry(entry(key=PLACE)), PLACE, b"\xa3\xff\xfe\xfd"),
        "key as bytes": splice(with_entry(entry(key=PLACE)), PLACE, b"\xc4\x03abc"),
        "dtype 'object' (numpy would unpickle it)": with_entry(entry(dtype="object")),
        "string width 2**40": with_entry(next(e for e in entries if e[0] == "vocab")[:6] + [2 ** 40, None],
                                         at=next(i for i, e in enumerate(entries) if e[0] == "vocab")),
        "bytes after the index": packb(index) + b"\xc0",
    }
    for key in ("..", "../escape", "a/../b", "/absolute", "nul\x00byte", "", "a/./b", "trail/", "a//b"):
        cases[f"key {key!r}"] = with_entry(entry(key=key))
    return cases


def test_hostile_hdf5_indexes_are_refused_on_open(tmp_path, hdf5_base):
    head, index = hdf5_split(hdf5_base)
    assert index["format"] == "ckpt-hdf5" and head[2] >= 256 * 1024
    cases = hdf5_cases(hdf5_base)
    path = str(tmp_path / "hostile.h5")
    messages = {}
    for name, index_bytes in cases.items():
        with open(path, "wb") as f:
            f.write(hdf5_rebuild(hdf5_base, index_bytes))
        messages[name] = assert_refused_on_open(path, small_tensors(), name)
        assert path in messages[name], f"{name}: the message does not name the file: {messages[name]}"
    assert len(cases) >= 30
    assert "dense/kernel" in messages["negative offset"] and "overlap" in messages["two tensors sharing their bytes"]


def test_hostile_hdf5_headers_are_refused_on_open(tmp_path, hdf5_base):
    head, index = hdf5_split(hdf5_base)
    index_bytes = packb(index)
    path = str(tmp_path / "hostile.h5")
    for name, fields in {"user block larger than the file": {"userblock": 2 ** 31},
                         "user block of 3 bytes": {"userblock": 3},
                         "index of 2**64-1 bytes": {"index_len": 2 ** 64 - 1},
                         "index longer than the user block": {"index_len": head[2]},
                         "format version 2**32-1": {"version": 2 ** 32 - 1}}.items():
        with open(path, "wb") as f:
            f.write(hdf5_rebuild(hdf5_base, index_bytes, **fields))
        assert_refused_on_open(path, small_tensors(), name)


def test_ckpt_hdf5_file_given_an_external_link_afterwards_never_follows_it(tmp_path):
    """A ckpt file modified with h5py (an external link to /etc/passwd added): ckpt never follows
    it (the file, grown by libhdf5, is read through h5py, which refuses external links)."""
    path = str(tmp_path / "model.h5")
    write_checkpoint(path, small_tensors())
    with h5py.File(path, "r+") as f:
        f["dense/evil"] = h5py.ExternalLink("/etc/passwd", "/")
    kind, detail = read_outcome(path, small_tensors())
    assert kind in ("open-error", "verify-error"), (kind, detail)
    # refused as an external link, as changed, or the key is simply not there
    with pytest.raises((ckpt.KeyNotFoundError, ckpt.CorruptCheckpointError, ckpt.UnsupportedCheckpointError)):
        ckpt.load_variable(path, "dense/evil")


# --- HDF5 files without ckpt's index (read through libhdf5) --------------------------------------
def foreign(tmp_path, build) -> str:
    path = str(tmp_path / "foreign.h5")
    with h5py.File(path, "w") as f:
        build(f)
    return path


@pytest.mark.parametrize("kind, match", [
    ("external link", "external link"), ("soft link", "soft link"),
    ("external storage", "external files"), ("virtual dataset", "virtual dataset")])
def test_foreign_hdf5_links_external_storage_and_virtual_datasets_are_refused(tmp_path, kind, match):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    with h5py.File(tmp_path / "target.h5", "w") as f:
        f["x"] = np.arange(3)

    def build(f):
        if kind == "external link":
            f["a"] = h5py.ExternalLink(str(tmp_path / "target.h5"), "x")
        elif kind == "soft link":
            f["x"] = np.arange(3)
            f["a"] = h5py.SoftLink("/x")
        elif kind == "external storage":
            f.create_dataset("a", shape=(4,), dtype="f4", external=[(str(secret), 0, 16)])
        else:
            layout = h5py.VirtualLayout(shape=(3,), dtype="i8")
            layout[:] = h5py.VirtualSource(str(tmp_path / "target.h5"), "x", shape=(3,))
            f.create_virtual_dataset("a", layout)

    path = foreign(tmp_path, build)
    with pytest.raises(ckpt.UnsupportedCheckpointError, match=match) as info:
        open_reader(path)
    assert path in str(info.value) and "'a'" in str(info.value)


def test_foreign_hdf5_dataset_claiming_terabytes_is_refused_before_allocating(tmp_path):
    path = foreign(tmp_path, lambda f: f.create_dataset("huge", shape=(2 ** 40,), dtype="f4", chunks=(1024,)))
    with pytest.raises(ckpt.CorruptCheckpointError, match="huge"):
        open_reader(path)


def run_limited(code: str, limit: int = 3 << 30) -> dict:
    """Run ``code`` in a child whose address space is capped (an unchecked allocation fails
    there, instead of taking this machine's memory); it prints one JSON line."""
    prelude = textwrap.dedent(f"""
        import json, resource, sys
        resource.setrlimit(resource.RLIMIT_AS, ({limit}, resource.RLIM_INFINITY))
        sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})
        import ckpt
        from ckpt.formats.base import open_reader
        def outcome(path):
            try:
                with open_reader(path) as reader:
                    for key in reader.tensors:
                        reader.read(key)
                return "read"
            except ckpt.CheckpointError as exc:
                return "CheckpointError"
            except BaseException as exc:
                return type(exc).__name__
    """)
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"), cwd=OUTSIDE_CHECKOUT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- gaps the suite found in the format modules (fixed; these keep them fixed) ----------------------
@pytest.mark.parametrize("fmt", ["hdf5", "msgpack"])
def test_msgpack_timestamp_extension_in_the_index_is_refused(tmp_path, fmt, msgpack_base, hdf5_base):
    timestamp = b"\xd6\xff\x00\x00\x00\x01"
    if fmt == "msgpack":
        _, index = msgpack_split(msgpack_base)
        data = msgpack_rebuild(msgpack_base, splice(packb({**index, "metadata": {"t": PLACE}}), PLACE, timestamp))
    else:
        _, index = hdf5_split(hdf5_base)
        data = hdf5_rebuild(hdf5_base, splice(packb({**index, "metadata": {"t": PLACE}}), PLACE, timestamp))
    path = tmp_path / f"ts.{fmt}"
    path.write_bytes(data)
    assert_refused_on_open(str(path), small_tensors(), "timestamp ext")


@pytest.mark.parametrize("fmt", ["hdf5", "msgpack"])
def test_empty_tensor_with_a_huge_dimension_is_refused(tmp_path, fmt, msgpack_base, hdf5_base):
    if fmt == "msgpack":
        _, index = msgpack_split(msgpack_base)
        entry = index["tensors"]["empty"]
        data = msgpack_rebuild(msgpack_base, packb({**index, "tensors": {
            **index["tensors"], "empty": [entry[0], [0, 2 ** 62], entry[2], entry[3]]}}))
    else:
        _, index = hdf5_split(hdf5_base)
        entries = [e if e[0] != "empty" else e[:2] + [[0, 2 ** 62]] + e[3:] for e in index["tensors"]]
        data = hdf5_rebuild(hdf5_base, packb({**index, "tensors": entries}))
    path = tmp_path / f"empty.{fmt}"
    path.write_bytes(data)
    assert run_limited(f"print(json.dumps(outcome({str(path)!r})))") == "CheckpointError"


def test_msgpack_string_tensor_claiming_a_trillion_items_is_refused(tmp_path, msgpack_base):
    _, index = msgpack_split(msgpack_base)
    entry = index["tensors"]["vocab"]
    data = msgpack_rebuild(msgpack_base, packb({**index, "tensors": {
        **index["tensors"], "vocab": [entry[0], [2 ** 40], entry[2], entry[3]]}}))
    path = tmp_path / "strings.msgpack"
    path.write_bytes(data)
    assert run_limited(f"print(json.dumps(outcome({str(path)!r})))") == "CheckpointError"


def test_foreign_hdf5_string_dataset_claiming_100_gib_is_refused(tmp_path):
    path = foreign(tmp_path, lambda f: f.create_dataset("hs", shape=(2 ** 30,), dtype="S100", chunks=(1024,)))
    assert run_limited(f"print(json.dumps(outcome({path!r})))") == "CheckpointError"


def test_foreign_hdf5_key_with_dotdot_is_refused(tmp_path):
    path = foreign(tmp_path, lambda f: f.create_dataset("a/..", data=1))
    with pytest.raises(ckpt.CheckpointError, match=r"\.\."):
        open_reader(path).close()


def test_foreign_hdf5_non_utf8_name_is_a_checkpoint_error(tmp_path):
    path = foreign(tmp_path, lambda f: f.create_dataset(b"\xff\xfe", data=1))
    with pytest.raises(ckpt.CheckpointError):
        open_reader(path).close()


def test_foreign_hdf5_bad_ckpt_version_attribute_is_a_checkpoint_error(tmp_path):
    def build(f):
        f.attrs["ckpt_version"] = "x"
        f["a"] = 1

    with pytest.raises(ckpt.CheckpointError):
        open_reader(foreign(tmp_path, build)).close()


@pytest.mark.parametrize("kind", ["object reference", "variable-length ints", "compound", "opaque", "float128"])
def test_foreign_hdf5_unsupported_datatypes_are_refused(tmp_path, kind):
    def build(f):
        if kind == "object reference":
            f["x"] = np.arange(3)
            f.create_dataset("a", data=np.array([f["x"].ref], dtype=h5py.ref_dtype))
        elif kind == "variable-length ints":
            f.create_dataset("a", data=np.array([np.arange(2, dtype="i4"), np.arange(3, dtype="i4")], dtype=object),
                             dtype=h5py.vlen_dtype("i4"))
        elif kind == "compound":
            f.create_dataset("a", data=np.zeros(3, dtype=[("x", "f4"), ("y", "i4")]))
        elif kind == "opaque":
            f.create_dataset("a", data=np.void(b"\x80\x04K\x01."))
        else:
            f.create_dataset("a", data=np.arange(3, dtype=np.longdouble))

    with pytest.raises(ckpt.UnsupportedCheckpointError, match="'a'"):
        open_reader(foreign(tmp_path, build)).close()


# --- torch: a pickle that calls a function -----------------------------------------------------------
def test_torch_file_whose_pickle_calls_a_function_is_refused_without_calling_it(tmp_path):
    marker = tmp_path / "executed"
    # protocol 2: GLOBAL builtins.exec, then REDUCE with a code string creating the marker
    code = f"open({str(marker)!r}, 'w').close()".encode()
    payload = (b"\x80\x02cbuiltins\nexec\nq\x00X" + len(code).to_bytes(4, "little") + code +
               b"q\x01\x85q\x02Rq\x03.")
    path = tmp_path / "evil.pt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", payload)
        z.writestr("archive/version", "3\n")
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="exec"):
        open_reader(str(path)).close()
    assert not marker.exists()
