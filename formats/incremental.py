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
crc32c is over the tensor's bytes (over the packed list of items for strings). Version 3 adds
``"packs"``: where the chunks a local save wrote live in its pack files (``_packs``); a chunk it
does not list is a file of its own. docs/formats.md specifies it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ckpt import dtypes
from ckpt.checksums import crc32c_combine
from ckpt.storage import ReadableBlob
from ckpt.errors import CorruptCheckpointError, UnsupportedCheckpointError, checksum_error

from . import _io
from ._codec import packb, unpack
from ._chunkcodec import ChunkEncoding, PARALLEL_BYTES, assemble, chain_of, decode_into, digest, links
from ._packs import Location, PackedFolder, pack_table, read_pack_table
from .base import FileReader, TensorInfo, check_metadata, index_entry, open_folder

if TYPE_CHECKING:
    from concurrent.futures import Future

FORMAT_NAME = "ckpt-incremental"
#: version 2 adds delta chains and encoded chunk files, version 3 pack files; versions 1 (whole raw
#: chunks) and 2 still read
VERSION = 3
READS = (1, 2, 3)
#: Default bound on a delta chain (deltas between a chunk and the whole chunk it rests on): with
#: 1% of a table's rows changing per save, 8 writes 13.2% in every save, 16 7.0%, so 16
#: (docs/incremental.md); a restore reads up to max_chain + 1 stored chunks per chunk.
MAX_CHAIN = 16
#: a longer chain in an index is damage, not a save's (max_chain is a small int)
_LONGEST = 1 << 10
#: The chunk store's folder, beside the checkpoint files that reference it.
CHUNK_DIR = ".ckpt-chunks"
#: A shard file's chunk folder: the store beside its sharded checkpoint's directory.
NESTED_CHUNK_DIR = "../" + CHUNK_DIR
HASH = "sha256"
DIGEST_BYTES = 32
#: A read fetches up to this many bytes of chunks at once, side by side (a cold 1 GiB restore from
#: disk: 0.80 s in groups of 16 MiB, 0.67 s of 64 MiB, 0.68 s of 256 MiB).
_GROUP_BYTES = 64 << 20
#: Chunks whose files are held in memory (delta chains: max_chain + 1 files each; ``verify``): this many bytes at once.
_BATCH_BYTES = 16 << 20
HEAD = b"\x93\x82\xa6format\xb0" + FORMAT_NAME.encode() + b"\xa7version"


def is_incremental(head: bytes) -> bool:
    """True when ``head`` (a file's first bytes) starts an incremental checkpoint's index."""
    return head.startswith(HEAD)


def tensor_entry(array: np.ndarray, chunk_bytes: int, put: Callable[[bytes, bytes | memoryview], None],
                 encoding: ChunkEncoding | None = None, previous: list[Any] | None = None,
                 note: dict[bytes, Any] | None = None) -> list[Any]:
    """The index entry of ``array``: a numeric tensor's bytes cut into chunks of ``chunk_bytes``,
    each stored with ``put(name, stored bytes)`` unless the store holds it (``encoding`` says
    how; ``previous``, the tensor's entry in the previous save, gives the bases of deltas;
    ``note`` receives this save's notes for the next, see ChunkEncoding); a string tensor's
    items inline. A large tensor's chunks are handled side by side on the I/O threads (``put``
    is then called from several threads); every one is done when this returns."""
    arr = _io.c_contiguous(array)
    name = dtypes.dtype_name(arr.dtype)
    if dtypes.is_string(arr.dtype):
        items = [bytes(x) for x in arr.reshape(-1)]
        return [name, list(arr.shape), _io.crc32c(packb(items)), items]
    enc = ChunkEncoding() if encoding is None else encoding
    same = previous is not None and previous[0] == name and list(previous[1]) == list(arr.shape)
    bases: list[Any] = list(previous[3]) if same and previous is not None else []
    view = _io.byte_view(arr)
    jobs = [(view[start:start + chunk_bytes], arr.dtype.itemsize, bases[i] if bases else None, put, i)
            for i, start in enumerate(range(0, len(view), chunk_bytes))]
    if len(view) >= PARALLEL_BYTES and len(jobs) > 1:
        results = _io.side_by_side(enc.chunk, jobs)
    else:
        results = [enc.chunk(*job) for job in jobs]
    if note is not None:
        note.update((chain_of(ref)[0], memo) for ref, _, memo in results if memo is not None)
    if all(piece_crc is None for _, piece_crc, _ in results) and previous is not None and results:
        return [name, list(arr.shape), previous[2], [ref for ref, _, _ in results]]  # every chunk unchanged
    crc = 0
    for (piece, *_), (_, piece_crc, _) in zip(jobs, results):
        crc = crc32c_combine(crc, _io.crc32c(piece) if piece_crc is None else piece_crc, len(piece))
    return [name, list(arr.shape), crc, [ref for ref, _, _ in results]]


def entry_files(entry: list[Any], dtype: np.dtype, shape: tuple[int, ...], chunk_bytes: int) -> \
        tuple[int, list[bytes]] | None:
    """The crc32c and the chunk files (every link of every chain) of ``entry``, a numeric tensor's
    entry as ``tensor_entry`` makes it for ``dtype``, ``shape`` and ``chunk_bytes``; None for any
    other entry (a string tensor's, another dtype, shape or chunk count)."""
    if dtypes.is_string(dtype) or len(entry) != 4 or entry[0] != dtypes.dtype_name(dtype) \
            or list(entry[1]) != list(shape) or type(entry[2]) is not int:
        return None
    nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    if len(entry[3]) != -(-nbytes // chunk_bytes) or not all(map(_valid_ref, entry[3])):
        return None
    return entry[2], [name for ref in entry[3] for name in links(ref)]


def pack_index(metadata: dict[str, Any], chunk_bytes: int, tensors: dict[str, list[Any]],
               nested: bool = False, packs: dict[bytes, Location] | None = None) -> bytes:
    """The bytes of an incremental checkpoint file (``nested``: a shard file of a sharded checkpoint,
    whose chunks are in the store beside the checkpoint's directory; ``packs``: where the chunks
    stored in pack files are, by name)."""
    chunk_dir = NESTED_CHUNK_DIR if nested else CHUNK_DIR
    located = packs or {}
    names = {name for entry in tensors.values() if not dtypes.is_string(dtypes.as_dtype(entry[0]))
             for ref in entry[3] for name in links(ref) if name in located}
    index = packb({"format": FORMAT_NAME, "version": VERSION, "metadata": metadata, "chunk_dir": chunk_dir,
                   "chunk_bytes": chunk_bytes, "hash": HASH, "tensors": tensors,
                   "packs": pack_table({name: located[name] for name in names})})
    return packb([{"format": FORMAT_NAME, "version": VERSION}, index, _io.crc32c(index)])


class ChunkedLocation(NamedTuple):
    """A tensor's chunks (TensorInfo.extra of IncrementalReader)."""

    crc32c: int
    #: the reference of each chunk of a numeric tensor (a digest, or a chain of digests); the
    #: items of a string tensor
    chunks: list[Any]


def _valid_ref(ref: Any) -> bool:
    if type(ref) is bytes:
        return len(ref) == DIGEST_BYTES
    return (type(ref) is list and 2 <= len(ref) <= _LONGEST
            and all(type(d) is bytes and len(d) == DIGEST_BYTES for d in ref))


class IncrementalReader(FileReader):
    """Reads the index on open; tensors from the chunk store on request (crc32c checked),
    ``verify`` checks every chunk's hash along its whole delta chain and names the chunk file
    that fails."""

    format_name = "ckpt-incremental"

    def _open(self) -> None:
        path, size = self.path, self._source.size
        raw = _io.pread(self._source, 0, size, "the index")
        outer = unpack(raw, path, "the file")
        if type(outer) is not list or len(outer) != 3 or type(outer[1]) is not bytes or type(outer[2]) is not int:
            raise CorruptCheckpointError(f"{path}: not an incremental checkpoint index (bad framing)")
        header, packed, crc = outer
        if not isinstance(header, dict) or header.get("version") not in READS:
            raise UnsupportedCheckpointError(f"{path}: incremental checkpoint version {header.get('version')!r} "
                                             f"(this ckpt reads versions {', '.join(map(str, READS))})")
        self.version: int = header["version"]
        if _io.crc32c(packed) != crc:
            raise checksum_error(path, "the index")
        index = unpack(packed, path, "the index")
        if not isinstance(index, dict) or index.get("hash") != HASH or type(index.get("tensors")) is not dict:
            raise CorruptCheckpointError(f"{path}: the index is not an incremental checkpoint index")
        chunk_bytes = index.get("chunk_bytes")
        if type(chunk_bytes) is not int or chunk_bytes <= 0:
            raise CorruptCheckpointError(f"{path}: the index's chunk_bytes {chunk_bytes!r} is not a positive int")
        self.chunk_bytes: int = chunk_bytes
        self.group_bytes = _GROUP_BYTES  #: a read's chunk bytes at once (``verify``: ``_BATCH_BYTES``)
        chunk_dir = index.get("chunk_dir")
        if chunk_dir not in (CHUNK_DIR, NESTED_CHUNK_DIR):
            raise CorruptCheckpointError(f"{path}: the index names chunk folder {chunk_dir!r}, not {CHUNK_DIR!r} "
                                         f"(or {NESTED_CHUNK_DIR!r} in a sharded checkpoint)")
        #: the directory holding the chunk folder
        self.directory = os.path.dirname(path) if chunk_dir == CHUNK_DIR else \
            os.path.normpath(os.path.join(os.path.dirname(path), os.pardir))
        #: where the chunks stored in pack files are (name -> (pack id, offset, length))
        self.located: dict[bytes, Location] = \
            read_pack_table(index.get("packs", []), path, chunk_bytes) if self.version >= 3 else {}
        self._folder = open_folder(self._source, chunk_dir)  # through the checkpoint's own store
        self._chunks = PackedFolder(self._folder, self.located) if self.located else self._folder
        self._metadata = check_metadata(index.get("metadata", {}), path)
        self._tensors = {key: self._entry(key, entry) for key, entry in index["tensors"].items()}

    def _entry(self, key: Any, entry: Any) -> TensorInfo:
        path = self.path
        dtype, shape, crc, chunks = index_entry(key, entry, path)
        if type(crc) is not int or type(chunks) is not list:
            raise CorruptCheckpointError(f"{path}: tensor {key!r}: malformed chunks or checksum")
        if dtypes.is_string(dtype):
            if not all(type(c) is bytes for c in chunks):
                raise CorruptCheckpointError(f"{path}: tensor {key!r}: malformed chunks or checksum")
            if len(chunks) != int(np.prod(shape)):
                raise CorruptCheckpointError(f"{path}: tensor {key!r}: {list(shape)} needs {int(np.prod(shape))} "
                                             f"strings, the index holds {len(chunks)}")
            return TensorInfo(key, dtype, shape, sum(map(len, chunks)), ChunkedLocation(crc, chunks))
        nbytes = _io.expected_nbytes(dtype, shape)
        refs_ok = all(type(c) is bytes and len(c) == DIGEST_BYTES for c in chunks) if self.version == 1 \
            else all(map(_valid_ref, chunks))
        if len(chunks) != -(-nbytes // self.chunk_bytes) or not refs_ok:
            raise CorruptCheckpointError(f"{path}: tensor {key!r}: {nbytes} bytes need "
                                         f"{-(-nbytes // self.chunk_bytes)} chunk references (a {DIGEST_BYTES}-byte "
                                         "digest or a chain of them)")
        return TensorInfo(key, dtype, shape, nbytes, ChunkedLocation(crc, chunks))

    def chunks_of(self, key: str) -> list[bytes]:
        """The names of every chunk file a numeric tensor reads, deltas and their bases included
        ([] for strings); a file is ``.ckpt-chunks/<name.hex()>``."""
        info = self.info(key)
        return [] if dtypes.is_string(info.dtype) else [n for ref in info.extra.chunks for n in links(ref)]

    def close(self) -> None:
        try:
            close = getattr(getattr(self, "_chunks", None), "close", None)
            if close is not None:
                close()
        finally:
            super().close()

    def files_of(self, key: str) -> set[bytes]:
        """The names of the files in the chunk store a numeric tensor reads: its packs' ids and
        the names of its chunks stored as files of their own."""
        return {self.located[n][0] if n in self.located else n for n in self.chunks_of(key)}

    def stored_at(self, name: bytes) -> tuple[str, int, int | None]:
        """Where the chunk file ``name``'s stored bytes are: (the path or URL of the file holding
        them, their offset in it, their length; None: the whole file, a chunk of its own)."""
        if name in self.located:
            pack, offset, length = self.located[name]
            return self._folder.where(pack.hex()), offset, length
        return self._folder.where(name.hex()), 0, None

    def chunk_location(self, name: bytes) -> str:
        """Where the chunk ``name`` this checkpoint reads is: its file's path or URL, or its bytes
        in a pack file."""
        return self._chunks.where(name.hex())

    def _damaged(self, info: TensorInfo, name: bytes, problem: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.path}: tensor {info.key!r}: its chunk {self.chunk_location(name)} "
                                      f"{problem}", path=self.path, key=info.key)

    def _loader(self, info: TensorInfo, refs: list[Any]) -> Callable[[bytes], memoryview]:
        """The stored bytes of every file of the chunks ``refs`` (whole, of any length), fetched at once."""
        stored = self._whole(refs)
        for name, data in stored.items():
            if isinstance(data, str):
                raise self._damaged(info, name, data)
        return stored.__getitem__  # type: ignore[return-value]

    def _whole(self, refs: list[Any]) -> dict[bytes, memoryview | str]:
        """Every file of the chunks ``refs`` read whole (side by side where the Folder can), or
        what is wrong with it."""
        names = list(dict.fromkeys(n for ref in refs for n in links(ref)))
        got = self._chunks.read_whole([n.hex() for n in names], self.chunk_bytes)  # no chunk file is longer
        return {name: data if isinstance(data, str) else memoryview(data) for name, data in zip(names, got)}

    def _groups(self, info: TensorInfo, view: memoryview | None) -> Iterator[list[tuple[Any, memoryview]]]:
        """The tensor's (chunk reference, its bytes), a batch of chunks at a time: in ``view`` (the
        tensor's bytes), or in one buffer of a batch reused for each when None (``verify``)."""
        refs, size, nbytes = info.extra.chunks, self.chunk_bytes, info.nbytes
        step = max(1, _BATCH_BYTES // size)
        buf = memoryview(bytearray(min(step * size, nbytes))) if view is None else None
        for first in range(0, len(refs), step):
            off = first * size
            base = buf if buf is not None else view[off:]  # type: ignore[index]
            yield [(ref, base[i * size - off:min((i + 1) * size, nbytes) - off])
                   for i, ref in enumerate(refs[first:first + step], first)]

    def _read_group(self, items: list[tuple[TensorInfo, Any, memoryview]],
                    crcs: list[int | None] | None = None) -> list[CorruptCheckpointError | None]:
        """Fill each ``(tensor, chunk reference, piece)``'s piece with its chunk, the files read side
        by side where the Folder can (whole chunks into place, decoded when encoded; chains assembled);
        what went wrong with each (None: filled), raised by the caller in read order. ``crcs`` (one None
        per item) gets the crc32c of raw chunks where the Folder has ``read_checked`` (local files)."""
        problems: list[CorruptCheckpointError | None] = [None] * len(items)
        whole = [i for i, (_, ref, _) in enumerate(items) if isinstance(ref, bytes)]
        requests = [(items[i][1].hex(), items[i][2]) for i in whole]
        read_checked = getattr(self._chunks, "read_checked", None) if crcs is not None else None
        answers: list[tuple[str | bytes | None, int | None]] = read_checked(requests) if read_checked is not None \
            else [(answer, None) for answer in self._chunks.read_objects(requests)]
        got = [answer for answer, _ in answers]
        for i, (answer, crc) in zip(whole, answers):
            if crcs is not None and answer is None:
                crcs[i] = crc
        for i, result in zip(whole, got):
            info, ref, piece = items[i]
            if isinstance(result, str):
                problems[i] = self._damaged(info, ref, result)
            elif result is not None:  # an encoded chunk
                problems[i] = self._attempt(info, decode_into, memoryview(result), piece,
                                            f"{self.path}: tensor {info.key!r}: chunk {ref.hex()}")
        chained = [i for i, (_, ref, _) in enumerate(items) if not isinstance(ref, bytes)]
        step = max(1, _BATCH_BYTES // self.chunk_bytes)
        for part in (chained[first:first + step] for first in range(0, len(chained), step)):
            stored = self._whole([items[i][1] for i in part])
            for i in part:
                info, ref, piece = items[i]
                bad = next((n for n in links(ref) if isinstance(stored[n], str)), None)
                problems[i] = self._damaged(info, bad, str(stored[bad])) if bad is not None else \
                    self._attempt(info, assemble, stored.__getitem__, ref, piece, f"{self.path}: tensor {info.key!r}")
        return problems

    def _attempt(self, info: TensorInfo, fill: Callable[..., None], *args: Any) -> CorruptCheckpointError | None:
        """``fill(*args)``; the problem it met, naming this checkpoint and the tensor (None: none)."""
        try:
            fill(*args)
        except CorruptCheckpointError as exc:
            return CorruptCheckpointError(str(exc), path=self.path, key=info.key)
        return None

    def _fill(self, info: TensorInfo, pieces: list[tuple[Any, memoryview]]) -> None:
        """Fill each ``(chunk reference, piece)`` of the tensor, raising the first problem."""
        for problem in self._read_group([(info, ref, piece) for ref, piece in pieces]):
            if problem is not None:
                raise problem

    def _read_into(self, info: TensorInfo, out: np.ndarray) -> None:
        self._read_many([(info, out)])

    def _read_many(self, pairs: list[tuple[TensorInfo, np.ndarray]]) -> None:
        """Read a batch's chunks a group (``group_bytes``) at a time across its tensors, side by side;
        crc32c values not computed by the reads are computed on a worker while the next group is read.
        Each tensor is checked once its chunks are in, in order: the first problem raised is the one
        a read in order meets."""
        items: list[tuple[TensorInfo, Any, memoryview]] = []
        ends = []  # where each tensor's chunks end in ``items``
        for info, out in pairs:
            if not dtypes.is_string(info.dtype):
                view, size = _io.byte_view(out), self.chunk_bytes
                items += [(info, ref, view[i * size:(i + 1) * size]) for i, ref in enumerate(info.extra.chunks)]
            ends.append(len(items))
        problems: list[CorruptCheckpointError | None] = []
        crcs: list[int] = []  # of each piece read so far
        step, checked = max(1, self.group_bytes // self.chunk_bytes), 0
        pending: Future[list[int]] | None = None  # the previous group's crc32c values
        hint = getattr(self._chunks, "prefetch", None)

        def check(upto: int) -> None:  # each tensor whose chunks end by ``upto``, in order
            nonlocal checked
            while checked < len(pairs) and ends[checked] <= upto:
                span = slice(ends[checked - 1] if checked else 0, ends[checked])
                self._check(pairs[checked], items[span], problems[span], crcs[span])
                checked += 1
        try:
            for first in range(0, len(items), step):
                group = items[first:first + step]
                if hint is not None and first + step < len(items):  # the next group's files, read ahead
                    _io.workers().submit(hint, [r.hex() for _, r, _ in items[first + step:first + 2 * step]
                                                if isinstance(r, bytes)])
                known: list[int | None] = [None] * len(group)
                problems += self._read_group(group, known)
                crcs += pending.result() if pending is not None else []
                # decoded chunks, or a Folder that does not checksum: on a worker, while the next group is read
                pieces = [piece for _, _, piece in group]
                pending = _io.workers().submit(_io.crc32c_each, pieces, known) if None in known else None
                crcs += [] if pending is not None else known  # type: ignore[arg-type]
                check(len(crcs))
            crcs += pending.result() if pending is not None else []
            pending = None
            check(len(items))  # the last group's tensors, and those after the last chunk
        finally:
            if pending is not None:
                pending.exception()  # it reads the caller's buffers: done before they return

    def _check(self, pair: tuple[TensorInfo, np.ndarray], items: list[tuple[TensorInfo, Any, memoryview]],
               problems: list[CorruptCheckpointError | None], crcs: list[int]) -> None:
        """Raise the first problem met reading the tensor's chunks, else check its crc32c, combined
        from its pieces' ``crcs`` (a string tensor: read from the index and checked)."""
        info, out = pair
        if dtypes.is_string(info.dtype):
            self._read_strings(info, out)
            return
        first = next((p for p in problems if p is not None), None)
        if first is not None:
            raise first
        crc = 0
        for (_, _, piece), piece_crc in zip(items, crcs):
            crc = crc32c_combine(crc, piece_crc, len(piece))
        if crc != info.extra.crc32c:  # a raw chunk file changed in place (its size and name still fit)
            raise checksum_error(self.path, f"tensor {info.key!r}", crc, info.extra.crc32c, key=info.key,
                                 cause=f"a chunk file of it in {self._chunks.location} is damaged "
                                       f"(`ckpt verify {self.path}` names it)")

    def _read_strings(self, info: TensorInfo, out: np.ndarray) -> None:
        location: ChunkedLocation = info.extra
        if _io.crc32c(packb(location.chunks)) != location.crc32c:
            raise checksum_error(self.path, f"tensor {info.key!r}", key=info.key)
        flat = out.reshape(-1)
        for i, item in enumerate(location.chunks):
            flat[i] = item

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
                    self._fill(info, [(info.extra.chunks[i], out[lo - start:hi - start])])
                    continue
                whole = memoryview(bytearray(hi - lo))
                self._fill(info, [(info.extra.chunks[i], whole)])
                a, b = max(lo, start), min(hi, end)
                out[a - start:b - start] = whole[a - lo:b - lo]
        return fetch

    def _verify_chunk(self, info: TensorInfo, ref: bytes | list[bytes], piece: memoryview,
                      load: Callable[[bytes], memoryview]) -> None:
        """Rebuild the chunk from its whole base up, checking the hash at every step: the first
        file whose result does not match is the damaged one."""
        chain, names = chain_of(ref), links(ref)
        acc, tmp = np.frombuffer(piece, np.uint8), bytearray(len(piece))
        for j in range(len(chain) - 1, -1, -1):
            where = self.chunk_location(names[j])
            try:
                decode_into(load(names[j]), piece if j == len(chain) - 1 else memoryview(tmp),
                            f"{self.path}: tensor {info.key!r}: its chunk {where}")
            except CorruptCheckpointError as exc:
                raise CorruptCheckpointError(str(exc), path=self.path, key=info.key) from None
            if j < len(chain) - 1:
                np.bitwise_xor(acc, np.frombuffer(tmp, np.uint8), out=acc)
            if digest(piece) != chain[j]:
                raise self._damaged(info, names[j], "does not match its hash: the chunk is damaged")

    def verify(self, progress: Callable[[int], None] | None = None) -> list[str]:
        """Every chunk rebuilt along its chain and its hashes checked (naming the chunk file that
        fails), then every tensor's crc32c."""
        problems = []
        for key, info in self._tensors.items():
            try:
                if not dtypes.is_string(info.dtype):
                    crc = 0
                    for pieces in self._groups(info, None):
                        load = self._loader(info, [ref for ref, _ in pieces])
                        for ref, piece in pieces:
                            self._verify_chunk(info, ref, piece, load)
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


def _opened(path: str, blob: ReadableBlob | None) -> IncrementalReader:
    """The reader of the index ``path`` (from ``blob``, which it then owns, closed on failure too)."""
    try:
        return IncrementalReader(path, blob)
    except BaseException:
        if blob is not None:
            blob.close()
        raise


def referenced_chunks(path: str, blob: ReadableBlob | None = None) -> set[bytes]:
    """The names of every file of the chunk store the incremental checkpoint ``path`` (read from
    ``blob``, which this then owns, where given) reads: pack ids and chunk files, its deltas' bases
    included (the closure retention keeps)."""
    reader = _opened(path, blob)
    with reader:
        return {f for key in reader.tensors for f in reader.files_of(key)}


def chunk_locations(path: str, blob: ReadableBlob | None = None) -> dict[bytes, Location]:
    """Where the chunks the incremental checkpoint ``path`` stores in pack files are (by name)."""
    reader = _opened(path, blob)
    with reader:
        return reader.located
