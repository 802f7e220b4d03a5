"""The chunk store of a local directory as an incremental save writes it: every chunk the save
writes goes into one new pack file (``ckpt.formats._packs``), and a chunk counts as present when a
checkpoint of the directory locates it in a pack that is there (or it is a file of its own).

The caller holds the directory's lock (a sharded save: rank 0 holds it for every rank), so no
collection deletes a pack found present before the save's index references it. The pack is
written under a temporary name (each I/O thread reserves its bytes, then writes them with
``pwrite``), synced as it grows (``SYNC_BYTES``) and fsynced at the end, and hard-linked to its
id's name before the index is committed; a crash leaves at most an unreferenced pack or
temporary, which the next save collects.

**Compaction**: a pack whose referenced chunks fill less than half of it (the rest belongs to
checkpoints retention dropped) is not counted as present, so a save that needs one of its chunks
writes it again into its own pack (from the tensor being saved: nothing is read back); once no
kept checkpoint references the sparse pack, collection deletes it.

Example:
    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> store = PackStore(folder, {}, set())
    >>> store.put(b"n" * 32, b"abc"), store.put(b"n" * 32, b"abc"), store.exists(b"n" * 32)
    (True, False, True)
    >>> pack = store.finish()
    >>> sorted(os.listdir(folder)) == [pack.hex()], store.located()[b"n" * 32] == (pack, 0, 3)
    (True, True)
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterable

from ckpt.errors import CheckpointError, CorruptCheckpointError
from ckpt.formats._packs import PACK_ID_BYTES, Location
from ckpt.formats.base import ChunkedFormat
from ckpt.storage.localfile import pwrite_all

__all__ = ["PackStore", "TMP_PREFIX", "stored_chunks"]

#: Temporary files in the chunk store (collection deletes the ones no save is writing).
TMP_PREFIX = ".tmp-"
#: A writer that brings a pack's unsynced bytes to this many syncs them (``fdatasync``) while the
#: other threads go on hashing and writing, so the disk writes beside the hashing rather than all
#: in the final fsync; None: only the final fsync.
SYNC_BYTES: int | None = 8 << 20


def stored_chunks(fmt: ChunkedFormat, indexes: Iterable[str], folder: str) -> tuple[dict[bytes, Location], set[bytes]]:
    """Where the index files ``indexes`` locate chunks in the packs of ``folder`` (name ->
    location; a chunk placed in several packs, after a compaction, in one that is not sparse), and
    the packs among them less than half of whose bytes those indexes reference (``sparse``: their
    chunks are written again when needed). An index that cannot be read adds nothing (its chunks
    are merely written again)."""
    places: dict[bytes, set[Location]] = {}
    for path in indexes:
        try:
            for name, where in fmt.locations(path).items():
                places.setdefault(name, set()).add(where)
        except (OSError, CheckpointError):
            continue
    live: dict[bytes, int] = {}
    for wheres in places.values():
        for pack, _, length in wheres:
            live[pack] = live.get(pack, 0) + length
    sparse = set()
    for pack, used in live.items():
        try:
            size = os.path.getsize(os.path.join(folder, pack.hex()))
        except OSError:
            continue  # missing: ``PackStore.exists`` finds it so
        if 2 * used < size:
            sparse.add(pack)
    known = {name: min(wheres, key=lambda where: (where[0] in sparse, where)) for name, wheres in places.items()}
    return known, sparse


class PackStore:
    """One save's view of the chunk store ``folder``: ``put``, ``exists`` and ``get`` as
    ``ckpt.saving.incremental.ChunkStore`` asks, ``finish`` to make the pack durable, ``located``
    for the index's pack table. ``known`` and ``sparse`` are ``stored_chunks``'."""

    def __init__(self, folder: str, known: dict[bytes, Location], sparse: set[bytes]) -> None:
        self.folder, self._known, self._sparse = folder, known, sparse
        self.id = os.urandom(PACK_ID_BYTES)
        self._tmp = os.path.join(folder, f"{TMP_PREFIX}{uuid.uuid4().hex}")
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._end = 0
        self._unsynced, self._syncing = 0, False
        self._members: dict[bytes, tuple[int, int]] = {}
        self._as_files: set[bytes] = set()  # names found present as files of their own
        self._pack_sizes: dict[bytes, int] = {}

    def exists(self, name: bytes) -> bool:
        """Whether the chunk ``name`` is stored: written by this save, within a pack an index
        locates it in (not a sparse one), or as a file of its own."""
        if name in self._members:
            return True
        where = self._known.get(name)
        if where is not None and where[0] not in self._sparse and where[1] + where[2] <= self._pack_size(where[0]):
            return True  # (a pack cut short lost the chunks past its end: those are written again)
        if os.path.exists(os.path.join(self.folder, name.hex())):
            self._as_files.add(name)
            return True
        return False

    def put(self, name: bytes, data: bytes | memoryview) -> bool:
        """Append ``data`` as the chunk ``name`` to this save's pack unless it is stored; True when
        written (called from several threads: each reserves its bytes, then writes them)."""
        if self.exists(name):
            return False
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                                   0o666)
            offset, self._end = self._end, self._end + len(data)
            fd = self._fd
        pwrite_all(fd, data, offset)
        with self._lock:
            self._members[name] = (offset, len(data))  # readable once written
            self._unsynced += len(data)
            sync = SYNC_BYTES is not None and self._unsynced >= SYNC_BYTES and not self._syncing
            if sync:
                self._unsynced, self._syncing = 0, True
        if sync:  # on this I/O thread, while the others hash and write: the disk works beside them
            try:
                os.fdatasync(fd)
            finally:
                self._syncing = False
        return True

    def get(self, name: bytes, limit: int) -> bytes:
        """The stored bytes of the chunk ``name`` (at most ``limit``: a longer one is damage)."""
        if name in self._members:
            path, (offset, length) = self._tmp, self._members[name]
        elif name in self._known and name not in self._as_files:
            pack, offset, length = self._known[name]
            path = os.path.join(self.folder, pack.hex())
        else:
            path, offset, length = os.path.join(self.folder, name.hex()), 0, -1
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(limit + 1 if length < 0 else min(length, limit + 1))
        if len(data) > limit:  # damaged (no stored chunk is longer than its chunk): not read into memory whole
            raise CorruptCheckpointError(f"{path} holds more than {limit} bytes", path=path)
        if 0 <= length != len(data):
            raise CorruptCheckpointError(f"{path} ends before the chunk {name.hex()}'s bytes", path=path)
        return data

    def finish(self) -> bytes | None:
        """Make the pack durable under its name (the caller then fsyncs the folder); its id, or
        None when the save wrote no chunk."""
        if self._fd is None:
            return None
        fd, self._fd = self._fd, None
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.link(self._tmp, os.path.join(self.folder, self.id.hex()))  # create-only: a fresh random id
        os.unlink(self._tmp)
        return self.id

    def abandon(self) -> None:
        """Remove the unfinished pack (a failed save)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            os.unlink(self._tmp)
        except OSError:
            pass

    def located(self) -> dict[bytes, Location]:
        """Where every chunk this save may reference is stored in a pack: those it wrote, in its
        pack; the others where an index of the directory locates them (unless found as files)."""
        located = {name: where for name, where in self._known.items() if name not in self._as_files}
        located.update((name, (self.id, offset, length)) for name, (offset, length) in self._members.items())
        return located

    def _pack_size(self, pack: bytes) -> int:
        """The pack's size in bytes (-1: missing), looked up once per save."""
        size = self._pack_sizes.get(pack)
        if size is None:
            try:
                size = os.path.getsize(os.path.join(self.folder, pack.hex()))
            except OSError:
                size = -1
            self._pack_sizes[pack] = size
        return size
