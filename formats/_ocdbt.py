"""tensorstore's OCDBT key-value store (orbax's default checkpoint layout), read-only, in pure Python.

A database is a directory: ``manifest.ocdbt`` (its configuration and the latest versions' B+tree
roots) and data files (``d/<hex>``, or ``ocdbt.process_N/d/<hex>`` when orbax merged the
per-process databases) holding B+tree nodes and values. Every manifest and node carries a
crc32c over its bytes, checked here; node bodies are zstd-compressed (tensorstore's default).
This reads the latest version into a {key: value location} map, following the public
specification of the format; values are read on request.

Example:
    >>> store = open_store("run/step_7")  # doctest: +SKIP
    >>> sorted(store.keys())[:2]  # doctest: +SKIP
    [b'flag/.zarray', b'flag/0']
"""

from __future__ import annotations

import os
from typing import Any

from ckpt.errors import CorruptCheckpointError, UnsupportedCheckpointError, checksum_error
from ckpt.storage import ReadableBlob

from . import _io
from ._zstd import zstd_decompress

MANIFEST = "manifest.ocdbt"
_MANIFEST_MAGIC, _VERSION_MAGIC, _BTREE_MAGIC = 0x0CDB3A2A, 0x0CDB1234, 0x0CDB20DE
#: Limits: a node's decoded size (tensorstore's default max_decoded_node_bytes is 8 MiB), the depth of
#: the B+tree, the entries of all nodes together.
MAX_NODE = 64 << 20
MAX_HEIGHT = 32
MAX_KEYS = 1 << 22


class _Reader:
    """A cursor over a node body; every read past the end is a CorruptCheckpointError."""

    def __init__(self, data: bytes, where: str) -> None:
        self.data, self.pos, self.where = data, 0, where

    def fail(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.where}: {what} (at byte {self.pos})")

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise self.fail(f"needs {n} bytes, the node has {len(self.data) - self.pos} left")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def varint(self) -> int:
        value, shift = 0, 0
        while True:
            byte = self.u8()
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7
            if shift > 63:
                raise self.fail("a varint longer than 64 bits")

    def varints(self, n: int) -> list[int]:
        return [self.varint() for _ in range(n)]

    def count(self, limit: int, what: str) -> int:
        n = self.varint()
        if n > limit or n > len(self.data) - self.pos:  # each item takes at least a byte
            raise self.fail(f"{n} {what}")
        return n


def _decode(raw: bytes, magic: int, where: str) -> _Reader:
    """Check an encoded manifest or node (magic, length, version, crc32c) and return its body."""
    if len(raw) < 18 or int.from_bytes(raw[:4], "big") != magic:
        raise CorruptCheckpointError(f"{where}: not an OCDBT {_KIND[magic]} (magic {raw[:4].hex()})")
    if int.from_bytes(raw[4:12], "little") != len(raw):
        raise CorruptCheckpointError(f"{where}: declares {int.from_bytes(raw[4:12], 'little')} bytes, holds "
                                     f"{len(raw)}: it is truncated or damaged")
    got, expected = _io.crc32c(raw[:-4]), int.from_bytes(raw[-4:], "little")
    if got != expected:
        raise checksum_error(where, f"the OCDBT {_KIND[magic]}", got, expected)
    header = _Reader(raw[12:-4], where)
    version, compression = header.varint(), header.varint()
    if version != 0:
        raise UnsupportedCheckpointError(f"{where}: OCDBT {_KIND[magic]} version {version}; ckpt reads version 0")
    body = header.data[header.pos:]
    if compression == 1:
        body = zstd_decompress(body, MAX_NODE + 1, where)
        if len(body) > MAX_NODE:
            raise CorruptCheckpointError(f"{where}: decompresses past {MAX_NODE} bytes")
    elif compression != 0:
        raise UnsupportedCheckpointError(f"{where}: compression format {compression}")
    return _Reader(body, where)


_KIND = {_MANIFEST_MAGIC: "manifest", _VERSION_MAGIC: "version tree node", _BTREE_MAGIC: "B+tree node"}


def _prefix_coded(r: _Reader, keep: list[int], sizes: list[int], what: str) -> list[bytes]:
    """Strings stored as (bytes shared with the previous one, new suffix): ``keep`` holds the
    shared lengths of strings 1.., ``sizes`` every suffix's length; the suffixes come next in ``r``."""
    out, previous = [], b""
    for i, size in enumerate(sizes):
        k = keep[i - 1] if i else 0
        if k > len(previous):
            raise r.fail(f"{what}'s prefix is longer than the previous one")
        previous = previous[:k] + r.take(size)
        out.append(previous)
    return out


def _file_table(r: _Reader, transitive: str) -> list[tuple[str, str]]:
    """The data file table: each file's full path and the transitive path its children inherit."""
    n = r.count(1 << 20, "data files")
    prefix = r.varints(max(n - 1, 0))
    suffix = r.varints(n)
    base = r.varints(n)
    out = []
    for path, base_length in zip(_prefix_coded(r, prefix, suffix, "a data file path"), base):
        if base_length > len(path):
            raise r.fail("a data file's base path is longer than its path")
        try:
            text, base_text = path.decode("utf-8"), path[:base_length].decode("utf-8")
        except UnicodeDecodeError:
            raise r.fail("a data file path that is not UTF-8") from None
        out.append((transitive + text, transitive + base_text))
    return out


class Store:
    """The latest version of an OCDBT database: key -> value, read on request."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._files: dict[str, ReadableBlob] = {}
        #: key -> inline bytes, or (data file path, offset, length)
        self.values: dict[bytes, Any] = {}
        self._visits = 0
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        where = os.path.join(self.root, MANIFEST)
        try:
            with open(where, "rb") as f:
                raw = f.read(min(os.fstat(f.fileno()).st_size, MAX_NODE) + 1)
        except OSError as exc:
            raise CorruptCheckpointError(f"{where}: cannot read: {exc.strerror or exc}") from exc
        r = _decode(raw, _MANIFEST_MAGIC, where)
        r.take(16)  # uuid
        kind = r.varint()
        if kind != 0:
            raise UnsupportedCheckpointError(f"{where}: a numbered OCDBT manifest (kind {kind}); ckpt reads "
                                             "single-file manifests")
        r.varint()  # max_inline_value_bytes
        r.varint()  # max_decoded_node_bytes
        r.u8()  # version_tree_arity_log2
        method = r.varint()
        if method == 1:
            r.take(4)  # zstd level
        elif method != 0:
            raise UnsupportedCheckpointError(f"{where}: compression method {method}")
        files = _file_table(r, "")
        versions = r.count(1 << 16, "inline versions")
        generations = r.varints(versions)
        heights = [r.u8() for _ in range(versions)]
        ids, offsets, lengths = r.varints(versions), r.varints(versions), r.varints(versions)
        if not versions:
            raise UnsupportedCheckpointError(f"{where}: no inline version (an OCDBT database whose latest "
                                             "version is only in its version tree); ckpt reads the latest inline one")
        if generations != sorted(set(generations)):
            raise r.fail("generation numbers that do not increase")
        if lengths[-1] == 0:
            return  # an empty database
        self._node(files, ids[-1], offsets[-1], lengths[-1], heights[-1], b"", where)

    def _node(self, files: list[tuple[str, str]], file_id: int, offset: int, length: int, height: int,
              prefix: bytes, where: str) -> None:
        if file_id >= len(files):
            raise CorruptCheckpointError(f"{where}: refers to data file {file_id} of {len(files)}")
        self._visits += 1
        if self._visits > MAX_KEYS:  # shared subtrees could otherwise be walked exponentially often
            raise CorruptCheckpointError(f"{where}: the B+tree references more than {MAX_KEYS} nodes")
        path, transitive = files[file_id]
        raw = self.read(path, offset, length, where)
        name = f"{os.path.join(self.root, path)}@{offset}"
        r = _decode(raw, _BTREE_MAGIC, name)
        if r.u8() != height or height > MAX_HEIGHT:
            raise r.fail(f"a B+tree node of another height than its parent says ({height})")
        table = _file_table(r, transitive)
        n = r.count(MAX_KEYS, "entries")
        keep = r.varints(max(n - 1, 0))
        sizes = r.varints(n)
        common = r.varints(n) if height else []
        keys = _prefix_coded(r, keep, sizes, "a key")
        if height:
            ids, offs, lens = r.varints(n), r.varints(n), r.varints(n)
            r.varints(3 * n)  # statistics: keys, tree bytes, indirect value bytes
            for i in range(n):
                if common[i] > len(keys[i]):
                    raise r.fail("a subtree prefix longer than its key")
                self._node(table, ids[i], offs[i], lens[i], height - 1, prefix + keys[i][:common[i]], name)
            return
        value_lengths = r.varints(n)
        kinds = r.varints(n)
        if any(kind not in (0, 1) for kind in kinds):
            raise r.fail("a value kind other than inline (0) or out-of-line (1)")
        indirect = [i for i in range(n) if kinds[i] == 1]
        ids, offs = r.varints(len(indirect)), r.varints(len(indirect))
        for i, file_id_, off in zip(indirect, ids, offs):
            if file_id_ >= len(table):
                raise r.fail(f"a value in data file {file_id_} of {len(table)}")
            self._put(prefix + keys[i], (table[file_id_][0], off, value_lengths[i]), name)
        for i in range(n):
            if kinds[i] == 0:
                self._put(prefix + keys[i], r.take(value_lengths[i]), name)
        if len(self.values) > MAX_KEYS:
            raise r.fail(f"more than {MAX_KEYS} keys")

    def _put(self, key: bytes, value: Any, where: str) -> None:
        if key in self.values:
            raise CorruptCheckpointError(f"{where}: the key {key!r} appears twice")
        self.values[key] = value

    def keys(self) -> list[bytes]:
        return list(self.values)

    def get(self, key: bytes) -> bytes | None:
        """A value's bytes, or None when the key is absent."""
        value = self.values.get(key)
        if value is None or isinstance(value, bytes):
            return value
        path, offset, length = value
        return self.read(path, offset, length, f"{self.root}: value of {key!r}")

    def read(self, path: str, offset: int, length: int, where: str) -> bytes:
        parts = path.split("/")
        if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in path:
            raise CorruptCheckpointError(f"{where}: refers to the data file {path!r}, outside the database")
        f = self._files.get(path)
        if f is None:
            try:
                f = self._files[path] = _io.LocalFile(os.path.join(self.root, path), name=path)
            except OSError as exc:
                raise CorruptCheckpointError(f"{where}: data file {path}: {exc.strerror or exc}") from exc
        size = f.size
        if offset + length > size:
            raise CorruptCheckpointError(f"{where}: needs bytes {offset}..{offset + length} of the {size}-byte "
                                         f"data file {path}: it is truncated")
        return _io.pread(f, offset, length, where)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def open_store(root: str) -> Store:
    """Read the OCDBT database in directory ``root`` (its ``manifest.ocdbt``)."""
    return Store(root)
