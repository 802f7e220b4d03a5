"""The HDF5 structure of a ckpt HDF5 file, written by ckpt itself from the HDF5 file-format
specification (version 0 superblock, version 1 object headers, symbol-table groups: what
h5py writes with ``libver="earliest"``, readable by every HDF5 since 1.6).

libhdf5 creates one dataset at a time (~75 µs each here: 10,000 small tensors cost 0.75 s);
laying the same structures out in one pass costs a few µs per tensor. The file is a standard
HDF5 file: plain h5py sees the same groups, datasets, types and attributes as before.

Layout, all HDF5 addresses relative to the superblock (the end of the user block):

    [user block][superblock][root group header][global heap][tensor data, in order][metadata]

The root group's header carries the file's attributes, the global heap collection the
attributes' variable-length strings. The metadata is every other object: the datasets'
object headers, then per group, children before parents, its local heap (link names),
symbol-table nodes, B-tree nodes and object header (the root's nodes last).

Example:
    >>> import numpy as np
    >>> from h5py import h5t
    >>> from ckpt.formats._h5struct import Dataset, layout
    >>> f32 = dtype_message(h5t.py_create(np.dtype("<f4")))
    >>> out = layout([Dataset("enc/w", f32, (2, 2), 16, ())], [("ckpt_version", 1)], 512)
    >>> out.offsets == [512 + len(out.head)], out.metadata_offset == 512 + len(out.head) + 16
    (True, True)
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["MAX_MESSAGE", "Dataset", "Layout", "dtype_message", "layout"]

_UNDEF = 2 ** 64 - 1
# Symbol-table nodes hold up to 2 * _LEAF_K links, group B-tree nodes 2 * _NODE_K children (HDF5's
# defaults are 4 and 16). Both are allocated whole; most groups of a model hold a few tensors, so
# smaller nodes (416 bytes of structure for a group of one, against 960) write less.
_LEAF_K = 2
_NODE_K = 4
_SNOD_SIZE = 8 + 2 * _LEAF_K * 40
_TREE_SIZE = 24 + 2 * _NODE_K * 8 + (2 * _NODE_K + 1) * 8
_SUPERBLOCK_SIZE = 96
#: Largest object header message (its size field has 16 bits).
MAX_MESSAGE = 0xFFF8

_PREFIX = struct.Struct("<BBHII4x")  # version 1 object header: version, 0, messages, refcount, size
_MESSAGE = struct.Struct("<HHB3x")  # type, data size, flags
_ENTRY = struct.Struct("<QQII16s")  # symbol table entry: name offset, header, cache type, 0, scratch
_SNOD_HEAD = struct.Struct("<4sBBH")
_QQ = struct.Struct("<QQ")
_HEAP = struct.Struct("<4s4xQQQ")  # local heap: data size, free list (1: none), data address
_GROUP = struct.Struct("<BBHII4xHHB3xQQ")  # a group's object header: its symbol table message alone
_LAYOUT = struct.Struct("<HHB3xBBQQ6x")  # layout message: version 3, contiguous, address, size
_GCOL_OBJECT = struct.Struct("<HH4xQ")  # global heap object: index, refcount, size
# whole nodes of a group with a single link: the common case of "scope/tensor" keys
_ONE_SNOD = struct.Struct(f"<4sBBHQQII16s{_SNOD_SIZE - 48}x")
_ONE_TREE = struct.Struct(f"<4sBBHQQQQQ{_TREE_SIZE - 48}x")

_VLEN_STRING = bytes.fromhex("1901010010000000" "10000000010000000000" "0800")  # UTF-8, h5py's str
_INT64 = bytes.fromhex("100800000800000000004000")  # little-endian signed, 64 bits
_UINT64 = bytes.fromhex("100000000800000000004000")
_SCALAR_SPACE = bytes([1]) + bytes(7)  # dataspace version 1, rank 0
_FILL = bytes([2, 1, 1, 0])  # fill value v2: allocated early, never written, none defined


class Dataset(NamedTuple):
    """One tensor's dataset: its key, HDF5 datatype message, shape, data size and attributes.

    Attribute values are str (a UTF-8 variable-length string, as h5py stores str), int (an
    int64 scalar) or a 1-D uint64 array.
    """

    key: str
    dtype: bytes
    shape: tuple[int, ...]
    nbytes: int
    attrs: Sequence[tuple[str, Any]]


class Layout(NamedTuple):
    """Where everything goes: each dataset's absolute data offset (None when it has no data),
    the HDF5 structure (``head``, written at the user block's end: the superblock, the root
    group's header and the global heap; then the rest in pieces, contiguous from
    ``metadata_offset``), and the file size."""

    offsets: list[int | None]
    head: bytes
    metadata_offset: int
    metadata: list[bytes]
    size: int


def dtype_message(h5type: Any) -> bytes:
    """The datatype message HDF5 stores for an h5py TypeID, as libhdf5 itself encodes it."""
    return bytes(h5type.encode()[2:])  # H5Tencode: message id, encoding version, then the message


def _pad8(data: bytes) -> bytes:
    return data + bytes(-len(data) % 8)


def _message(kind: int, data: bytes, flags: int = 0) -> bytes:
    data = _pad8(data)
    return _MESSAGE.pack(kind, len(data), flags) + data


def _header(messages: list[bytes]) -> bytes:
    body = b"".join(messages)
    return _PREFIX.pack(1, 0, len(messages), 1, len(body)) + body


def _dataset_header(ds: Dataset, attributes: list[bytes]) -> bytes:
    """A dataset's object header up to its layout message (the last message, 32 bytes)."""
    messages = [_message(0x0001, _space(ds.shape)), _message(0x0003, ds.dtype, 1), _message(0x0005, _FILL, 1),
                *attributes]
    body = b"".join(messages)
    return _PREFIX.pack(1, 0, len(messages) + 1, 1, len(body) + 32) + body


_SPACES: dict[tuple[int, ...], bytes] = {}


def _space(shape: tuple[int, ...]) -> bytes:
    """A version 1 dataspace message (rank 0 is a scalar); maximum dimensions = dimensions."""
    found = _SPACES.get(shape)
    if found is None:
        if not shape:
            found = _SCALAR_SPACE
        else:
            found = struct.pack(f"<BBBB4x{2 * len(shape)}Q", 1, len(shape), 1, 0, *shape, *shape)
        if len(_SPACES) < 4096:
            _SPACES[shape] = found
    return found


class _Strings:
    """The global heap collection holding every variable-length string attribute value."""

    def __init__(self) -> None:
        self.index: dict[bytes, int] = {}

    def add(self, text: str) -> int:
        data = text.encode("utf-8")
        return self.index.setdefault(data, len(self.index) + 1)

    def collection(self) -> bytes:
        objects = [_GCOL_OBJECT.pack(i, 1, len(data)) + _pad8(data) for data, i in self.index.items()]
        used = 16 + sum(map(len, objects))
        size = max(4096, used + 16)  # room for the free-space object that ends every collection
        return b"".join([b"GCOL\x01\x00\x00\x00", struct.pack("<Q", size), *objects,
                         _GCOL_OBJECT.pack(0, 0, size - used), bytes(size - used - 16)])


def _attribute(name: str, value: Any, strings: _Strings, gcol: int) -> bytes:
    if isinstance(value, str):
        dtype, space = _VLEN_STRING, _SCALAR_SPACE
        data = struct.pack("<IQI", len(value.encode("utf-8")), gcol, strings.add(value))
    elif isinstance(value, int):
        dtype, space, data = _INT64, _SCALAR_SPACE, struct.pack("<q", value)
    else:
        arr = np.ascontiguousarray(value, dtype="<u8").reshape(-1)
        dtype, space, data = _UINT64, _space(arr.shape), arr.tobytes()
    encoded = name.encode("utf-8") + b"\x00"
    body = struct.pack("<BBHHH", 1, 0, len(encoded), len(dtype), len(space)) + \
        _pad8(encoded) + _pad8(dtype) + _pad8(space) + data
    if len(body) > MAX_MESSAGE:
        raise ValueError(f"attribute {name!r} takes {len(body)} bytes; an HDF5 version 1 object header "
                         f"message holds at most {MAX_MESSAGE}")
    return _message(0x000C, body)


def _root_header(tree: int, heap: int, root_attrs: Sequence[tuple[str, Any]], strings: _Strings,
                 gcol: int) -> bytes:
    return _header([_message(0x0011, _QQ.pack(tree, heap))] +
                   [_attribute(name, value, strings, gcol) for name, value in root_attrs])


def _collect_strings(datasets: Sequence[Dataset], root_attrs: Sequence[tuple[str, Any]]) -> _Strings:
    strings = _Strings()
    for _, value in root_attrs:
        if isinstance(value, str):
            strings.add(value)
    for ds in datasets:
        for _, value in ds.attrs:
            if isinstance(value, str):
                strings.add(value)
    return strings


class _Group:
    """A group being laid out: its children (name -> _Group or dataset index), then where its
    object header, B-tree and local heap went."""

    __slots__ = ("children", "header", "heap", "tree")
    header: int
    heap: int
    tree: int

    def __init__(self) -> None:
        self.children: dict[bytes, Any] = {}
        self.header = self.tree = self.heap = 0


def _groups(datasets: Sequence[Dataset]) -> list[_Group]:
    """Every group the keys imply, each after its parent (the root first)."""
    root = _Group()
    order = [root]
    groups: dict[str, _Group] = {"": root}
    for i, ds in enumerate(datasets):
        scope, _, name = ds.key.rpartition("/")
        group = groups.get(scope)
        if group is None:
            group = root
            path = ""
            for part in scope.split("/"):
                path = f"{path}/{part}" if path else part
                child = groups.get(path)
                if child is None:
                    child = groups[path] = _Group()
                    order.append(child)
                    group.children[part.encode("utf-8")] = child
                group = child
        group.children[name.encode("utf-8")] = i
    return order


def layout(datasets: Sequence[Dataset], root_attrs: Sequence[tuple[str, Any]], userblock: int,
           align_min: int = 1 << 62, align: int = 4096) -> Layout:
    """Lay out a ckpt HDF5 file's structure and data; return the bytes to write and where.

    Data of ``align_min`` bytes or more starts at a multiple of ``align`` (absolute offset).

    Raises:
        ValueError: an attribute too large for a version 1 object header (the caller then
            lets libhdf5 write the file).
    """
    base = userblock
    # the root group's header (its attributes name the file as ckpt's) and the global heap come
    # first, so both lie within the first pages; their sizes do not depend on any address
    strings = _collect_strings(datasets, root_attrs)
    root_size = len(_root_header(0, 0, root_attrs, strings, 0))
    gcol = _SUPERBLOCK_SIZE + root_size
    collection = strings.collection()
    pos = base + gcol + len(collection)
    offsets: list[int | None] = []
    for ds in datasets:
        if not ds.nbytes:
            offsets.append(None)
            continue
        if ds.nbytes >= align_min:
            pos += -pos % align
        offsets.append(pos)
        pos += ds.nbytes
    meta_start = addr = pos + (-pos % 8) - base  # relative addresses from here on
    parts: list[bytes] = []

    headers: list[int] = []
    plain: dict[tuple[bytes, tuple[int, ...]], bytes] = {}  # a dataset header without attributes, to its layout
    for ds, offset in zip(datasets, offsets):
        address = _UNDEF if offset is None else offset - base
        if ds.attrs:
            header = _dataset_header(ds, [_attribute(name, value, strings, gcol) for name, value in ds.attrs]) + \
                _LAYOUT.pack(0x0008, 24, 0, 3, 1, address, ds.nbytes)
        else:
            start = plain.get((ds.dtype, ds.shape))
            if start is None:
                start = plain[(ds.dtype, ds.shape)] = _dataset_header(ds, [])
            header = start + _LAYOUT.pack(0x0008, 24, 0, 3, 1, address, ds.nbytes)
        headers.append(addr)
        parts.append(header)
        addr += len(header)
    # groups bottom-up (a parent's symbol table names its children's headers), the root last
    groups = _groups(datasets)
    zeros = bytes(16)
    for group in reversed(groups):
        children = group.children
        if len(children) == 1 and group is not groups[0]:  # one node of each kind, packed whole
            (name, child), = children.items()
            width = len(name) + 8 - len(name) % 8  # NUL-terminated, padded to 8 bytes
            if type(child) is int:
                entry, kind, scratch = headers[child], 0, zeros
            else:
                entry, kind, scratch = child.header, 1, _QQ.pack(child.tree, child.heap)
            group.heap = addr
            snod = addr + 40 + width
            group.tree = snod + _SNOD_SIZE
            group.header = group.tree + _TREE_SIZE
            parts.append(_one_group(width).pack(
                b"HEAP", 8 + width, 1, addr + 32, name,  # its local heap: the one link's name
                b"SNOD", 1, 0, 1, 8, entry, kind, 0, scratch,  # a symbol-table node
                b"TREE", 0, 0, 1, _UNDEF, _UNDEF, 0, snod, 8,  # the B-tree over it
                1, 0, 1, 1, 24, 0x0011, 16, 0, group.tree, addr))  # the group's object header
            addr = group.header + _GROUP.size
            continue
        names = sorted(children)
        heap_data = [zeros[:8]]  # offset 0: the empty name, the B-tree's leftmost key
        entries, at = [], 8
        for name in names:
            padded = name + bytes(8 - len(name) % 8)  # NUL-terminated, padded to 8 bytes
            heap_data.append(padded)
            child = children[name]
            if type(child) is int:
                entries.append(_ENTRY.pack(at, headers[child], 0, 0, zeros))
            else:
                entries.append(_ENTRY.pack(at, child.header, 1, 0, _QQ.pack(child.tree, child.heap)))
            at += len(padded)
        group.heap = addr
        heap_bytes = _HEAP.pack(b"HEAP", at, 1, addr + 32) + b"".join(heap_data)
        addr += len(heap_bytes)
        parts.append(heap_bytes)
        snods, last_keys, per = [], [], 2 * _LEAF_K
        for first in range(0, len(names), per):
            chunk = entries[first:first + per]
            parts += (_SNOD_HEAD.pack(b"SNOD", 1, 0, len(chunk)), *chunk, bytes(40 * (per - len(chunk))))
            snods.append(addr)
            last_keys.append(_ENTRY.unpack_from(chunk[-1])[0])
            addr += _SNOD_SIZE
        group.tree, addr = _btree(snods, last_keys, addr, parts)
        if group is groups[0]:
            break  # the root group's header was placed after the superblock
        group.header = addr
        parts.append(_GROUP.pack(1, 0, 1, 1, 24, 0x0011, 16, 0, group.tree, group.heap))
        addr += _GROUP.size
    root = groups[0]
    root.header = _SUPERBLOCK_SIZE
    eof = addr
    superblock = b"".join([b"\x89HDF\r\n\x1a\n", bytes([0, 0, 0, 0, 0, 8, 8, 0]),
                           struct.pack("<HHI", _LEAF_K, _NODE_K, 0),
                           struct.pack("<QQQQ", base, _UNDEF, base + eof, _UNDEF),  # end of file: absolute
                           _ENTRY.pack(0, root.header, 1, 0, _QQ.pack(root.tree, root.heap))])
    head = superblock + _root_header(root.tree, root.heap, root_attrs, strings, gcol) + collection
    if len(head) != gcol + len(collection):
        raise AssertionError("the root group's header changed size")
    return Layout(offsets, head, base + meta_start, parts, base + eof)


_ONE_GROUP: dict[int, struct.Struct] = {}


def _one_group(padded: int) -> struct.Struct:
    """The structures of a group with one link whose name takes ``padded`` bytes, as one Struct:
    local heap (header, the empty name, the name), symbol-table node, B-tree node, object header."""
    found = _ONE_GROUP.get(padded)
    if found is None:
        found = _ONE_GROUP[padded] = struct.Struct("<" + "".join(
            f.format.lstrip("<") for f in (_HEAP, struct.Struct(f"8x{padded}s"), _ONE_SNOD, _ONE_TREE, _GROUP)))
    return found


def _btree(children: list[int], last_keys: list[int], addr: int, parts: list[bytes]) -> tuple[int, int]:
    """Write a group's B-tree over its symbol-table nodes, level by level; return (root, addr).

    Key 0 of the leftmost node is the empty name (heap offset 0); key i+1 is the greatest
    name under child i, so each node's first key is its left sibling's last.
    """
    level = 0
    while True:
        count = max(1, -(-len(children) // (2 * _NODE_K)))
        first = addr
        nodes, node_keys = [], []
        for n in range(count):
            lo, hi = n * 2 * _NODE_K, min((n + 1) * 2 * _NODE_K, len(children))
            left = first + (n - 1) * _TREE_SIZE if n else _UNDEF
            right = first + (n + 1) * _TREE_SIZE if n + 1 < count else _UNDEF
            keys = [last_keys[lo - 1] if lo else 0] + last_keys[lo:hi]
            body = b"".join(_QQ.pack(keys[i], children[lo + i]) for i in range(hi - lo)) + \
                struct.pack("<Q", keys[-1])
            node = b"TREE" + struct.pack("<BBHQQ", 0, level, hi - lo, left, right) + body
            parts.append(node + bytes(_TREE_SIZE - len(node)))
            nodes.append(first + n * _TREE_SIZE)
            node_keys.append(keys[-1])
        addr = first + count * _TREE_SIZE
        if count == 1:
            return nodes[0], addr
        children, last_keys, level = nodes, node_keys, level + 1
