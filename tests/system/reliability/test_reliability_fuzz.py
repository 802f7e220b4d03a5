"""Fuzz targets (hypothesis) for each of ckpt's readers: the HDF5 index reader, the msgpack
reader, and the directory state file (JSON, and TensorFlow's text form).

Inputs are mutations of valid files. Mutations of an index are followed by fixing its
checksums up, so the fuzzer exercises the parsing and validation behind the checksums, not
just the checksums. The property: opening either raises a CheckpointError or gives a reader
whose every tensor either reads as its declared dtype and shape or raises a CheckpointError,
and whose verify() returns a list; nothing else, and no tensor claims more bytes than the
file holds. The HDF5 target calls ckpt's own index reader, which never hands bytes to libhdf5.

Runs briefly in the suite; for a long run: ``pytest tests/system/reliability/test_reliability_fuzz.py
--reliability-scale 200`` (derandomized: the same inputs every time; set CKPT_FUZZ_RANDOM=1
for fresh random inputs on each run).
"""

from __future__ import annotations

import collections
import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_support import (
    hdf5_rebuild,
    hdf5_split,
    msgpack_rebuild,
    msgpack_split,
    overwrite,
    packb,
    small_tensors,
    time_limit,
    write_checkpoint,
)

import ckpt
from ckpt.formats import _io
from ckpt.formats.base import key_problem
from ckpt.formats.hdf5 import Hdf5Reader
from ckpt.formats.msgpack import MsgpackReader
from ckpt.saving.locations import latest_checkpoint
from ckpt.storage.state import STATE_FILE, read_state

EXAMPLES = 1000  # per target, x --reliability-scale


def fuzz_settings(scale: int):
    return settings(max_examples=EXAMPLES * scale, deadline=None, database=None,
                    derandomize=os.environ.get("CKPT_FUZZ_RANDOM") != "1",
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    """Valid files to mutate: {format: bytes}; the HDF5 one has user-block room to grow its index."""
    directory = tmp_path_factory.mktemp("fuzz-seeds")
    return {"hdf5": write_checkpoint(str(directory / "seed.h5"), small_tensors(), {"pad": "x" * 1500}),
            "msgpack": write_checkpoint(str(directory / "seed.msgpack"), small_tensors(), {"note": "seed"})}


@st.composite
def mutated(draw, data: bytes, start: int = 0, end: int | None = None) -> bytes:
    """1-4 byte-level mutations of data[start:end] (flip, set, insert, delete, duplicate, cut)."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        stop = len(out) if end is None else min(end + len(out) - len(data), len(out))
        if stop <= start:
            break
        pos = draw(st.integers(start, stop - 1))
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "duplicate", "cut"]))
        if op == "flip":
            out[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":  # interesting msgpack markers and boundary bytes
            out[pos] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xC4, 0xCC, 0xCF, 0xD3, 0xD9, 0xDB,
                                             0xDC, 0xDD, 0xDE, 0xDF, 0xD4, 0xC7, 0xFF, 0x90, 0x80, 0xA0]))
        elif op == "insert":
            out[pos:pos] = draw(st.binary(min_size=1, max_size=9))
        elif op == "delete":
            del out[pos:pos + draw(st.integers(1, 9))]
        elif op == "duplicate":
            n = draw(st.integers(1, 16))
            out[pos:pos] = out[pos:pos + n]
        else:
            del out[pos:]
    return bytes(out)


FIELD_VALUES = st.one_of(
    st.sampled_from([0, 1, -1, 7, 8, 48, 255, 256, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 62, 2 ** 63 - 1, 2 ** 64 - 1,
                     -(2 ** 63), "", "float32", "string", "bfloat16", "..", "a/b", None, True, [], {}, [0], [2 ** 40]]),
    st.integers(-(2 ** 63), 2 ** 64 - 1), st.text(max_size=6), st.binary(max_size=6), st.floats(),
    st.lists(st.integers(-2, 2 ** 40), max_size=4))


@st.composite
def edited_object(draw, obj: object) -> object:
    """``obj`` (a decoded index) with 1-3 values anywhere in it replaced, or removed, or duplicated."""
    import copy

    obj = copy.deepcopy(obj)
    for _ in range(draw(st.integers(1, 3))):
        paths: list[tuple] = []

        def walk(node: object, path: tuple, paths: list[tuple] = paths) -> None:
            paths.append(path)
            if isinstance(node, dict):
                for k, v in node.items():
                    walk(v, path + (k,))
            elif isinstance(node, list):
                for i, v in enumerate(node):
                    walk(v, path + (i,))

        walk(obj, ())
        path = draw(st.sampled_from(paths[1:]))
        parent = obj
        for step in path[:-1]:
            parent = parent[step]
        action = draw(st.sampled_from(["replace", "replace", "remove", "duplicate"]))
        if action == "replace":
            parent[path[-1]] = draw(FIELD_VALUES)
        elif action == "remove":
            del parent[path[-1]]
        elif isinstance(parent, list):
            parent.append(copy.deepcopy(parent[path[-1]]))
        else:
            parent[f"{path[-1]}2" if isinstance(path[-1], str) else "x"] = copy.deepcopy(parent[path[-1]])
    return obj


@st.composite
def hdf5_inputs(draw, seed: bytes) -> bytes:
    head, decoded = hdf5_split(seed)
    index = seed[32:32 + head[3]]
    kind = draw(st.sampled_from(["index, checksums fixed", "index fields", "index fields", "anywhere",
                                 "header fields"]))
    if kind == "index fields":
        return hdf5_rebuild(seed, packb(draw(edited_object(decoded)))[:head[2] - 32])
    if kind == "anywhere":
        return draw(mutated(seed))
    if kind == "header fields":
        fields = draw(st.fixed_dictionaries({}, optional={
            "version": st.integers(0, 2 ** 32 - 1), "userblock": st.integers(0, 2 ** 32 - 1),
            "index_len": st.integers(0, 2 ** 64 - 1), "index_crc": st.integers(0, 2 ** 32 - 1)}))
        return hdf5_rebuild(seed, index, **fields)
    new_index = draw(mutated(index))[:head[2] - 32]  # what fits in the user block
    return hdf5_rebuild(seed, new_index)


@st.composite
def msgpack_inputs(draw, seed: bytes) -> bytes:
    index_offset, decoded = msgpack_split(seed)
    index = seed[index_offset:len(seed) - 34]
    kind = draw(st.sampled_from(["index, checksums fixed", "index fields", "index fields", "anywhere",
                                 "footer fields"]))
    if kind == "index fields":
        return msgpack_rebuild(seed, packb(draw(edited_object(decoded))))
    if kind == "anywhere":
        return draw(mutated(seed))
    if kind == "footer fields":
        fields = draw(st.fixed_dictionaries({}, optional={
            "offset": st.integers(0, 2 ** 64 - 1), "length": st.integers(0, 2 ** 64 - 1),
            "crc": st.integers(0, 2 ** 32 - 1)}))
        return msgpack_rebuild(seed, index, **fields)
    return msgpack_rebuild(seed, draw(mutated(index)))


def exercise(reader_type: type, path: str, outcomes: collections.Counter) -> str:
    """Open, read everything, verify; return the outcome. Anything but a CheckpointError fails."""
    size = os.path.getsize(path)
    try:
        reader = reader_type(path)
    except ckpt.CheckpointError:
        return "refused"
    with reader:
        assert isinstance(reader.metadata, dict)
        for key, info in reader.tensors.items():
            assert not key_problem(key), key
            # the memory a read allocates is bounded by the file (a string item takes at least a byte)
            if info.dtype.kind == "O":
                assert info.size <= size, (key, info)
            else:
                assert _io.expected_nbytes(info.dtype, info.shape) <= size, (key, info)
                assert _io.expected_nbytes(info.dtype, tuple(d for d in info.shape if d)) < 2 ** 62, (key, info)
            try:
                value = reader.read(key)
            except ckpt.CheckpointError:
                continue
            assert value.shape == info.shape and value.dtype == info.dtype, key
        problems = reader.verify()
        assert isinstance(problems, list) and all(isinstance(p, str) for p in problems)
    return "opened"


def run_target(strategy, reader_type: type, scale: int) -> collections.Counter:
    """Run one fuzz target; return how many inputs were refused and how many opened."""
    directory = tempfile.mkdtemp(prefix="ckpt-fuzz-")
    path = os.path.join(directory, "input")
    outcomes: collections.Counter = collections.Counter()

    @fuzz_settings(scale)
    @given(strategy)
    def target(data: bytes) -> None:
        overwrite(path, data)
        with time_limit(10, "fuzz input"):
            outcomes[exercise(reader_type, path, outcomes)] += 1

    try:
        target()
    finally:
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)
    print(f"\n{reader_type.__name__}: {sum(outcomes.values())} inputs, {dict(outcomes)}")
    assert outcomes["refused"] and outcomes["opened"]  # the inputs reach past the first checks
    return outcomes


def test_fuzz_hdf5_index_reader(seeds, reliability_scale):
    run_target(hdf5_inputs(seeds["hdf5"]), Hdf5Reader, reliability_scale)


def test_fuzz_msgpack_reader(seeds, reliability_scale):
    run_target(msgpack_inputs(seeds["msgpack"]), MsgpackReader, reliability_scale)


STATE_SEED = (b'{"format": "ckpt-state", "version": 1, "latest": "model-2.h5", "checkpoints": '
              b'[{"path": "model-1.h5", "time": 1763740000.5, "step": 1}, '
              b'{"path": "model-2.h5", "time": 1763740001.5, "step": 2}], "preserved": [], '
              b'"last_preserved_time": 1763740000.5, "deleting": ["model-0.h5"]}\n')
TF_SEED = (b'model_checkpoint_path: "model.ckpt-2"\nall_model_checkpoint_paths: "model.ckpt-1"\n'
           b'all_model_checkpoint_paths: "model.ckpt-2"\nall_model_checkpoint_timestamps: 1763740000.5\n'
           b'all_model_checkpoint_timestamps: 1763740001.5\n')


def test_fuzz_state_file_reader(tmp_path, reliability_scale):
    directory = str(tmp_path / "run")
    os.mkdir(directory)
    json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                               lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=3), max_leaves=8)
    import json

    structured = st.fixed_dictionaries(
        {"format": st.sampled_from(["ckpt-state", "other"]), "version": st.one_of(st.integers(-1, 3), json_values)},
        optional={"checkpoints": json_values | st.lists(st.fixed_dictionaries(
            {"path": st.text(max_size=12) | json_values, "time": st.floats() | json_values},
            optional={"step": st.integers() | json_values}), max_size=3),
            "preserved": json_values, "deleting": st.lists(st.text(max_size=8), max_size=2) | json_values,
            "last_preserved_time": json_values}).map(lambda d: json.dumps(d).encode())
    inputs = st.one_of(mutated(STATE_SEED), mutated(TF_SEED), structured)

    @fuzz_settings(reliability_scale)
    @given(inputs)
    def target(data: bytes) -> None:
        overwrite(os.path.join(directory, STATE_FILE), data)
        try:
            state = read_state(directory)
        except ckpt.CheckpointError:
            return
        for entry in state.all_entries():
            if state.written_by == "ckpt":  # names stay inside the directory
                assert entry.path and "/" not in entry.path and entry.path not in (".", "..")
        for name in state.deleting:
            assert name and "/" not in name and name not in (".", "..")
        latest = latest_checkpoint(directory)
        assert latest is None or os.path.exists(latest)
        outcomes["parsed"] += 1

    outcomes: collections.Counter = collections.Counter()
    target()
    assert outcomes["parsed"]
