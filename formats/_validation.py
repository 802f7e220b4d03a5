"""What goes into and comes out of a checkpoint must follow ckpt's rules: keys, shapes, dtypes,
format versions, metadata; readers check what they parse, writers what they are handed.

Example:
    >>> from ckpt.formats import _validation
    >>> _validation.key_problem("a//b")
    "empty, '.' or '..' part (keys are '/'-separated names)"
    >>> _validation.normalize_metadata({"step": 7}, "m.h5")
    {'step': 7}
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from ckpt import dtypes
from ckpt.errors import CorruptCheckpointError, InvalidMetadataError, UnsupportedCheckpointError



class _Shaped(Protocol):
    """What ``check_tensors`` reads of a reader's TensorInfo (``_readers`` imports this module)."""

    @property
    def shape(self) -> tuple[int, ...]: ...


def validate_keys(keys: Iterable[str], where: str = "checkpoint") -> None:
    """Raise ValueError unless every key follows ckpt's key rules.

    Keys are "/"-separated, with no empty, "." or ".." parts, no NUL, valid UTF-8 and unique.
    A key may also be a scope of another ("dense/kernel" and "dense/kernel/Adam", as TF1 names
    slots): flat formats store keys as they are, HDF5 as docs/formats.md describes.
    """
    keys = list(keys)
    seen: set[str] = set(keys) if keys_plainly_valid(keys) else set()  # all at once, or one by one
    if len(seen) != len(keys):
        seen = set()
        for key in keys:
            problem = key_problem(key)
            if problem:
                raise ValueError(f"{where}: invalid key {key!r}: {problem}")
            if key in seen:
                raise ValueError(f"{where}: duplicate key {key!r}")
            seen.add(key)


def tensor_scopes(keys: Iterable[str]) -> set[str]:
    """The keys that are also a scope of another key ("a" of "a/b"): TF1 names optimizer slots and
    EMA shadows so ("dense/kernel" beside "dense/kernel/Adam"). HDF5 stores those specially."""
    unique = set(keys)
    scopes: set[str] = set()
    for key in unique:
        scope = key.rpartition("/")[0]
        while scope and scope not in scopes:  # siblings share their scopes: stop at a known one
            scopes.add(scope)
            scope = scope.rpartition("/")[0]
    return unique & scopes


def key_problem(key: object) -> str:
    """Return why ``key`` breaks the key rules, or "" when it is valid."""
    if type(key) is not str:
        return f"keys are strings, got {type(key).__name__}"
    if not key:
        return "empty key"
    if "\x00" in key:
        return "contains NUL"
    wrapped = f"/{key}/"
    if "//" in wrapped or "/./" in wrapped or "/../" in wrapped:
        return "empty, '.' or '..' part (keys are '/'-separated names)"
    if not key.isascii():
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            return "not valid UTF-8"
    return ""


def keys_plainly_valid(keys: Sequence[Any]) -> bool:
    """True when every key is a valid key (``key_problem``), checked on all of them at once.

    One pass of C string searches over the joined keys instead of a Python call per key (an
    index can hold 10,000s). False says only "look closer": the caller then checks key by key
    with ``key_problem``, which names the problem. Duplicates are not looked for.
    """
    try:
        joined = "\x00".join(keys)  # TypeError for a key that is not a str
    except TypeError:
        return False
    if joined.count("\x00") != len(keys) - 1:  # a NUL inside a key
        return False
    wrapped = "/" + joined.replace("\x00", "/\x00/") + "/"  # "/key/" each: empty, "." and ".." parts show
    if "//" in wrapped or "/./" in wrapped or "/../" in wrapped:
        return False
    if not wrapped.isascii():
        try:
            wrapped.encode("utf-8")
        except UnicodeEncodeError:
            return False
    return True


def all_lists(values: Iterable[Any], length: int | None = None) -> bool:
    """True when every value is a list (of ``length`` items, if given): one C pass each, for
    index checks over 10,000s of entries. Also True for no values."""
    values = values if isinstance(values, (list, tuple)) else list(values)
    return set(map(type, values)) <= {list} and (length is None or set(map(len, values)) <= {length})


def all_exactly(values: Iterable[Any], kind: type) -> bool:
    """True when every value's type is exactly ``kind`` (no subclass: bool is not an int)."""
    return set(map(type, values)) <= {kind}


_ITEMSIZE = operator.attrgetter("itemsize")


def plain_extents(shapes: Sequence[Any], offsets: Sequence[Any], sizes: Sequence[Any], crcs: Sequence[Any],
                  found: Sequence[np.dtype], start: int, end: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The offsets and the ends of tensors' bytes as int64 columns, when every entry of an index
    is plain: a shape list of at most 64 positive ints and at most MAX_ELEMENTS elements, a
    numeric dtype, a uint32 checksum, and bytes that fit its shape and lie in file order within
    ``[start, end)``; else None. Checked on all entries at once (numpy over whole columns), for
    the index fast paths of ckpt's own formats: None only says "look closer", entry by entry.
    """
    if not all_lists(shapes) or max(map(len, shapes)) > 64:
        return None
    dims = list(itertools.chain.from_iterable(shapes))
    columns = (offsets, sizes, crcs, dims)
    if not all_exactly(itertools.chain(*columns), int):
        return None
    try:
        offset, n, crc, dim = (np.array(c, dtype=np.int64) for c in columns)
    except OverflowError:  # beyond 64 bits: the loop says which
        return None
    if len(dim) and (dim.min() < 1 or dim.max() > MAX_ELEMENTS):  # zero dimensions: the loop
        return None
    counts = list(map(math.prod, shapes))  # exact: Python ints
    if max(counts) > MAX_ELEMENTS or any(d.kind == "O" for d in set(found)):  # a few distinct dtypes
        return None
    ends = offset + n
    if offset[0] < start or n.min() < 0 or ends.max() > end or (ends[:-1] > offset[1:]).any() or \
            crc.min() < 0 or crc.max() >= 2 ** 32 or \
            not np.array_equal(np.array(counts, dtype=np.int64) * list(map(_ITEMSIZE, found)), n):
        return None
    return offset, ends


def unique_pairs(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """A decoder's map from its (key, value) pairs; ValueError for a key given twice.

    For ``object_pairs_hook`` (json, msgpack): a plain dict would keep the last value silently.
    """
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[Any] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"duplicate key {dup!r}")
    return out


def check_version(version: Any, supported: int, what: str, path: str) -> None:
    """Refuse a format version that is not a positive int, or newer than ``supported``."""
    if type(version) is not int or version < 1:
        raise CorruptCheckpointError(f"{path}: invalid format version {version!r}")
    if version > supported:
        raise UnsupportedCheckpointError(
            f"{path}: written by a newer ckpt ({what} format version {version}; this version of ckpt "
            f"reads up to {supported}): upgrade ckpt to read it")


_FILE_DTYPES = {name: dtypes.as_dtype(name) for name in dtypes.NAMES}


def dtype_or_raise(name: Any, path: str, key: str) -> np.dtype:
    """Resolve a canonical dtype name read from a file, or raise CorruptCheckpointError."""
    dtype = _FILE_DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        raise CorruptCheckpointError(f"{path}: tensor {key!r} has unknown dtype {name!r}")
    return dtype


def index_entry(key: Any, entry: Any, path: str) -> tuple[np.dtype, tuple[int, ...], Any, Any]:
    """Check the parts every msgpack-index entry ``[dtype name, shape, x, y]`` shares (the key, the
    entry's form, its dtype and shape) and return ``(dtype, shape, x, y)``; ``x`` and ``y`` are the
    format's own (extents and crc32c, or crc32c and chunks), checked by its reader."""
    problem = key_problem(key)
    if problem:
        raise CorruptCheckpointError(f"{path}: invalid tensor key {key!r} in the index: {problem}")
    if type(entry) is not list or len(entry) != 4:
        raise CorruptCheckpointError(f"{path}: tensor {key!r}: malformed index entry")
    name, shape, x, y = entry
    return dtype_or_raise(name, path, key), check_shape(shape, path, key), x, y


#: The most elements a shape may describe, zero dimensions aside (numpy refuses larger arrays
#: even when they are empty, and no file holds that many).
MAX_ELEMENTS = 2 ** 48


def check_shape(shape: Any, path: str, key: str) -> tuple[int, ...]:
    """Validate a shape read from a file: a list (or tuple) of non-negative ints of sane rank and
    size; the product of its non-zero dimensions is bounded too, since numpy cannot make even an
    empty array of shape [0, 2**62]."""
    if type(shape) not in (list, tuple) or len(shape) > 64:
        raise CorruptCheckpointError(f"{path}: tensor {key!r} has an invalid shape {shape!r}")
    count = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise CorruptCheckpointError(f"{path}: tensor {key!r} has an invalid shape {shape!r}")
        count *= max(d, 1)
        if count > MAX_ELEMENTS:
            raise CorruptCheckpointError(f"{path}: tensor {key!r} declares shape {shape!r}, more elements "
                                         f"than any checkpoint holds (at most {MAX_ELEMENTS})")
    return tuple(shape)


def check_tensors(tensors: Mapping[str, _Shaped], path: str) -> None:
    """Every tensor a reader lists must have a shape numpy can hold (``check_shape``).

    Called for every reader once its index is read (FileReader does it itself), so a format's
    own parsing may miss a bound without a raw numpy error reaching the user later.
    """
    for key, info in tensors.items():
        check_shape(info.shape, path, key)


def check_metadata(metadata: Any, path: str) -> dict[str, Any]:
    """Metadata read from a file must be plain JSON-like data (what ckpt writes), or it is corrupt."""
    try:
        return normalize_metadata(metadata, path)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{path}: the metadata is not what ckpt writes: {exc}") from None


def normalize_metadata(metadata: Mapping[str, Any] | None, path: str) -> dict[str, Any]:
    """Return ``metadata`` as plain JSON-like data both formats store, or raise InvalidMetadataError
    (a ValueError) naming ``path`` and the key.

    Keys are strings; values are None, bool, int (64-bit), float, str, lists and maps of
    these. numpy scalars and arrays are converted with ``tolist()``.
    """

    def convert(value: Any, where: str, depth: int) -> Any:
        if depth > 32:
            raise InvalidMetadataError(f"{path}: metadata key {where!r} is nested more than 32 levels deep")
        if isinstance(value, (np.generic, np.ndarray)) and value.dtype.kind in "biufc":
            value = value.tolist()
        if value is None or isinstance(value, (bool, float, str)):
            return value
        if isinstance(value, int):
            if not -(2 ** 63) <= value < 2 ** 64:
                raise InvalidMetadataError(f"{path}: metadata key {where!r} = {value} does not fit in 64 bits")
            return value
        if isinstance(value, (list, tuple)):
            return [convert(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            out: dict[str, Any] = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    inside = f" (in {where!r})" if where else ""
                    raise InvalidMetadataError(f"{path}: metadata key {k!r}{inside} is a {type(k).__name__}; "
                                               "metadata keys must be strings")
                out[k] = convert(v, f"{where}.{k}" if where else k, depth + 1)
            return out
        raise InvalidMetadataError(f"{path}: metadata key {where!r} holds a {type(value).__name__}; ckpt "
                                   "stores None, bool, int, float, str, lists and dicts")

    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidMetadataError(f"{path}: metadata must be a dict, got {type(metadata).__name__}")
    normalized: dict[str, Any] = convert(metadata, "", 0)
    return normalized
