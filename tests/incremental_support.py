"""Shared helpers for the incremental tests: where a chunk's stored bytes are, and damage to them.

A local incremental save (index version 3) stores each chunk as a byte range of a pack file of
the chunk store; versions 1 and 2 and object-store saves store it as a file of its own. The tests
damage a chunk through ``IncrementalReader.stored_at``, whichever way it is stored, and count the
files of the store a checkpoint references (``references_at``: pack ids and chunk files).

Imported by the tests (tests/conftest.py puts tests/ on sys.path).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ckpt.formats import _codec, _io
from ckpt.formats import ckpt_sharded as sharded
from ckpt.formats.base import ChunkedFormat, get_format
from ckpt.formats.incremental import CHUNK_DIR, IncrementalReader
from ckpt.saving.incremental import references_at


def index_files(path: str) -> list[str]:
    """The index files of the checkpoint ``path``: itself, or a sharded checkpoint's shard files."""
    if os.path.isdir(path):
        return [os.path.join(path, n) for n in sorted(os.listdir(path)) if sharded.is_shard_file(n)]
    return [path]


def stored_at(path: str, name: bytes) -> tuple[str, int, int]:
    """Where the checkpoint ``path`` reads the chunk ``name``'s stored bytes: (the file holding
    them, their offset in it, their length; a chunk stored as a file of its own is all of it)."""
    for index in index_files(path):
        with IncrementalReader(index) as reader:
            if name in reader.located or any(name in reader.chunks_of(k) for k in reader.tensors):
                where, offset, length = reader.stored_at(name)
                return where, offset, os.path.getsize(where) - offset if length is None else length
    raise AssertionError(f"{path} does not reference the chunk {name.hex()}")


def flip(path: str, name: bytes, at: int = 0, count: int = 1, mask: int = 0xFF) -> str:
    """Damage the chunk ``name`` of the checkpoint ``path`` in place: XOR ``count`` of its stored
    bytes from its byte ``at`` with ``mask``. Returns the file damaged."""
    where, offset, length = stored_at(path, name)
    assert 0 <= at and at + count <= length, (at, count, length)
    with open(where, "r+b") as f:
        f.seek(offset + at)
        data = f.read(count)
        f.seek(offset + at)
        f.write(bytes(b ^ mask for b in data))
    return where


def cut(path: str, name: bytes, keep: int = 0) -> str:
    """Truncate the file holding the chunk ``name`` of the checkpoint ``path`` after the first
    ``keep`` of its stored bytes (0: the file ends just before it). Returns the file cut."""
    where, offset, length = stored_at(path, name)
    assert 0 <= keep < length
    os.truncate(where, offset + keep)
    return where


def remove(path: str, name: bytes) -> str:
    """Delete the file holding the chunk ``name`` of the checkpoint ``path`` (its pack: every
    chunk in it goes). Returns the file deleted."""
    where, _, _ = stored_at(path, name)
    os.remove(where)
    return where


def chunks_in(path: str, where: str) -> set[bytes]:
    """The chunks the checkpoint ``path`` reads from the file ``where``."""
    return {n for index in index_files(path) for n in _names(index) if stored_at(path, n)[0] == where}


def keys_reading(path: str, where: str, past: int = 0) -> set[str]:
    """The tensors of the checkpoint ``path`` (an index file) that read bytes of the file ``where``
    (``past``: bytes after its first ``past``; what a cut there takes from them)."""
    with IncrementalReader(path) as reader:
        placed = {n: reader.stored_at(n) for k in reader.tensors for n in reader.chunks_of(k)}
        return {k for k in reader.tensors for n in reader.chunks_of(k)
                if placed[n][0] == where and placed[n][1] + (placed[n][2] or 1) > past}


def problem_keys(problems: Iterable[str]) -> set[str]:
    """The tensors ``ckpt.verify`` problems name (``<path>: tensor '<key>': ...``)."""
    return {p.split(": tensor '", 1)[1].split("'", 1)[0] for p in problems}


def referenced_files(directory: str, names: Iterable[str]) -> set[str]:
    """The files of ``directory``'s chunk store (hex names: pack ids and chunk files) the
    checkpoints ``names`` reference."""
    fmt = get_format("ckpt-incremental")
    assert isinstance(fmt, ChunkedFormat)
    return {c.hex() for n in names for c in references_at(fmt, os.path.join(directory, n)) or set()}


def store_files(directory: str) -> set[str]:
    """The files in ``directory``'s chunk store."""
    return set(os.listdir(os.path.join(directory, CHUNK_DIR)))


def file_bytes(directory: str, files: Iterable[str]) -> int:
    """The size of the files ``files`` (hex names) of ``directory``'s chunk store, together."""
    return sum(os.path.getsize(os.path.join(directory, CHUNK_DIR, f)) for f in files)


def _names(index: str) -> set[bytes]:
    with IncrementalReader(index) as reader:
        return {n for k in reader.tensors for n in reader.chunks_of(k)}


def as_version_2(path: str) -> None:
    """Rewrite the incremental checkpoint ``path`` (an index file of this directory's store) as
    version 2 wrote it: every chunk it reads a file of its own (``.ckpt-chunks/<name hex>``), the
    index without a pack table. The packs stay (other checkpoints may read them)."""
    with open(path, "rb") as f:
        header, packed, _ = _codec.unpack(f.read(), path, "the file")
    index = dict(_codec.unpack(packed, path, "the index"))
    with IncrementalReader(path) as reader:
        names = {n for k in reader.tensors for n in reader.chunks_of(k)}
        stored = {n: reader.stored_at(n) for n in names}
    for name, (where, offset, length) in stored.items():
        with open(where, "rb") as f:
            f.seek(offset)
            data = f.read(-1 if length is None else length)
        with open(os.path.join(os.path.dirname(where), name.hex()), "wb") as f:
            f.write(data)
    index["version"] = header["version"] = 2
    del index["packs"]
    packed = _codec.packb(index)
    with open(path, "wb") as f:
        f.write(_codec.packb([header, packed, _io.crc32c(packed)]))
