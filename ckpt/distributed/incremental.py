"""Incremental sharded saves (``Saver(comm=..., incremental=True)``): each rank's shard file is an
index over the chunk store beside the checkpoint's directory, shared with every checkpoint there.

The collective save runs as any sharded save (ckpt/distributed/save.py), with three differences:

- rank 0 holds the directory's state lock from before the ranks may write (the verdict) until the
  commit, retention and chunk collection are done, so no collection (of this save or of another
  saver in the directory) deletes a chunk a rank found present and is about to reference;
- each rank writes the chunks of its blocks the store lacks (create-only: two ranks writing one
  chunk is harmless), fsyncs the chunk folder, then writes its index as its shard file (atomically)
  and reports each block's CRC-32C per 1 MiB computed from the bytes it hashed, so the commit record
  lets any number of ranks read part of a block (the index reader resolves bytes to chunks);
- after the commit rank 0 deletes every chunk no checkpoint of the directory references.

A kill at any moment leaves at most unreferenced chunks (and an uncommitted directory), which
the next save removes and collects.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckpt import dtypes
from ckpt.formats import _io
from ckpt.formats._blocks import block_crcs
from ckpt.saving.incremental import Encoding, IncrementalStats, chunked_format, collect_chunks, write_chunks
from ckpt.storage.local import LocalStore

__all__ = ["IncrementalJob", "write_index_shard", "collect"]


@dataclass
class IncrementalJob:
    """What an incremental sharded save needs: the chunk size, whether this save writes
    self-contained shard files (``full_every``), how chunks are encoded, and the stats it fills in
    (this rank's chunks and index entries; rank 0's collection)."""

    chunk_bytes: int
    full: bool = False
    stats: IncrementalStats = field(default_factory=IncrementalStats)
    #: compression and delta chains; ``previous`` is this rank's entries of its last save, keyed
    #: by block key (a delta's base is checked present and its bytes rebuilt before it is used)
    encoding: Encoding = field(default_factory=Encoding)


def write_index_shard(files: LocalStore, name: str, blocks: list[Any], job: IncrementalJob) -> tuple[int, list[Any]]:
    """Write the chunks of ``blocks`` (a rank's ``LazyBlock``s, each read once here) to the chunk store
    beside the checkpoint directory ``files``, then the index as shard file ``name``; return its size
    and the report's blocks ``[key, offset, shape, nbytes, crcs]``."""
    fmt = chunked_format()
    crcs: dict[str, list[int] | None] = {}

    def arrays() -> Iterator[tuple[str, np.ndarray]]:
        for block in blocks:
            array = _io.c_contiguous(np.asarray(block))
            # the commit record's checksums, from the bytes hashed into chunks (not read back)
            crcs[block.key] = None if dtypes.is_string(array.dtype) else block_crcs(_io.byte_view(array))
            yield block.key, array

    parent = os.path.dirname(os.path.abspath(files.location))
    entries, packs = write_chunks(fmt, parent, arrays(), job.chunk_bytes, job.stats, files.location, job.encoding)
    data = fmt.pack_index({}, job.chunk_bytes, entries, nested=True, packs=packs)
    report: list[Any] = []

    def check(written: Any) -> None:  # the sizes as a reader of the written index sees them
        with fmt.open(written.name, written) as reader:
            for block in blocks:
                report.append([block.key, list(block.offset), list(block.shape), reader.tensors[block.key].nbytes,
                               crcs[block.key]])

    size = files.write_file(name, lambda blob: blob.write_at(data, 0), check)
    job.stats.entries = entries  # the next save's delta bases
    return size, report


def collect(directory: str, job: IncrementalJob) -> None:
    """Rank 0, under the directory's lock after the commit and retention: delete the chunks no
    checkpoint of ``directory`` references."""
    job.stats.chunks_collected = collect_chunks(LocalStore(directory))
