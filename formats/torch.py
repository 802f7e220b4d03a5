"""PyTorch checkpoints written by ``torch.save`` (.pt, .pth, .bin), read without torch.

A torch.save file is a zip archive: ``<name>/data.pkl`` pickles the saved object, and each
tensor's storage is a member ``<name>/data/<key>`` holding its raw bytes (stored
uncompressed). The pickle is interpreted by ckpt's restricted unpickler
(:mod:`ckpt.formats._unpickler`), which builds only tensor descriptions, dicts, lists and
plain values and refuses any other global by name, executing nothing.

Keys: a state dict's own keys ("fc1.weight"); nested dicts and lists are joined with "/"
("model/fc1.weight", "optimizer/state/0/exp_avg"), integer keys written as decimals.
Non-tensor values (an epoch number, a learning rate) become the metadata, under the same
keys. Tensors are views of storages (offset, shape, strides in elements): contiguous ones
are read straight into the caller's buffer, others (a transposed view, an expanded
tensor) are gathered from their storage. Every storage is checked against the CRC-32 that
the zip records for it.

Example:
    >>> import ckpt
    >>> ckpt.load_variable("torch_state.pt", "fc1.weight").shape  # doctest: +SKIP
    (4, 3)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ckpt.errors import CorruptCheckpointError, UnsupportedCheckpointError, checksum_error, checksum_message

from . import _io, _zip
from ._foreign import check_key
from ._unpickler import StorageRef, TensorRef, load, shown
from .base import MAX_ELEMENTS, FileReader, TensorInfo, check_shape

#: How torch.save files written before PyTorch 1.6 (not zips) begin: pickle protocol 2, then
#: torch's magic number as a LONG1.
LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
_MAX_DEPTH = 100
#: The legacy format's first two pickles: torch's magic number and its protocol version.
_LEGACY_NUMBER = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001


class TorchReader(FileReader):
    """Unpickles data.pkl (restricted) on open; reads storages on request."""

    format_name = "pytorch"
    _tensors: dict[str, TensorInfo]  # filled entry by entry while the file is parsed
    def _open(self) -> None:
        path = self.path
        self._storages: dict[str, tuple[StorageRef, int, int, int | None]] = {}
        self._file = _io.stream(self._source)  # the zip directory and pickles are parsed in small reads
        if self._file.read(len(LEGACY_MAGIC)) == LEGACY_MAGIC:
            self._file.seek(0)
            self._open_legacy()
            return
        self._file.seek(0)
        self._zip = _zip.open_archive(self._file, path)
        names = self._zip.namelist()
        pickles = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise UnsupportedCheckpointError(
                f"{path}: a zip archive without exactly one <name>/data.pkl ({len(pickles)} found): not a "
                "torch.save file" + (" (a TorchScript archive?)" if any(n.endswith("/constants.pkl")
                                                                       for n in names) else ""))
        self._prefix = pickles[0][:-len("data.pkl")]
        order = self._member(self._prefix + "byteorder") if self._prefix + "byteorder" in names else b"little"
        if order != b"little":
            raise UnsupportedCheckpointError(f"{path}: written on a {order!r}-endian machine; ckpt reads "
                                             "little-endian files")
        pickled = self._member(pickles[0])
        self._list(load(pickled, path, self._storage), len(pickled))

    def _list(self, root: Any, budget: int) -> None:
        """The tensors and metadata of the unpickled object (``budget``: the pickle's size)."""
        if not isinstance(root, (dict, list, tuple)):
            what = "tensor" if isinstance(root, TensorRef) else type(root).__name__
            raise UnsupportedCheckpointError(f"{self.path}: holds a single {what}, not a state dict; ckpt "
                                             "reads dicts (or lists) of tensors")
        self._tensors, self._metadata = {}, {}
        self._budget = budget
        self._flatten(root, [], set())

    def _open_legacy(self) -> None:
        """The legacy format: pickles of the magic number, the protocol version, the system info, the
        object and the sorted storage keys; then each storage as an int64 element count and its bytes.
        There are no checksums."""
        path, f = self.path, _Bounded(self._file, self._source.size)
        if load(f, path, _no_storage) != _LEGACY_NUMBER or load(f, path, _no_storage) != _LEGACY_PROTOCOL:
            raise UnsupportedCheckpointError(f"{path}: a legacy torch.save file of an unknown version")
        info = load(f, path, _no_storage)
        if not isinstance(info, dict) or info.get("little_endian") is not True:
            raise UnsupportedCheckpointError(f"{path}: not written on a little-endian machine (system info "
                                             f"{shown(info)}); ckpt reads little-endian files")
        self.checksummed = False
        refs: dict[str, StorageRef] = {}
        start = f.tell()
        root = load(f, path, lambda ref: self._legacy_storage(ref, refs))
        budget = f.tell() - start
        keys = load(f, path, _no_storage)
        if type(keys) is not list or not all(type(k) is str for k in keys) or len(keys) != len(refs) or \
                set(keys) != set(refs):
            raise CorruptCheckpointError(f"{path}: the list of storage keys does not match the storages the "
                                         "pickle uses")
        pos, size = f.tell(), self._source.size
        for key in keys:  # each storage: its element count (int64) then its bytes, in this order
            ref = refs[key]
            numel = int.from_bytes(_io.pread(self._source, pos, 8, f"storage {key!r}"), "little", signed=True)
            nbytes = numel * ref.dtype.itemsize
            if numel != ref.numel or pos + 8 + nbytes > size:
                raise CorruptCheckpointError(
                    f"{path}: storage {key!r} at byte {pos} holds {numel} elements, the pickle says "
                    f"{ref.numel}" if numel != ref.numel else
                    f"{path}: storage {key!r} needs bytes {pos + 8}..{pos + 8 + nbytes} of a {size}-byte file: "
                    "it is truncated")
            self._storages[key] = (ref, pos + 8, nbytes, None)
            pos += 8 + nbytes
        if pos != size:
            raise CorruptCheckpointError(f"{path}: {size - pos} bytes follow the last storage")
        self._list(root, budget)

    def _legacy_storage(self, ref: StorageRef, refs: dict[str, StorageRef]) -> StorageRef:
        if refs.setdefault(ref.key, ref) != ref:
            raise CorruptCheckpointError(f"{self.path}: storage {ref.key!r} is described twice, differently")
        return ref

    def _member(self, name: str) -> bytes:
        """A small member's bytes (data.pkl, byteorder), checked against its CRC-32."""
        info = self._zip.getinfo(name)
        offset, size = _zip.member_span(self._source, info)
        data = _io.pread(self._source, offset, size, f"zip member {name!r}")
        got = _zip.crc32(data)
        if got != info.CRC:
            raise checksum_error(self.path, f"zip member {name!r}", got, info.CRC, checksum="CRC-32")
        return data

    def _storage(self, ref: StorageRef) -> StorageRef:
        """The unpickler's persistent_load: find the storage's member, check its size."""
        known = self._storages.get(ref.key)
        if known is not None:
            if known[0] != ref:
                raise CorruptCheckpointError(f"{self.path}: storage {ref.key!r} is described twice, differently")
            return known[0]
        name = f"{self._prefix}data/{ref.key}"
        try:
            info = self._zip.getinfo(name)
        except KeyError:
            raise CorruptCheckpointError(f"{self.path}: storage {ref.key!r} ({name}) is missing from the "
                                         "archive") from None
        offset, size = _zip.member_span(self._source, info)
        if size != ref.numel * ref.dtype.itemsize:
            raise CorruptCheckpointError(
                f"{self.path}: storage {ref.key!r} should hold {ref.numel} elements of {ref.dtype} "
                f"({ref.numel * ref.dtype.itemsize} bytes), its member holds {size}")
        self._storages[ref.key] = (ref, offset, size, info.CRC)
        return ref

    def _flatten(self, node: Any, where: list[str], ancestors: set[int]) -> None:
        self._budget -= 1
        if self._budget < 0:  # each visit costs at least a byte of pickle unless containers are shared
            raise UnsupportedCheckpointError(f"{self.path}: the pickle shares containers so often that "
                                             "listing them would not end; not a state dict")
        if isinstance(node, TensorRef):
            self._add_tensor(check_key("/".join(where), self.path), node)
        elif isinstance(node, (dict, list, tuple)):
            if id(node) in ancestors or len(where) > _MAX_DEPTH:
                raise UnsupportedCheckpointError(f"{self.path}: {'/'.join(where)!r} contains itself or is "
                                                 "nested too deeply")
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for name, child in items:
                if type(name) is int and name.bit_length() < 4096:  # optimizer state numbers its params
                    name = str(name)
                elif type(name) is int:  # str() refuses past 4,300 digits, and no state dict needs one
                    raise UnsupportedCheckpointError(f"{self.path}: {'/'.join(where) or 'the top level'} has an "
                                                     f"integer key of {name.bit_length()} bits; ckpt keys are "
                                                     "names, and integer ones are indexes")
                elif type(name) is not str:
                    raise UnsupportedCheckpointError(f"{self.path}: {'/'.join(where) or 'the top level'} has a "
                                                     f"{type(name).__name__} key; ckpt keys are strings")
                self._flatten(child, where + [name], ancestors | {id(node)})
        elif where and node is not None:
            self._metadata["/".join(where)] = _plain(node)

    def _add_tensor(self, key: str, ref: TensorRef) -> None:
        if key in self._tensors:
            raise UnsupportedCheckpointError(f"{self.path}: two entries flatten to the key {key!r}")
        check_shape(ref.shape, self.path, key)
        if ref.offset > MAX_ELEMENTS or any(s > MAX_ELEMENTS for s in ref.stride):  # numpy's strides are int64
            raise CorruptCheckpointError(f"{self.path}: tensor {key!r} has offset {ref.offset} and strides "
                                         f"{list(ref.stride)}; no storage has more than {MAX_ELEMENTS} elements")
        count = 1
        for d in ref.shape:
            count *= d
        if count:  # the furthest element must lie inside the storage
            last = ref.offset + sum((d - 1) * s for d, s in zip(ref.shape, ref.stride))
            if (last + 1) * ref.dtype.itemsize > ref.storage.numel * ref.storage.dtype.itemsize:
                raise CorruptCheckpointError(
                    f"{self.path}: tensor {key!r} ({list(ref.shape)}, strides {list(ref.stride)}, offset "
                    f"{ref.offset}) reaches beyond its storage of {ref.storage.numel} elements")
        if count * ref.dtype.itemsize > self._source.size:  # an expanded (stride 0) view
            raise UnsupportedCheckpointError(
                f"{self.path}: tensor {key!r} is a view of {list(ref.shape)} elements (strides "
                f"{list(ref.stride)}), larger than the whole file; ckpt does not expand it")
        self._tensors[key] = TensorInfo(key, ref.dtype, ref.shape, count * ref.dtype.itemsize, ref)

    def _read_into(self, info: TensorInfo, out: np.ndarray) -> None:
        ref: TensorRef = info.extra
        _, offset, size, crc = self._storages[ref.storage.key]
        what = f"tensor {info.key!r}"
        if not out.size:
            return
        if ref.offset == 0 and info.nbytes == size and _is_c_contiguous(ref):
            view = _io.byte_view(out)
            self._source.read_into(view, offset, what)
            self._check(info.key, view, crc)
        else:
            storage = np.empty(size, np.uint8)  # a view of part of a storage: gather it from the whole
            self._source.read_into(_io.byte_view(storage), offset, what)
            self._check(info.key, storage, crc)
            itemsize = ref.dtype.itemsize
            out[...] = np.ndarray(ref.shape, ref.dtype, buffer=storage, offset=ref.offset * itemsize,
                                  strides=tuple(s * itemsize for s in ref.stride))
        if ref.conj:  # torch's lazy views: resolve them as torch.load's .resolve_conj() would
            np.conjugate(out, out=out)
        if ref.neg:
            np.negative(out, out=out)

    def _check(self, key: str, data: Any, expected: int | None) -> None:
        if expected is None:  # the legacy format has no checksums
            return
        got = _zip.crc32(data)
        if got != expected:
            raise checksum_error(self.path, f"the storage of tensor {key!r}", got, expected, key=key, checksum="CRC-32")

    def verify(self, progress: Callable[[int], None] | None = None) -> list[str]:
        """Every tensor read as a restore reads it (its storage checked against the zip's CRC-32),
        then any storage no tensor uses checked the same way."""
        problems = super().verify(progress)
        if not self.checksummed:  # the legacy format: every tensor read is all there is to check
            return problems
        used = {info.extra.storage.key for info in self._tensors.values()}
        for key, (_, offset, size, crc) in self._storages.items():
            if key in used:
                continue
            try:
                got = _zip.crc32_range(self._source, offset, size, f"storage {key!r}")
            except CorruptCheckpointError as exc:
                problems.append(str(exc))
                continue
            finally:
                if progress is not None:
                    progress(size)
            if got != crc:
                problems.append(checksum_message(self.path, f"storage {key!r}", got, crc, "CRC-32"))
        return problems



class _Bounded:
    """The file as the legacy format's pickles are parsed from it: a read never asks for more than the
    file holds (a hostile length would otherwise make the read allocate it), a line is at most 64 KiB."""

    def __init__(self, file: Any, size: int) -> None:
        self._file, self._size = file, size

    def read(self, n: int = -1) -> bytes:
        left = self._size - self._file.tell()
        data: bytes = self._file.read(left if n < 0 else max(0, min(n, left)))
        return data

    def readline(self) -> bytes:
        line: bytes = self._file.readline(1 << 16)
        return line

    def tell(self) -> int:
        return int(self._file.tell())


def _no_storage(ref: StorageRef) -> StorageRef:
    raise CorruptCheckpointError(f"a storage ({ref.key!r}) where the legacy format has none")


def _is_c_contiguous(ref: TensorRef) -> bool:
    expected = 1
    for d, s in zip(reversed(ref.shape), reversed(ref.stride)):
        if d != 1 and s != expected:
            return False
        expected *= d
    return True


def _plain(value: Any) -> Any:
    """A non-tensor value as JSON-like metadata (bytes, sets and storages are described)."""
    if isinstance(value, (bool, float, str)) or (type(value) is int and -2 ** 63 <= value < 2 ** 64):
        return value
    if type(value) is int:  # too wide for JSON's numbers; str() refuses above 4,300 digits
        return str(value) if value.bit_length() < 4096 else f"<int of {value.bit_length()} bits>"
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    return f"<{type(value).__name__}>"
