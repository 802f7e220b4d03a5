"""Flax checkpoints written by ``flax.serialization.to_bytes`` (msgpack), read without jax.

The file is one msgpack object: nested maps (the state dict) whose leaves are msgpack
extension objects, plain numbers or strings:

* ext type 1 (ndarray) and 3 (numpy scalar): the payload is itself msgpack,
  ``[shape, dtype name, raw C-order bytes]``; dtype names are numpy's ("float32",
  "bfloat16", "float8_e4m3fn", ...);
* ext type 2 (Python complex): ``[real, imag]`` -> a complex128 scalar;
* a map ``{"__msgpack_chunked_array__": True, "shape": {"0": d0, ...}, "chunks": {"0": ext, ...}}``
  is one array Flax split into flat chunks (arrays over 1 GiB);
* plain ints, floats and bools become int64, float64 and bool scalars; strings and bytes
  become byte-string scalars; nil and empty maps hold nothing and are skipped.

Keys are the map keys joined with "/": ``{"params": {"Dense_0": {"kernel": ...}}}`` ->
"params/Dense_0/kernel". Opening walks the structure without reading tensor data (only
headers are read; every declared size is checked against the file size first), so tensors
are later read straight into the caller's buffer. Flax files carry no checksums.

Example:
    >>> import ckpt
    >>> ckpt.list_variables("flax_state.msgpack")  # doctest: +SKIP
    [('params/Dense_0/bias', [4]), ('params/Dense_0/kernel', [3, 4]), ...]
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckpt import dtypes
from ckpt.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckpt.storage import ReadableBlob

from . import _io
from ._foreign import NUMPY_DTYPES, check_key
from .base import FileReader, TensorInfo

_EXT_NDARRAY, _EXT_COMPLEX, _EXT_SCALAR = 1, 2, 3
_CHUNKED = "__msgpack_chunked_array__"
#: Deeper nesting than this is not a model's state dict.
_MAX_DEPTH = 100
_BUFFER = 1 << 16


@dataclass(frozen=True)
class _Leaf:
    dtype: np.dtype
    shape: tuple[int, ...]
    #: (offset, nbytes) pieces of raw data, in order (several for chunked arrays).
    extents: tuple[tuple[int, int], ...] = ()
    #: the value, for leaves stored as plain msgpack numbers (read at open: a few bytes).
    value: Any = None
    #: byte strings are read whole and stored as one bytes object
    is_bytes: bool = False


class _Cursor:
    """Sequential reads of msgpack headers through a small buffer; payloads are skipped."""

    def __init__(self, source: ReadableBlob, size: int, path: str) -> None:
        self.source, self.size, self.path = source, size, path
        self.pos = 0
        self._buf, self._buf_at = b"", 0

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > self.size:
            raise CorruptCheckpointError(f"{self.path}: {what} at offset {self.pos} needs {n} bytes but "
                                         f"the file ends at {self.size}: it is truncated or damaged")
        start = self.pos - self._buf_at
        if start < 0 or start + n > len(self._buf):
            want = max(n, min(_BUFFER, self.size - self.pos))
            self._buf, self._buf_at, start = _io.pread(self.source, self.pos, want, what), self.pos, 0
        self.pos += n
        return self._buf[start:start + n]

    def skip(self, n: int, what: str) -> int:
        """Skip ``n`` bytes (checked against the file size); return where they start."""
        if self.pos + n > self.size:
            raise CorruptCheckpointError(f"{self.path}: {what} at offset {self.pos} declares {n} bytes but "
                                         f"the file ends at {self.size}: it is truncated or damaged")
        start, self.pos = self.pos, self.pos + n
        return start

    def uint(self, n: int, what: str) -> int:
        return int.from_bytes(self.take(n, what), "big")


_Node = Any  # dict[str, _Node] (a map), a _Leaf, or None (nothing to read)


class _Parser:
    """Walks the msgpack structure: maps become dicts, leaves record where their data lies."""

    def __init__(self, cursor: _Cursor) -> None:
        self.cur = cursor

    def value(self, where: list[str], depth: int) -> _Node:
        cur, at = self.cur, "/".join(where) or "the top level"
        if depth > _MAX_DEPTH:
            raise CorruptCheckpointError(f"{cur.path}: {at} is nested more than {_MAX_DEPTH} levels deep")
        b = cur.take(1, at)[0]
        number = self._number(b, at)
        if number is not None:
            return number
        if b == 0xC0:
            return None
        if 0x80 <= b <= 0x8F or b in (0xDE, 0xDF):
            n = b & 0x0F if b <= 0x8F else cur.uint(2 if b == 0xDE else 4, at)
            return self._map(n, where, depth)
        count = self._array_len(b, at)
        if count is not None:  # Flax writes lists as maps {"0": ...}; plain arrays are read the same way
            self._check_count(count, 1, at)
            return {str(i): self.value(where + [str(i)], depth + 1) for i in range(count)}
        size = self._str_or_bin_len(b, at)
        if size is not None:
            return _Leaf(dtypes.string, (), ((cur.skip(size, at), size),), is_bytes=True)
        ext = self._ext_header(b, at)
        if ext is not None:
            return self._ext(*ext, at)
        raise CorruptCheckpointError(f"{cur.path}: {at}: byte {b:#04x} at offset {cur.pos - 1} is not msgpack")

    def _number(self, b: int, at: str) -> _Leaf | None:
        """A leaf for the msgpack int, bool or float whose type byte is ``b``, else None."""
        if b <= 0x7F or b >= 0xE0:
            return _integer(b if b <= 0x7F else b - 0x100)
        if 0xCC <= b <= 0xD3:
            size = 1 << ((b - 0xCC) % 4)
            return _integer(int.from_bytes(self.cur.take(size, at), "big", signed=b >= 0xD0))
        if b in (0xC2, 0xC3):
            return _Leaf(np.dtype(np.bool_), (), value=b == 0xC3)
        if b in (0xCA, 0xCB):  # a float32 stays float32
            fmt = ">f" if b == 0xCA else ">d"
            value = struct.unpack(fmt, self.cur.take(struct.calcsize(fmt), at))[0]
            return _Leaf(np.dtype(np.float32 if b == 0xCA else np.float64), (), value=value)
        return None

    def _int(self, at: str) -> int:
        leaf = self._number(self.cur.take(1, at)[0], at)
        if leaf is None or leaf.dtype.kind not in "iu":
            raise CorruptCheckpointError(f"{self.cur.path}: {at}: expected an integer at offset {self.cur.pos - 1}")
        return int(leaf.value)

    def _array_len(self, b: int, at: str) -> int | None:
        if 0x90 <= b <= 0x9F:
            return b & 0x0F
        return self.cur.uint(2 if b == 0xDC else 4, at) if b in (0xDC, 0xDD) else None

    def _str_or_bin_len(self, b: int, at: str) -> int | None:
        if 0xA0 <= b <= 0xBF:
            return b & 0x1F
        widths = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4}
        return self.cur.uint(widths[b], at) if b in widths else None

    def _ext_header(self, b: int, at: str) -> tuple[int, int] | None:
        """(type, payload length) for an ext object, else None."""
        fixed = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}
        if b in fixed:
            n = fixed[b]
        elif b in (0xC7, 0xC8, 0xC9):
            n = self.cur.uint({0xC7: 1, 0xC8: 2, 0xC9: 4}[b], at)
        else:
            return None
        return int.from_bytes(self.cur.take(1, at), "big", signed=True), n

    def _check_count(self, n: int, min_bytes: int, at: str) -> None:
        if self.cur.pos + n * min_bytes > self.cur.size:
            raise CorruptCheckpointError(f"{self.cur.path}: {at} declares {n} entries, more than the rest of "
                                         "the file can hold: it is damaged")

    def _map(self, n: int, where: list[str], depth: int) -> _Node:
        at = "/".join(where) or "the top level"
        self._check_count(n, 2, at)
        out: dict[str, _Node] = {}
        for _ in range(n):
            b = self.cur.take(1, at)[0]
            size = self._str_or_bin_len(b, at) if 0xA0 <= b <= 0xBF or b in (0xD9, 0xDA, 0xDB) else None
            if size is None:
                raise UnsupportedCheckpointError(f"{self.cur.path}: {at} has a map key that is not a string "
                                                 f"(msgpack type {b:#04x}); Flax state dicts have string keys")
            try:
                name = self.cur.take(size, at).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise CorruptCheckpointError(f"{self.cur.path}: {at} has a map key that is not UTF-8") from exc
            if name in out:
                raise CorruptCheckpointError(f"{self.cur.path}: {at} has the key {name!r} twice")
            out[name] = self.value(where + [name], depth + 1)
        return _unchunk(out, self.cur.path, at) if _CHUNKED in out else out

    def _ext(self, code: int, n: int, at: str) -> _Leaf:
        cur = self.cur
        end = cur.pos + n
        if end > cur.size:
            cur.skip(n, at)  # raises: the payload does not fit in the file
        if code == _EXT_COMPLEX:
            parts = [self._number(cur.take(1, at)[0], at) for _ in range(2)] \
                if self._array_len(cur.take(1, at)[0], at) == 2 else []
            values = [p.value for p in parts if p is not None and p.dtype.kind in "iuf"]
            if len(values) != 2:
                raise CorruptCheckpointError(f"{cur.path}: {at}: a complex number is not [real, imag]")
            leaf = _Leaf(np.dtype(np.complex128), (), value=complex(*values))
        elif code in (_EXT_NDARRAY, _EXT_SCALAR):
            leaf = self._ndarray(at)
            if code == _EXT_SCALAR and leaf.shape:
                raise CorruptCheckpointError(f"{cur.path}: {at}: a numpy scalar has shape {list(leaf.shape)}")
        else:
            raise UnsupportedCheckpointError(f"{cur.path}: {at} is a msgpack extension of type {code}; "
                                             "Flax writes types 1 (ndarray), 2 (complex) and 3 (numpy scalar)")
        if cur.pos != end:
            raise CorruptCheckpointError(f"{cur.path}: {at}: the extension's payload is {n} bytes but its "
                                         f"contents take {cur.pos - end + n}")
        return leaf

    def _ndarray(self, at: str) -> _Leaf:
        """The payload [shape, dtype name, bytes]: headers are read, the data's place recorded."""
        cur = self.cur
        if self._array_len(cur.take(1, at)[0], at) != 3:
            raise CorruptCheckpointError(f"{cur.path}: {at}: an array payload is not [shape, dtype, data]")
        rank = self._array_len(cur.take(1, at)[0], at)
        if rank is None or rank > 64:
            raise CorruptCheckpointError(f"{cur.path}: {at}: the array's shape is not a list of at most 64 sizes")
        shape = tuple(self._int(at) for _ in range(rank))
        if any(d < 0 for d in shape):
            raise CorruptCheckpointError(f"{cur.path}: {at}: invalid shape {list(shape)}")
        size = self._str_or_bin_len(cur.take(1, at)[0], at)
        name = cur.take(size, at).decode("utf-8", "replace") if size is not None and size < 64 else None
        dtype = NUMPY_DTYPES.get(name) if name is not None else None
        if dtype is None:
            raise UnsupportedCheckpointError(f"{cur.path}: {at} has dtype {name!r}; ckpt reads "
                                             f"{', '.join(NUMPY_DTYPES)}")
        b = cur.take(1, at)[0]
        n = self._str_or_bin_len(b, at) if b in (0xC4, 0xC5, 0xC6) else None
        if n is None:
            raise CorruptCheckpointError(f"{cur.path}: {at}: the array's data is not a bin object")
        expected = _io.expected_nbytes(dtype, shape)
        if n != expected:
            raise CorruptCheckpointError(f"{cur.path}: {at}: {name} {list(shape)} needs {expected} bytes, "
                                         f"the file holds {n}")
        return _Leaf(dtype, shape, ((cur.skip(n, at), n),))


def _integer(value: int) -> _Leaf:
    return _Leaf(np.dtype(np.int64 if value < 2 ** 63 else np.uint64), (), value=value)


def _unchunk(node: dict[str, _Node], path: str, at: str) -> _Leaf:
    """Flax's {"__msgpack_chunked_array__": True, "shape": {...}, "chunks": {...}} -> one leaf."""
    shape_node, chunks = node.get("shape"), node.get("chunks")
    flag = node.get(_CHUNKED)
    if set(node) != {_CHUNKED, "shape", "chunks"} or not (isinstance(flag, _Leaf) and flag.value is True) \
            or not isinstance(shape_node, dict) or not isinstance(chunks, dict):
        raise CorruptCheckpointError(f"{path}: {at}: malformed chunked array (needs {_CHUNKED}, shape, chunks)")
    dims = [shape_node.get(str(i)) for i in range(len(shape_node))]
    shape = tuple(int(d.value) for d in dims if isinstance(d, _Leaf) and d.dtype.kind in "iu" and d.value is not None
                  and d.value >= 0)
    parts = [p for p in (chunks.get(str(i)) for i in range(len(chunks)))
             if isinstance(p, _Leaf) and p.extents and len(p.shape) == 1]
    if len(shape) != len(dims) or not parts or len(parts) != len(chunks):
        raise CorruptCheckpointError(f"{path}: {at}: malformed chunked array (shape or chunks)")
    dtype = parts[0].dtype
    if any(p.dtype != dtype for p in parts):
        raise CorruptCheckpointError(f"{path}: {at}: the chunks of one array have different dtypes")
    extents = tuple(e for p in parts for e in p.extents)
    if sum(n for _, n in extents) != _io.expected_nbytes(dtype, shape):
        raise CorruptCheckpointError(f"{path}: {at}: the chunks do not add up to shape {list(shape)}")
    return _Leaf(dtype, shape, extents)


class FlaxReader(FileReader):
    """Reads the structure on open; tensors on request, straight into the caller's buffer."""

    format_name = "flax"
    _tensors: dict[str, TensorInfo]  # filled entry by entry while the file is parsed
    checksummed = False

    def _open(self) -> None:
        cursor = _Cursor(self._source, self._source.size, self.path)
        root = _Parser(cursor).value([], 0)
        if cursor.pos != cursor.size:
            raise CorruptCheckpointError(f"{self.path}: {cursor.size - cursor.pos} bytes follow the msgpack "
                                         "object: not a Flax file, or damaged")
        if not isinstance(root, dict):
            raise UnsupportedCheckpointError(f"{self.path}: holds a single value, not a Flax state dict; "
                                             "ckpt reads state dicts (maps of named arrays)")
        self._metadata = {}
        self._tensors = {}
        self._leaves: dict[str, _Leaf] = {}
        self._flatten(root, [])

    def _flatten(self, node: dict[str, _Node], where: list[str]) -> None:
        for name, child in node.items():
            if isinstance(child, dict):
                self._flatten(child, where + [name])
            elif isinstance(child, _Leaf):
                key = check_key("/".join(where + [name]), self.path)
                if key in self._tensors:
                    raise UnsupportedCheckpointError(f"{self.path}: two entries flatten to the key {key!r} "
                                                     "(a map key contains '/')")
                nbytes = sum(n for _, n in child.extents) if child.extents else child.dtype.itemsize
                self._tensors[key] = TensorInfo(key, child.dtype, child.shape, nbytes)
                self._leaves[key] = child

    def _read_into(self, info: TensorInfo, out: np.ndarray) -> None:
        leaf = self._leaves[info.key]
        if leaf.value is not None:
            out[()] = leaf.value
        elif leaf.is_bytes:
            (offset, n), = leaf.extents
            out[()] = _io.pread(self._source, offset, n, f"tensor {info.key!r}")
        else:
            view, pos = _io.byte_view(out), 0
            for offset, n in leaf.extents:
                self._source.read_into(view[pos:pos + n], offset, f"tensor {info.key!r}")
                pos += n

