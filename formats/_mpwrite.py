"""The writer of ckpt's msgpack format (its layout, constants and reader: ``formats/msgpack.py``).

Example:
    >>> import numpy as np, tempfile, os
    >>> from ckpt.formats import _mpwrite, msgpack
    >>> from ckpt.storage.localfile import LocalSink
    >>> path = os.path.join(tempfile.mkdtemp(), "t.msgpack")
    >>> with LocalSink(path) as blob:
    ...     _mpwrite.write_msgpack(blob, [("w", np.arange(3, dtype=np.float32))], {})
    >>> with msgpack.MsgpackReader(path) as r:
    ...     r.read("w")
    array([0., 1., 2.], dtype=float32)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ckpt import dtypes
from ckpt.buffers import ALIGN_MIN_BYTES
from ckpt.storage import WritableBlob

from . import _blocks, _io
from ._blocks import checksums
from ._codec import packb
from ._writing import checked_checksums
from .base import materialize, source_chunks
from .msgpack import (
    _FOOTER,
    ARRAY32,
    CODEC,
    COMPRESS_MIN,
    COMPRESSED_VERSION,
    DATA_START,
    FOOTER_MAGIC,
    FORMAT_NAME,
    HEADER_PREFIX,
    MAX_BIN,
    VERSION,
    _bin_header,
    _padding,
)
from ._mpindex import _dtype_name

__all__ = ["write_msgpack"]


def write_msgpack(blob: WritableBlob, tensors: Sequence[tuple[str, Any]], metadata: Mapping[str, Any],
                  block_bytes: int = _blocks.BLOCK_BYTES, max_bin: int = MAX_BIN,
                  compression: str | None = None) -> None:
    """Stream every tensor's buffer into ``blob`` (lazy sources one at a time), then the index;
    the array header's element count (the blob's head: its first write) is filled in last.

    Keys and metadata come validated (``WritableFormat.write_blob``). Tensors over
    ``block_bytes`` get a checksum per block; a tensor over ``max_bin`` bytes is split into
    several bin objects. ``compression="zstd"`` writes a version 4 file whose numeric tensors of
    COMPRESS_MIN bytes and more are stored as compressed byte planes, one chunk (``block_bytes``)
    per bin object.
    """
    path = blob.name
    if compression not in (None, CODEC):
        raise ValueError(f"{path}: unknown compression {compression!r}; the msgpack format offers {CODEC!r}")
    metadata = dict(metadata)
    entries: dict[str, list[Any]] = {}
    blocks: dict[str, bytes] = {}  # the block checksums of tensors over one block
    planes: dict[str, bytes] = {}  # the stored size of each byte plane of compressed tensors
    version = VERSION if compression is None else COMPRESSED_VERSION
    blob.write_at(bytes([ARRAY32, 0, 0, 0, 0]) + HEADER_PREFIX + bytes([version]), 0)  # its count patched last
    runs = _io.Runs(blob)  # small pieces back to back: one pwritev per run
    pos = DATA_START
    objects = 3  # the header, the index and the footer
    for key, source in tensors:
        stream = source_chunks(source)
        if stream is not None:  # a streaming source: its bytes pass through in chunks
            runs.flush()  # chunks come from reused buffers: written at once, after what precedes them
            dtype, shape = np.dtype(source.dtype), tuple(source.shape)
            nbytes, what = _io.expected_nbytes(dtype, shape), f"{path}: tensor {key!r}"
            if compression is not None and _compressible(nbytes, dtype.itemsize, block_bytes):
                running = _blocks.RunningChecksums(block_bytes)
                extents, planes[key], pos = _write_compressed(
                    runs, _stream_blocks(stream, nbytes, block_bytes, running, what), dtype.itemsize, pos)
                objects += len(extents)
                checksum, packed = running.result()
            else:
                known = checked_checksums(source, block_bytes)  # a converted tensor's, checked as it streams
                extents, checksum, packed, pos, written = _write_chunks(blob, stream, nbytes, pos, block_bytes,
                                                                        max_bin, what, known)
                objects += written
            if packed is not None:
                blocks[key] = packed
            entries[key] = [_dtype_name(dtype), list(shape), extents, checksum]
            continue
        if not isinstance(source, np.ndarray):
            runs.flush()  # earlier tensors are written before a lazy source is read
        arr = _io.c_contiguous(materialize(source))
        lent = arr is source  # the caller's own array (not a copy, not a lazy source's): lent to the blob
        if dtypes.is_string(arr.dtype):
            view = memoryview(packb([bytes(x) for x in arr.reshape(-1)]))
            extents = [[pos, len(view)]]
            objects += 1
            runs.write(view, pos)
            pos += len(view)
            checksum = _io.crc32c(view)
        elif compression is not None and _compressible(arr.nbytes, arr.dtype.itemsize, block_bytes):
            view = _io.byte_view(arr)
            crc = checksums(view, block_bytes)  # over the uncompressed bytes; overlaps with compressing
            extents, planes[key], pos = _write_compressed(
                runs, (view[start:start + block_bytes] for start in range(0, len(view), block_bytes)),
                arr.dtype.itemsize, pos)
            objects += len(extents)
            checksum, packed = crc()
            if packed is not None:
                blocks[key] = packed
        else:
            view = _io.byte_view(arr)
            extents = []
            crc = checksums(view, block_bytes)  # overlaps with the writes below
            if len(view) >= ALIGN_MIN_BYTES:  # large tensors start page-aligned (fast copies)
                padding = _padding(pos + len(_bin_header(min(len(view), max_bin))))
                runs.write(padding, pos)
                pos += len(padding)
                objects += bool(padding)
            for start in range(0, max(len(view), 1), max_bin):  # an empty tensor: one empty bin
                piece = view[start:start + max_bin]
                header = _bin_header(len(piece))
                runs.write(header, pos)
                pos += len(header)
                extents.append([pos, len(piece)])
                objects += 1
                runs.write(piece, pos, lent)
                pos += len(piece)
            checksum, packed = crc()
            if packed is not None:
                blocks[key] = packed
        entries[key] = [_dtype_name(arr.dtype), list(arr.shape), extents, checksum]
    fields = {"format": FORMAT_NAME, "version": version, "metadata": metadata,
              "tensors": entries, "block_bytes": block_bytes, "block_crcs": blocks}
    if compression is not None:
        fields.update(compression=compression, compressed=planes)
    index = packb(fields)
    runs.write(index, pos)
    runs.write(_FOOTER.pack(0x94, b"\xc4\x08", FOOTER_MAGIC, 0xCF, pos, 0xCF, len(index), 0xCE,
                            _io.crc32c(index)), pos + len(index))
    runs.flush()
    blob.write_at(objects.to_bytes(4, "big"), 1)  # in the head (the first write): allowed last


def _compressible(nbytes: int, itemsize: int, block_bytes: int) -> bool:
    """Whether a numeric tensor is stored compressed: big enough to pay, and chunks of whole elements."""
    return nbytes >= COMPRESS_MIN and block_bytes % itemsize == 0


def _write_compressed(runs: _io.Runs, chunks: Iterable[memoryview], itemsize: int,
                      pos: int) -> tuple[list[list[int]], bytes, int]:
    """Write a tensor's chunks (``block_bytes`` each, the last shorter) compressed, one bin object
    each; return the extents, the packed stored size of every plane (chunk by chunk) and the new
    position."""
    from ._planes import encode_chunk  # lazy: only compressed tensors need zstandard

    extents: list[list[int]] = []
    sizes: list[int] = []
    for chunk in chunks:
        stored, plane_sizes = encode_chunk(chunk, itemsize)
        header = _bin_header(len(stored))
        runs.write(header, pos)
        runs.write(stored, pos + len(header))
        pos += len(header)
        extents.append([pos, len(stored)])
        pos += len(stored)
        sizes.extend(plane_sizes)
    return extents, np.asarray(sizes, "<u4").tobytes(), pos


def _stream_blocks(stream: Iterator[memoryview], nbytes: int, block_bytes: int, running: _blocks.RunningChecksums,
                   what: str) -> Iterator[memoryview]:
    """A streamed tensor's bytes cut into chunks of ``block_bytes`` (the last shorter), each added
    to ``running`` as it passes. A chunk is a view of the stream's piece when one holds it whole,
    else of a buffer reused for the next: the caller is done with a chunk when it asks for the next.

    Raises:
        ValueError: the stream gives more or fewer than ``nbytes`` bytes (``what`` names the tensor).
    """
    buf = memoryview(bytearray(min(block_bytes, nbytes)))
    filled = done = 0
    for view in stream:
        done += len(view)
        if done > nbytes:
            raise ValueError(f"{what} gave more than the {nbytes} bytes its dtype and shape hold")
        start = 0
        while start < len(view):
            if not filled and len(view) - start >= block_bytes:  # a whole chunk in the piece: no copy
                chunk, start = view[start:start + block_bytes], start + block_bytes
            else:
                take = min(block_bytes - filled, len(view) - start)
                buf[filled:filled + take] = view[start:start + take]
                filled, start = filled + take, start + take
                if filled < block_bytes:
                    continue
                chunk, filled = buf, 0
            running.update(chunk)
            yield chunk
    if done != nbytes:
        raise ValueError(f"{what} gave {done} bytes; its dtype and shape hold {nbytes}")
    if filled:
        running.update(buf[:filled])
        yield buf[:filled]


def _write_chunks(blob: WritableBlob, stream: Iterator[memoryview], nbytes: int, pos: int, block_bytes: int,
                  max_bin: int, what: str, known: tuple[int, bytes | None] | None = None
                  ) -> tuple[list[list[int]], int, bytes | None, int, int]:
    """Write a streamed numeric tensor as ``write`` lays out an array (padding, bins of at most
    ``max_bin`` bytes); return its extents, crc32c, packed block checksums, the new position and
    the number of msgpack objects written. ``known``: the checksums the stream's source checked
    its bytes against (``checked_checksums``), stored instead of computed again."""
    objects = 0
    if nbytes >= ALIGN_MIN_BYTES:  # large tensors start page-aligned (fast copies)
        padding = _padding(pos + len(_bin_header(min(nbytes, max_bin))))
        blob.write_at(padding, pos)
        pos += len(padding)
        objects += bool(padding)
    running = _blocks.RunningChecksums(block_bytes)
    extents: list[list[int]] = []
    done = 0

    def open_bin() -> None:  # the bin header of the bytes from `done` on
        nonlocal pos, objects
        header = _bin_header(min(max_bin, nbytes - done))
        blob.write_at(header, pos)
        pos += len(header)
        extents.append([pos, min(max_bin, nbytes - done)])
        objects += 1

    if not nbytes:
        open_bin()  # an empty tensor: one empty bin
    for view in stream:
        start = 0
        while start < len(view):
            if done >= nbytes:
                raise ValueError(f"{what} gave more than the {nbytes} bytes its dtype and shape hold")
            if done % max_bin == 0:
                open_bin()
            take = min(len(view) - start, max_bin - done % max_bin, nbytes - done)
            piece = view[start:start + take]
            if known is None:
                _io.write_checked(blob, piece, pos, running.update)
            else:
                blob.write_at(piece, pos)
            done, pos, start = done + take, pos + take, start + take
    if done != nbytes:
        raise ValueError(f"{what} gave {done} bytes; its dtype and shape hold {nbytes}")
    checksum, packed = running.result() if known is None else known
    return extents, checksum, packed, pos, objects
