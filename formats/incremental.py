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
from ckpt.storage import ReadableBlob
from ckpt.errors import CorruptCheckpointError, UnsupportedCheckpointError, checksum_error

from . import _io
from ._codec import packb, unpack
from .base import FileReader, open_folder, TensorInfo, check_metadata, check_shape, dtype_or_raise, key_problem

FORMAT_NAME = "ckpt-incremental"
VERSION = 1
#: The chunk store's folder, beside the checkpoint files that reference it.
CHUNK_DIR = ".ckpt-chunks"
HASH = "sha256"
DIGEST_BYTES = 32
#: ``verify`` reads up to this many bytes of chunks at once (an object store's GETs side by side).
_VERIFY_BYTES = 16 << 20
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


def pack_index(metadata: dict[str, Any], chunk_bytes: int, tensors: dict[str, list[Any]]) -> bytes:
    """The bytes of an incremental checkpoint file."""
    index = packb({"format": FORMAT_NAME, "version": VERSION, "metadata": metadata, "chunk_dir": CHUNK_DIR,
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
        if chunk_dir != CHUNK_DIR:
            raise CorruptCheckpointError(f"{path}: the index names chunk folder {chunk_dir!r}, not {CHUNK_DIR!r}")
        self.directory = os.path.dirname(path)
        self._chunks = open_folder(self._source, chunk_dir)  # through the checkpoint's own store
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

    def _read_chunks(self, info: TensorInfo, pieces: list[tuple[bytes, memoryview]]) -> None:
        """Fill each piece with its chunk, read through the checkpoint's own store (several at once
        where it allows: an object store's GETs side by side)."""
        problems = self._chunks.read_objects([(chunk.hex(), piece) for chunk, piece in pieces])
        for (chunk, _), problem in zip(pieces, problems):
            if problem is not None:
                raise CorruptCheckpointError(f"{self.path}: tensor {info.key!r}: its chunk "
                                             f"{self._chunks.where(chunk.hex())} {problem}",
                                             path=self.path, key=info.key)

    def chunk_location(self, chunk: bytes) -> str:
        """The path or URL of the chunk ``chunk`` (a digest) this checkpoint reads."""
        return self._chunks.where(chunk.hex())

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
        pieces = list(self._pieces(info, view))
        self._read_chunks(info, pieces)
        crc = 0
        for _, piece in pieces:
            crc = _io.crc32c(piece, crc)
        if crc != location.crc32c:
            raise checksum_error(self.path, f"tensor {info.key!r}", crc, location.crc32c, key=info.key)

    def verify(self, progress: Callable[[int], None] | None = None) -> list[str]:
        """Every chunk read and its hash checked (naming the chunk file), then every tensor's crc32c."""
        problems = []
        for key, info in self._tensors.items():
            try:
                if not dtypes.is_string(info.dtype):
                    chunks = info.extra.chunks
                    step = max(1, _VERIFY_BYTES // self.chunk_bytes)  # chunks read at once
                    buf = memoryview(bytearray(min(self.chunk_bytes * step, info.nbytes)))
                    crc = 0
                    for first in range(0, len(chunks), step):
                        start = first * self.chunk_bytes
                        pieces = list(zip(chunks[first:first + step], (
                            buf[i * self.chunk_bytes - start:min((i + 1) * self.chunk_bytes, info.nbytes) - start]
                            for i in range(first, min(first + step, len(chunks))))))
                        self._read_chunks(info, pieces)
                        for chunk, piece in pieces:
                            if digest(piece) != chunk:
                                raise CorruptCheckpointError(
                                    f"{self.path}: tensor {key!r}: its chunk {self.chunk_location(chunk)} "
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


def referenced_chunks(path: str, blob: ReadableBlob | None = None) -> set[bytes]:
    """Every chunk digest the incremental checkpoint ``path`` (read from ``blob``, which this then
    owns, where given) references."""
    try:
        reader = IncrementalReader(path, blob)
    except BaseException:
        if blob is not None:
            blob.close()
        raise
    with reader:
        return {c for key in reader.tensors for c in reader.chunks_of(key)}
