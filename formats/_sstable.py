"""The pieces of TensorFlow's checkpoint index decoded in pure Python: protobuf wire format,
LevelDB-style SSTable blocks (TensorFlow's ``table`` format) and snappy-compressed blocks.

Only what reading a tensor bundle's ``.index`` file needs, with every length checked
against the bytes actually present. Errors are ``SSTableError``; the caller names the file.

Example:
    >>> list(fields(b"\\x08\\x96\\x01"))
    [(1, 0, 150)]
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

from ckpt.storage import ReadableBlob

from . import _io

#: The last 8 bytes of every table (LevelDB's magic number, little-endian).
TABLE_MAGIC = struct.pack("<Q", 0xDB4775248B80FB57)
FOOTER_SIZE = 48
_BLOCK_TRAILER = 5  # compression type byte + masked crc32c
_NO_COMPRESSION, _SNAPPY = 0, 1
_MASK_DELTA = 0xA282EAD8


class SSTableError(ValueError):
    """The bytes break the table, protobuf or snappy format (the message says how)."""


def unmask(masked: int) -> int:
    """Undo LevelDB's crc32c masking (stored checksums are masked)."""
    rot = (masked - _MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


def mask(crc: int) -> int:
    """LevelDB's crc32c masking."""
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def varint(buf: bytes, pos: int) -> tuple[int, int]:
    """Decode a base-128 varint at ``pos``; return (value, next position)."""
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise SSTableError("a varint runs past the end of its data")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise SSTableError("a varint is longer than 10 bytes")


def fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """Yield (field number, wire type, value) of a protobuf message: ints, or bytes for
    length-delimited fields."""
    pos = 0
    while pos < len(buf):
        tag, pos = varint(buf, pos)
        number, wire = tag >> 3, tag & 7
        value: int | bytes
        if wire == 0:
            value, pos = varint(buf, pos)
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            if pos + width > len(buf):
                raise SSTableError("a fixed-width field runs past the end of its message")
            value = int.from_bytes(buf[pos:pos + width], "little")
            pos += width
        elif wire == 2:
            n, pos = varint(buf, pos)
            if pos + n > len(buf):
                raise SSTableError("a length-delimited field runs past the end of its message")
            value, pos = buf[pos:pos + n], pos + n
        else:
            raise SSTableError(f"unsupported protobuf wire type {wire}")
        if number == 0:
            raise SSTableError("protobuf field number 0")
        yield number, wire, value


def int64(value: int) -> int:
    """A varint read as a (two's complement) int64."""
    return value - (1 << 64) if value >= 1 << 63 else value


def snappy_decompress(data: bytes) -> bytes:
    """Decompress a raw snappy block (index blocks are small; pure Python is fast enough)."""
    length, pos = varint(data, 0)
    # a 3-byte copy yields at most 64 bytes, so no valid block expands more than 64/3 times
    if length > len(data) * 22:
        raise SSTableError(f"a snappy block claims {length} bytes from {len(data)} compressed bytes")
    out = bytearray()
    while pos < len(data):
        tag = data[pos]
        pos += 1
        kind = tag & 3
        if kind == 0:  # literal
            n = tag >> 2
            if n >= 60:
                width = n - 59
                n = int.from_bytes(data[pos:pos + width], "little")
                pos += width
            n += 1
            if pos + n > len(data):
                raise SSTableError("a snappy literal runs past the end of the block")
            out += data[pos:pos + n]
            pos += n
            continue
        if kind == 1:
            n, offset = ((tag >> 2) & 7) + 4, (tag >> 5) << 8 | (data[pos] if pos < len(data) else 0)
            pos += 1
        else:
            width = 2 if kind == 2 else 4
            n, offset = (tag >> 2) + 1, int.from_bytes(data[pos:pos + width], "little")
            pos += width
        if pos > len(data) or offset == 0 or offset > len(out):
            raise SSTableError("a snappy copy refers outside the decompressed data")
        if len(out) + n > length:
            break
        start = len(out) - offset
        if offset >= n:
            out += out[start:start + n]
        else:  # a copy overlapping its own output repeats the last ``offset`` bytes
            out += (out[start:] * (n // offset + 1))[:n]
    if len(out) != length:
        raise SSTableError(f"a snappy block decompresses to {len(out)} bytes, not the {length} it declares")
    return bytes(out)


def _block_handle(buf: bytes, pos: int) -> tuple[int, int, int]:
    offset, pos = varint(buf, pos)
    size, pos = varint(buf, pos)
    return offset, size, pos


def read_block(source: ReadableBlob, file_size: int, offset: int, size: int) -> bytes:
    """Read a block and its trailer, verify the trailer's checksum, decompress if needed."""
    if offset + size + _BLOCK_TRAILER > file_size:
        raise SSTableError(f"a block at offset {offset} (+{size} bytes) lies outside the {file_size}-byte file")
    raw = _io.pread(source, offset, size + _BLOCK_TRAILER, "an index block")
    contents, kind = raw[:size], raw[size]
    (stored,) = struct.unpack_from("<I", raw, size + 1)
    if _io.crc32c(raw[:size + 1]) != unmask(stored):
        raise SSTableError(f"the block at offset {offset} fails its checksum")
    if kind == _SNAPPY:
        return snappy_decompress(contents)
    if kind != _NO_COMPRESSION:
        raise SSTableError(f"the block at offset {offset} uses unknown compression type {kind}")
    return contents


def block_entries(block: bytes) -> Iterator[tuple[bytes, bytes]]:
    """Yield (key, value) of a block: prefix-compressed keys, then the restart array."""
    if len(block) < 4:
        raise SSTableError("a block is too short for its restart count")
    (restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    end = len(block) - 4 - 4 * restarts
    if end < 0:
        raise SSTableError(f"a block of {len(block)} bytes claims {restarts} restart points")
    pos, key = 0, b""
    while pos < end:
        shared, pos = varint(block, pos)
        unshared, pos = varint(block, pos)
        n, pos = varint(block, pos)
        if shared > len(key) or pos + unshared + n > end:
            raise SSTableError("a block entry runs past the end of its block")
        key = key[:shared] + block[pos:pos + unshared]
        pos += unshared
        yield key, block[pos:pos + n]
        pos += n


def table_entries(source: ReadableBlob) -> Iterator[tuple[bytes, bytes]]:
    """Yield every (key, value) of an SSTable file, in key order."""
    size = source.size
    if size < FOOTER_SIZE:
        raise SSTableError(f"{size} bytes is too short for a table (footer is {FOOTER_SIZE} bytes)")
    footer = _io.pread(source, size - FOOTER_SIZE, FOOTER_SIZE, "the footer")
    if footer[-8:] != TABLE_MAGIC:
        raise SSTableError("the footer has no table magic number: not a TensorFlow index, or truncated")
    _, _, pos = _block_handle(footer, 0)  # the metaindex block holds nothing TensorFlow uses
    index_offset, index_size, _ = _block_handle(footer, pos)
    end = 0
    for _, handle in block_entries(read_block(source, size, index_offset, index_size)):
        offset, block_size, _ = _block_handle(handle, 0)
        # a table's data blocks follow each other: each is read (and decompressed) once, so the
        # work is bounded by the file's size, however many entries point at one block
        if offset < end:
            raise SSTableError(f"the index points at a block at offset {offset}, inside or before the "
                               f"block that ends at {end}: data blocks are stored one after another")
        end = offset + block_size + _BLOCK_TRAILER
        yield from block_entries(read_block(source, size, offset, block_size))
