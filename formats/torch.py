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

from typing import Any, Callable

import numpy as np

from ckpt.errors import CorruptCheckpointError, UnsupportedCheckpointError

from . import _io, _zip
from ._foreign import check_key
from ._unpickler import StorageRef, TensorRef, load
from .base import FileReader, TensorInfo

#: How torch.save files written before PyTorch 1.6 (not zips) begin: pickle protocol 2, then
#: torch's magic number as a LONG1.
LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
_MAX_DEPTH = 100


class TorchFormat:
    """torch.save's zip format (read-only)."""

    name = "pytorch"
    extensions = (".pt", ".pth", ".bin")
    can_write = False

    def sniff(self, head: bytes) -> bool:
        first = _zip.first_member_name(head)
        return head.startswith(LEGACY_MAGIC) or first is not None and first.endswith("data.pkl")

    def open(self, path: str) -> TorchReader:
        return TorchReader(path)


class TorchReader(FileReader):
    """Unpickles data.pkl (restricted) on open; reads storages on request."""

    format_name = "pytorch"
    _buffering = -1  # the zip directory is parsed in small reads

    def _open(self) -> None:
        path = self.path
        if self._file.read(len(LEGACY_MAGIC)) == LEGACY_MAGIC:
            raise UnsupportedCheckpointError(
                f"{path}: written by torch.save's legacy format (PyTorch < 1.6 or "
                "_use_new_zipfile_serialization=False); load and re-save it with a current PyTorch")
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
        self._storages: dict[str, tuple[StorageRef, int, int, int]] = {}
        pickled = self._member(pickles[0])
        root = load(pickled, path, self._storage)
        if not isinstance(root, (dict, list, tuple)):
            what = "tensor" if isinstance(root, TensorRef) else type(root).__name__
            raise UnsupportedCheckpointError(f"{path}: holds a single {what}, not a state dict; ckpt reads "
                                             "dicts (or lists) of tensors")
        self._tensors, self._metadata = {}, {}
        self._budget = len(pickled)
        self._flatten(root, [], set())

    def _member(self, name: str) -> bytes:
        """A small member's bytes (data.pkl, byteorder), checked against its CRC-32."""
        info = self._zip.getinfo(name)
        offset, size = _zip.member_span(self._fd, info, self.path)
        data = _io.pread(self._fd, offset, size, self.path, f"zip member {name!r}")
        if _zip.crc32(data) != info.CRC:
            raise CorruptCheckpointError(f"{self.path}: zip member {name!r} fails its CRC-32: the file is damaged")
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
        offset, size = _zip.member_span(self._fd, info, self.path)
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
                if type(name) is int:
                    name = str(name)
                elif type(name) is not str:
                    raise UnsupportedCheckpointError(f"{self.path}: {'/'.join(where) or 'the top level'} has a "
                                                     f"{type(name).__name__} key; ckpt keys are strings")
                self._flatten(child, where + [name], ancestors | {id(node)})
        elif where and node is not None:
            self._metadata["/".join(where)] = _plain(node)

    def _add_tensor(self, key: str, ref: TensorRef) -> None:
        if key in self._tensors:
            raise UnsupportedCheckpointError(f"{self.path}: two entries flatten to the key {key!r}")
        count = 1
        for d in ref.shape:
            count *= d
        if count:  # the furthest element must lie inside the storage
            last = ref.offset + sum((d - 1) * s for d, s in zip(ref.shape, ref.stride))
            if (last + 1) * ref.dtype.itemsize > ref.storage.numel * ref.storage.dtype.itemsize:
                raise CorruptCheckpointError(
                    f"{self.path}: tensor {key!r} ({list(ref.shape)}, strides {list(ref.stride)}, offset "
                    f"{ref.offset}) reaches beyond its storage of {ref.storage.numel} elements")
        if count * ref.dtype.itemsize > _io.file_size(self._fd):  # an expanded (stride 0) view
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
            _io.pread_into(self._fd, view, offset, self.path, what)
            self._check(info.key, _zip.crc32(view), crc)
            return
        storage = np.empty(size, np.uint8)  # a view of part of a storage: gather it from the whole
        _io.pread_into(self._fd, _io.byte_view(storage), offset, self.path, what)
        self._check(info.key, _zip.crc32(storage), crc)
        itemsize = ref.dtype.itemsize
        out[...] = np.ndarray(ref.shape, ref.dtype, buffer=storage, offset=ref.offset * itemsize,
                              strides=tuple(s * itemsize for s in ref.stride))

    def _check(self, key: str, got: int, expected: int) -> None:
        if got != expected:
            raise CorruptCheckpointError(f"{self.path}: tensor {key!r}: its storage fails the zip's CRC-32 "
                                         f"({got:#010x}, expected {expected:#010x}): the file is damaged")

    def verify(self, progress: Callable[[int], None] | None = None) -> list[str]:
        problems = []
        for key, (_, offset, size, crc) in self._storages.items():
            try:
                got = _zip.crc32_range(self._fd, offset, size, self.path, f"storage {key!r}")
            except CorruptCheckpointError as exc:
                problems.append(str(exc))
                continue
            finally:
                if progress is not None:
                    progress(size)
            if got != crc:
                problems.append(f"{self.path}: storage {key!r} fails the zip's CRC-32 ({got:#010x}, expected "
                                f"{crc:#010x}): the file is damaged")
        return problems



def _is_c_contiguous(ref: TensorRef) -> bool:
    expected = 1
    for d, s in zip(reversed(ref.shape), reversed(ref.stride)):
        if d != 1 and s != expected:
            return False
        expected *= d
    return True


def _plain(value: Any) -> Any:
    """A non-tensor value as JSON-like metadata (bytes, sets and storages are described)."""
    if isinstance(value, (bool, float, str)) or type(value) is int and -2 ** 63 <= value < 2 ** 64:
        return value
    if type(value) is int:
        return str(value)
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    return f"<{type(value).__name__}>"
