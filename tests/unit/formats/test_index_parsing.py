"""The index parsers' all-at-once path (``_parse_plain_entries``) against their entry-by-entry
path (``_check_entries``): on any index, damaged or not, the fast path either declines (None)
or returns exactly what the entry-by-entry path returns without error."""

from __future__ import annotations

import copy
import gc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt import dtypes
from ckpt.errors import CorruptCheckpointError
from ckpt.formats import _codec, _mpindex, builtin, hdf5, msgpack
from ckpt.formats.base import key_problem, keys_plainly_valid

TENSORS = [("enc/w", np.arange(12, dtype=np.float32).reshape(3, 4)), ("enc/b", np.arange(4, dtype=np.int64)),
           ("step", np.array(7, dtype=np.int32)), ("dec/x", np.ones((2, 1, 3), dtype=np.float16)),
           ("flag", np.array([True, False])), ("big", np.zeros(300, dtype=np.uint8)),
           ("dec/f64", np.linspace(0, 1, 5)), ("c128", np.ones(2, dtype=np.complex128))]

#: Values swapped into an entry's fields: wrong types, out-of-range numbers, hostile keys and shapes.
ODD = [-1, 0, 1, 3, 255, 256, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 48, 2 ** 63, 2 ** 64, 2 ** 70, True, 1.5, None,
       "float32", "int64", "bogus", "bytes", "", "a//b", "a/", "/a", "a/./b", "..", "a\x00b", "x\udc80", "é/w",
       b"enc/w", [], [0], [3, 4], [2 ** 40, 2 ** 40], [-1], [True], [[1, 2]], [[0, 4]], [[10 ** 6, 4]], {}]


@pytest.fixture(scope="module")
def msgpack_index(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("index")
    path = str(tmp_path / "i.msgpack")
    builtin.MsgpackFormat().write(path, TENSORS, {})
    with msgpack.MsgpackReader(path) as reader:
        start, end = reader._start, reader._index_offset
    raw = (tmp_path / "i.msgpack").read_bytes()[end:-msgpack.FOOTER_SIZE]
    return _codec.unpack(raw, path, "the index")["tensors"], start, end


@pytest.fixture(scope="module")
def hdf5_index(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("index")
    path = str(tmp_path / "i.h5")
    builtin.Hdf5Format().write(path, TENSORS, {})
    data = (tmp_path / "i.h5").read_bytes()
    _, _, userblock, index_len, _, _ = hdf5._HEADER.unpack(data[:hdf5._HEADER.size])
    index = _codec.unpack(data[hdf5._HEADER.size:hdf5._HEADER.size + index_len], path, "the index")
    return index["tensors"], userblock, len(data)


def _outcome(fn, *args):
    try:
        return fn(*args)
    except CorruptCheckpointError:
        return "refused"


def _agree(fast, slow):
    assert fast is None or fast == slow, (fast, slow)


def _agree_msgpack(tensors, start, end):
    """msgpack's fast path agrees with the loop, entry by entry and built all at once (as_dict)."""
    slow = _outcome(_mpindex._check_entries, tensors, "f", start, end, {})
    fast = _mpindex._parse_plain_entries(tensors, start, end)
    assert fast is None or ({key: fast[0][key] for key in fast[0]}, fast[1]) == slow  # built key by key
    fresh = _mpindex._parse_plain_entries(tensors, start, end)  # nothing built yet: as_dict builds all
    assert fresh is None or (fresh[0].as_dict(), fresh[1]) == slow


def test_fast_paths_take_plain_indexes(msgpack_index, hdf5_index):
    tensors, start, end = msgpack_index
    fast = _mpindex._parse_plain_entries(tensors, start, end)
    assert fast is not None and fast[:2] == _mpindex._check_entries(tensors, "f", start, end, {})
    _agree_msgpack(tensors, start, end)
    entries, userblock, size = hdf5_index
    fast = hdf5._parse_plain_entries(entries, userblock, size)
    assert fast is not None and fast == hdf5._check_entries(entries, "f", userblock, size)


@pytest.mark.parametrize("name", [n for n in dtypes.NAMES if n != "string"])
def test_fast_paths_take_every_numeric_dtype(tmp_path, name):
    # np.dtype("float64") == None is True: a check for unknown names by == declined every float64 index
    tensors = [("a/x", np.zeros((2, 3), dtype=dtypes.as_dtype(name))), ("b", np.ones(4, dtype=np.float32))]
    builtin.MsgpackFormat().write(str(tmp_path / "m.msgpack"), tensors, {})
    with msgpack.MsgpackReader(str(tmp_path / "m.msgpack")) as reader:
        start, end = reader._start, reader._index_offset
    raw = (tmp_path / "m.msgpack").read_bytes()[end:-msgpack.FOOTER_SIZE]
    index = _codec.unpack(raw, "m", "the index")["tensors"]
    fast = _mpindex._parse_plain_entries(index, start, end)
    assert fast is not None and fast[:2] == _mpindex._check_entries(index, "f", start, end, {})
    assert fast[0]["a/x"].dtype == dtypes.as_dtype(name)
    builtin.Hdf5Format().write(str(tmp_path / "h.h5"), tensors, {})
    data = (tmp_path / "h.h5").read_bytes()
    _, _, userblock, index_len, _, _ = hdf5._HEADER.unpack(data[:hdf5._HEADER.size])
    entries = _codec.unpack(data[hdf5._HEADER.size:hdf5._HEADER.size + index_len], "h", "the index")["tensors"]
    fast_h5 = hdf5._parse_plain_entries(entries, userblock, len(data))
    assert fast_h5 is not None and fast_h5 == hdf5._check_entries(entries, "f", userblock, len(data))
    assert fast_h5[0]["a/x"].dtype == dtypes.as_dtype(name)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_msgpack_fast_path_agrees_with_the_entry_loop(msgpack_index, data):
    pristine, start, end = msgpack_index
    tensors = copy.deepcopy(pristine)
    keys = list(tensors)
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(keys))
        where = data.draw(st.sampled_from(["key", "dtype", "shape", "extents", "offset", "size", "crc", "entry"]))
        value = data.draw(st.sampled_from(ODD))
        entry = tensors[key]
        if where == "key" and (isinstance(value, (str, bytes))) and value not in tensors:
            tensors = {(value if k == key else k): v for k, v in tensors.items()}
            keys = list(tensors)
        elif where == "entry":
            tensors[key] = value
        elif type(entry) is list and len(entry) == 4:
            if where in ("offset", "size") and type(entry[2]) is list and entry[2] and type(entry[2][0]) is list \
                    and len(entry[2][0]) == 2:
                entry[2][0][where == "size"] = value
            else:
                entry[{"dtype": 0, "shape": 1, "extents": 2, "crc": 3}.get(where, 3)] = value
    _agree_msgpack(tensors, start, end)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_hdf5_fast_path_agrees_with_the_entry_loop(hdf5_index, data):
    pristine, userblock, size = hdf5_index
    entries = copy.deepcopy(pristine)
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(entries) - 1))
        field = data.draw(st.integers(-2, 5))  # -2: swap two entries, -1: replace the entry
        if field == -2:
            j = data.draw(st.integers(0, len(entries) - 1))
            entries[i], entries[j] = entries[j], entries[i]
        elif field == -1:
            entries[i] = data.draw(st.sampled_from(ODD))
        elif type(entries[i]) is list and len(entries[i]) == 6:
            entries[i][field] = data.draw(st.sampled_from(ODD + [pristine[(i + 1) % len(pristine)][0]]))  # a duplicate key
    _agree(hdf5._parse_plain_entries(entries, userblock, size),
           _outcome(hdf5._check_entries, entries, "f", userblock, size))


@pytest.mark.parametrize("keys", [["a"], ["a", "b/c"], ["é/w"], [""], ["a//b"], ["a/"], ["/a"], ["."], ["a/.."],
                                  ["a\x00"], ["ok", "x\udc80"], ["ok", 3], ["ok", b"ok2"], ["a/.b", "..c"]])
def test_keys_plainly_valid_agrees_with_key_problem(keys):
    assert keys_plainly_valid(keys) == all(key_problem(k) == "" for k in keys)


def test_msgpack_open_keeps_no_object_per_entry(tmp_path):
    # a lazy index: the GC walks every tracked object at each full pass, so 10,000s of TensorInfo
    # kept from opening cost every later collection of the program
    tensors = [(f"layer{i}/w", np.full(3, i, dtype=np.float32)) for i in range(2000)]
    path = str(tmp_path / "many.msgpack")
    builtin.MsgpackFormat().write(path, tensors, {})
    gc.collect()
    before = len(gc.get_objects())
    with msgpack.MsgpackReader(path) as reader:
        gc.collect()
        assert len(gc.get_objects()) - before < 100
        assert len(reader.tensors) == 2000 and list(reader.tensors)[:2] == ["layer0/w", "layer1/w"]
        assert "layer7/w" in reader.tensors and reader.tensors.get("nope") is None
        assert reader.info("layer7/w").shape == (3,) and reader.tensors["layer7/w"].nbytes == 12
        np.testing.assert_array_equal(reader.read("layer1999/w"), np.full(3, 1999, dtype=np.float32))
