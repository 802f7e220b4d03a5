"""ckpt's incremental checkpoints: an index file whose tensors live in a shared chunk store.

A Saver with ``incremental=True`` cuts every numeric tensor's bytes into chunks of
``chunk_bytes``, names each by its SHA-256 and stores it once as ``.ckpt-chunks/<hex>`` in the
checkpoint's directory; the checkpoint file itself (``model-10.msgpack``) is a small msgpack
array of three objects, so plain msgpack walks it:

    [{"format": "ckpt-incremental", "version": 1},
     bin: the packed index,
     crc32c of the index bin (uint32)]

    index = {"format", "version", "metadata": {...}, "chunk_dir": ".ckpt-chunks",
             "chunk_bytes": int, "hash": "sha256",
             "tensors": {key: [dtype, shape, crc32c, chunks]}}

A shard file of a sharded incremental checkpoint (``Saver(comm=..., incremental=True)``) is such
an index inside the checkpoint's directory; its ``chunk_dir`` is ``"../.ckpt-chunks"``, the chunk
store beside that directory, shared with the directory's other checkpoints.

``chunks`` is the list of 32-byte SHA-256 digests of a numeric tensor's chunks in C order (the
last one shorter), or, for a byte-string tensor, the list of its items (stored inline). The
crc32c is over the tensor's bytes (over the packed list of items for strings). docs/formats.md
specifies it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from ckpt import dtypes
from ckpt.errors import CorruptCheckpointError, UnsupportedCheckpointError, checksum_error

from . import _io
from ._codec import packb, unpack
from .base import FileReader, TensorInfo, check_metadata, check_shape, dtype_or_raise, key_problem

FORMAT_NAME = "ckpt-incremental"
VERSION = 1
#: The chunk store's folder, beside the checkpoint files that reference it.
CHUNK_DIR = ".ckpt-chunks"
#: A shard file's chunk folder: the store beside its sharded checkpoint's directory.
NESTED_CHUNK_DIR = "../" + CHUNK_DIR
HASH = "sha256"
DIGEST_BYTES = 32
HEAD = b"\x93\x82\xa6format\xb0" + FORMAT_NAME.encode() + b"\xa7version"


def is_incremental(head: bytes) -> bool:
    """True when ``head`` (a file's first bytes) starts an incremental checkpoint's index."""
    return head.startswith(HEAD)


def digest(data: memoryview | bytes) -> bytes:
    """The content hash naming a chunk."""
    return hashlib.sha256(data).digest()


def chunk_path(directory: str, chunk: bytes) -> str:
    """Where the chunk ``chunk`` (a digest) is stored for checkpoints in ``directory``."""
    return os.path.join(directory, CHUNK_DIR, chunk.hex())


def tensor_entry(array: np.ndarray, chunk_bytes: int, put: Callable[[bytes, memoryview], None]) -> list[Any]:
    """The index entry of ``array``: a numeric tensor's bytes cut into chunks of ``chunk_bytes``,
    each handed to ``put(digest, bytes)``; a string tensor's items inline."""
    arr = _io.c_contiguous(array)
    name = dtypes.dtype_name(arr.dtype)
    if dtypes.is_string(arr.dtype):
        items = [bytes(x) for x in arr.reshape(-1)]
        return [name, list(arr.shape), _io.crc32c(packb(items)), items]
    view = _io.byte_view(arr)
    chunks = []
    for start in range(0, len(view), chunk_bytes):
        piece = view[start:start + chunk_bytes]
        chunks.append(digest(piece))
        put(chunks[-1], piece)
    return [name, list(arr.shape), _io.crc32c(view), chunks]


def pack_index(metadata: dict[str, Any], chunk_bytes: int, tensors: dict[str, list[Any]],
               nested: bool = False) -> bytes:
    """The bytes of an incremental checkpoint file (``nested``: a shard file of a sharded checkpoint,
    whose chunks are in the store beside the checkpoint's directory)."""
    chunk_dir = NESTED_CHUNK_DIR if nested else CHUNK_DIR
    index = packb({"format": FORMAT_NAME, "version": VERSION, "metadata": metadata, "chunk_dir": chunk_dir,
                   "chunk_bytes": chunk_bytes, "hash": HASH, "tensors": tensors})
    return packb([{"format": FORMAT_NAME, "version": VERSION}, index, _io.crc32c(index)])


class ChunkedLocation(NamedTuple):
    """A tensor's chunks (TensorInfo.extra of IncrementalReader)."""

    crc32c: int
    #: digests of a numeric tensor's chunks; the items of a string tensor
    chunks: list[bytes]


class IncrementalReader(FileReader):
    """Reads the index on open; tensors from the chunk store on request (crc32c checked),
    ``verify`` checks every chunk's hash too and names the chunk file that fails."""

    format_name = "ckpt-incremental"

    def _open(self) -> None:
        path, size = self.path, self._source.size
        raw = _io.pread(self._source, 0, size, "the index")
        outer = unpack(raw, path, "the file")
        if type(outer) is not list or len(outer) != 3 or type(outer[1]) is not bytes or type(outer[2]) is not int:
            raise CorruptCheckpointError(f"{path}: not an incremental checkpoint index (bad framing)")
        header, packed, crc = outer
        if not isinstance(header, dict) or header.get("version") != VERSION:
            raise UnsupportedCheckpointError(f"{path}: incremental checkpoint version {header.get('version')!r} "
                                             f"(this ckpt reads version {VERSION})")
        if _io.crc32c(packed) != crc:
            raise checksum_error(path, "the index")
        index = unpack(packed, path, "the index")
        if not isinstance(index, dict) or index.get("hash") != HASH or type(index.get("tensors")) is not dict:
            raise CorruptCheckpointError(f"{path}: the index is not an incremental checkpoint index")
        chunk_bytes = index.get("chunk_bytes")
        if type(chunk_bytes) is not int or chunk_bytes <= 0:
            raise CorruptCheckpointError(f"{path}: the index's chunk_bytes {chunk_bytes!r} is not a positive int")
        self.chunk_bytes: int = chunk_bytes
        chunk_dir = index.get("chunk_dir")
        if chunk_dir not in (CHUNK_DIR, NESTED_CHUNK_DIR):
            raise CorruptCheckpointError(f"{path}: the index names chunk folder {chunk_dir!r}, not {CHUNK_DIR!r} "
                                         f"(or {NESTED_CHUNK_DIR!r} in a sharded checkpoint)")
        #: the directory holding the chunk folder
        self.directory = os.path.dirname(path) if chunk_dir == CHUNK_DIR else \
            os.path.normpath(os.path.join(os.path.dirname(path), os.pardir))
        self._metadata = check_metadata(index.get("metadata", {}), path)
        self._tensors = {key: self._entry(key, entry) for key, entry in index["tensors"].items()}

    def _entry(self, key: Any, entry: Any) -> TensorInfo:
        path = self.path
        problem = key_problem(key)
        if problem:
            raise CorruptCheckpointError(f"{path}: invalid tensor key {key!r} in the index: {problem}")
        if type(entry) is not list or len(entry) != 4:
            raise CorruptCheckpointError(f"{path}: tensor {key!r}: malformed index entry")
        name, shape, crc, chunks = entry
        dtype = dtype_or_raise(name, path, key)
        shape = check_shape(shape, path, key)
        if type(crc) is not int or type(chunks) is not list or not all(type(c) is bytes for c in chunks):
            raise CorruptCheckpointError(f"{path}: tensor {key!r}: malformed chunks or checksum")
        nbytes = _io.expected_nbytes(dtype, shape) if not dtypes.is_string(dtype) else sum(map(len, chunks))
        if dtypes.is_string(dtype):
            if len(chunks) != int(np.prod(shape)):
                raise CorruptCheckpointError(f"{path}: tensor {key!r}: {list(shape)} needs {int(np.prod(shape))} "
                                             f"strings, the index holds {len(chunks)}")
        elif len(chunks) != -(-nbytes // self.chunk_bytes) or any(len(c) != DIGEST_BYTES for c in chunks):
            raise CorruptCheckpointError(f"{path}: tensor {key!r}: {nbytes} bytes need "
                                         f"{-(-nbytes // self.chunk_bytes)} chunk digests of {DIGEST_BYTES} bytes")
        return TensorInfo(key, dtype, shape, nbytes, ChunkedLocation(crc, chunks))

    def chunks_of(self, key: str) -> list[bytes]:
        """The digests of a numeric tensor's chunks ([] for strings)."""
        info = self.info(key)
        return [] if dtypes.is_string(info.dtype) else list(info.extra.chunks)

    def _pieces(self, info: TensorInfo, view: memoryview) -> Iterator[tuple[bytes, memoryview]]:
        for i, chunk in enumerate(info.extra.chunks):
            yield chunk, view[i * self.chunk_bytes:(i + 1) * self.chunk_bytes]

    def _read_chunk(self, info: TensorInfo, chunk: bytes, piece: memoryview) -> None:
        where = chunk_path(self.directory, chunk)
        try:
            with open(where, "rb", buffering=0) as f:
                got = f.readinto(piece)
                extra = f.read(1)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.path}: tensor {info.key!r}: its chunk {where} is missing",
                                         path=self.path, key=info.key) from None
        except OSError as exc:
            raise CorruptCheckpointError(f"{self.path}: tensor {info.key!r}: cannot read its chunk {where}: "
                                         f"{exc.strerror or exc}", path=self.path, key=info.key) from exc
        if got != len(piece) or extra:
            raise CorruptCheckpointError(f"{self.path}: tensor {info.key!r}: its chunk {where} should hold "
                                         f"{len(piece)} bytes", path=self.path, key=info.key)

    def _read_into(self, info: TensorInfo, out: np.ndarray) -> None:
        location: ChunkedLocation = info.extra
        if dtypes.is_string(info.dtype):
            if _io.crc32c(packb(location.chunks)) != location.crc32c:
                raise checksum_error(self.path, f"tensor {info.key!r}", key=info.key)
            flat = out.reshape(-1)
            for i, item in enumerate(location.chunks):
                flat[i] = item
            return
        view = _io.byte_view(out)
        crc = 0
        for chunk, piece in self._pieces(info, view):
            self._read_chunk(info, chunk, piece)
            crc = _io.crc32c(piece, crc)
        if crc != location.crc32c:
            raise checksum_error(self.path, f"tensor {info.key!r}", crc, location.crc32c, key=info.key)

    def byte_reader(self, key: str) -> Callable[[int, memoryview], None] | None:
        """Reads the chunks holding the bytes asked for (a sharded checkpoint's partial reads,
        which check them against the commit record's block checksums)."""
        info = self.info(key)
        if dtypes.is_string(info.dtype):
            return None
        step = self.chunk_bytes

        def fetch(start: int, out: memoryview) -> None:
            end = start + len(out)
            for i in range(start // step, -(-end // step)):
                lo, hi = i * step, min((i + 1) * step, info.nbytes)
                if start <= lo and hi <= end:  # a whole chunk: straight into place
                    self._read_chunk(info, info.extra.chunks[i], out[lo - start:hi - start])
                    continue
                whole = memoryview(bytearray(hi - lo))
                self._read_chunk(info, info.extra.chunks[i], whole)
                a, b = max(lo, start), min(hi, end)
                out[a - start:b - start] = whole[a - lo:b - lo]
        return fetch

    def verify(self, progress: Callable[[int], None] | None = None) -> list[str]:
        """Every chunk read and its hash checked (naming the chunk file), then every tensor's crc32c."""
        problems = []
        for key, info in self._tensors.items():
            try:
                if not dtypes.is_string(info.dtype):
                    buf = memoryview(bytearray(min(self.chunk_bytes, info.nbytes)))
                    crc = 0
                    for i, chunk in enumerate(info.extra.chunks):
                        piece = buf[:min(self.chunk_bytes, info.nbytes - i * self.chunk_bytes)]
                        self._read_chunk(info, chunk, piece)
                        if digest(piece) != chunk:
                            raise CorruptCheckpointError(
                                f"{self.path}: tensor {key!r}: its chunk {chunk_path(self.directory, chunk)} "
                                "does not match its hash: the chunk is damaged", path=self.path, key=key)
                        crc = _io.crc32c(piece, crc)
                    if crc != info.extra.crc32c:
                        raise checksum_error(self.path, f"tensor {key!r}", crc, info.extra.crc32c, key=key)
                else:
                    self.read(key)
            except CorruptCheckpointError as exc:
                problems.append(str(exc))
            if progress is not None:
                progress(info.nbytes)
        return problems


def referenced_chunks(path: str) -> set[bytes]:
    """Every chunk digest the incremental checkpoint ``path`` references."""
    reader = IncrementalReader(path)
    with reader:
        return {c for key in reader.tensors for c in reader.chunks_of(key)}
