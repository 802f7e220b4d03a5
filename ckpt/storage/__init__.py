"""The storage layer: the one interface between checkpoint formats and the bytes.

A format never touches a file descriptor or an object store itself: it reads a
:class:`ReadableBlob` (one file, or one object), which a local file
(``ckpt.storage.localfile.LocalFile``: ``preadv`` runs, a checksum thread pool) and an object in a
store (``ckpt.storage.remote.RemoteFile``: concurrent ranged GETs) both implement, and it writes a
:class:`WritableBlob` (``ckpt.storage.localfile.LocalSink``: ``pwrite``/``pwritev``). A directory of
checkpoints is a :class:`Store` (``ckpt.storage.local.LocalStore``: temporary file, fsync,
rename, an ``flock``'d state file; ``ckpt.storage.remote.RemoteDirectory``: a data object, then a
create-only commit record, a compare-and-swap state file), which the Saver, retention and
``latest_checkpoint`` use without asking which kind it is (``ckpt.saving.stores.open_store``).
A new kind of storage (per-rank shard files, another object store) is a new implementation
of these Protocols; no format module changes.

Every method raises :class:`ckpt.CorruptCheckpointError` naming the blob (``name``) and
``what`` was being read when the bytes are not there (a truncated file, EIO, a short object).

Example:
    >>> import os, tempfile
    >>> from ckpt.storage import ReadableBlob
    >>> from ckpt.storage.localfile import LocalFile
    >>> path = os.path.join(tempfile.mkdtemp(), "blob")
    >>> with open(path, "wb") as f:
    ...     _ = f.write(b"hello, world")
    >>> blob = LocalFile(path)
    >>> isinstance(blob, ReadableBlob), blob.size
    (True, 12)
    >>> buf = bytearray(5)
    >>> blob.read_into(memoryview(buf), 7, "a word")
    >>> bytes(buf)
    b'world'
    >>> blob.close()
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from ckpt.storage.state import CheckpointState

__all__ = ["ReadableBlob", "WritableBlob", "Folder", "Store", "Catalog", "FILES_ONLY", "Span", "Bytes", "StateChange",
           "Listed"]

T = TypeVar("T")
#: One row of ``Store.listing``: name, step, time, size in bytes, note.
#: ``(name, step, time, size, note, metrics)``: one row of ``Store.listing``
Listed = tuple[str, int | None, float | None, int | None, str, "dict[str, float] | None"]

#: ``(offset in the blob, buffer to fill)``: one range of a multi-range read.
Span = tuple[int, memoryview]
#: What a write takes: bytes, or a flat byte view of an array (never copied on the way).
Bytes = bytes | bytearray | memoryview


@runtime_checkable
class ReadableBlob(Protocol):
    """One readable blob of bytes (a file, an object): positioned reads into caller buffers.

    Implementations read straight into the given buffers (no copy of a tensor is made on the
    way) and may read several ranges concurrently. ``read_spans`` also returns each span's
    crc32c, which an implementation computes while the bytes are still in cache (or in
    parallel): formats compare it with the checksum they stored.
    """

    @property
    def name(self) -> str:
        """The path or URL, as error messages show it."""

    @property
    def size(self) -> int:
        """The blob's size in bytes, now."""

    def read_into(self, view: memoryview, offset: int, what: str) -> None:
        """Fill ``view`` (a flat byte view) with the bytes at ``offset``.

        Raises:
            CorruptCheckpointError: fewer bytes than ``len(view)`` are there, or the read
                failed; the message names the blob and ``what``.
        """

    def read_spans(self, spans: Sequence[Span], name: Callable[[int], str]) -> list[int]:
        """Fill each ``(offset, view)`` of ``spans`` and return the views' crc32c values.

        Spans may come in any order and may be read in any order or at once; ``name(i)``
        labels span ``i`` in errors ("tensor 'w'"). No buffer is written once this returns
        or raises.
        """

    def close(self) -> None:
        """Release what the blob holds (descriptors, caches); reading after this is an error."""


@runtime_checkable
class WritableBlob(Protocol):
    """One blob being written (a new file, a new object): positioned writes of caller buffers.

    The order of writes is a contract, so that an object store can upload a blob in parts
    while it is written (without a local copy): **the head** is every byte before the end of
    the blob's first write; writes into the head may come at any time (a header reserved at
    the start and filled in last: hdf5's user block, safetensors' header, msgpack's element
    count), while every write past the head starts at or after the end of the write before
    it. Bytes never written (gaps between writes) read as zeros. ckpt's writers keep to this,
    and keep the head small (a header reserved by a first small write), because an object store
    holds the part with the head in memory until the end.

    ``lend_pieces`` is an optional ability declared here with a default (``write_pieces``):
    a blob that can keep references to its caller's buffers instead of copies (an S3 upload
    sent as one PUT) overrides it; implementations subclass this class to inherit the default.
    ``formats._io.Runs`` lends what a writer marks ``lent``.

    A writer (``WritableFormat.write_blob``) is handed a blob by a :class:`Store` and never
    closes it: the Store finishes it (the file is renamed into place, the upload completed and
    committed) or discards it when the writer raised.

    Example:
        >>> import os, pathlib, tempfile
        >>> from ckpt.storage.localfile import LocalSink
        >>> path = os.path.join(tempfile.mkdtemp(), "blob")
        >>> with LocalSink(path) as out:
        ...     out.write_pieces([b"body ", b"text"], 4)  # the first write: bytes 0-3 are the head
        ...     out.write_at(b"HEAD", 0)  # filled in last
        ...     out.size
        13
        >>> pathlib.Path(path).read_bytes()
        b'HEADbody text'
    """

    @property
    def name(self) -> str:
        """The path or URL, as error messages show it."""

    @property
    def size(self) -> int:
        """The end of the furthest byte written so far."""

    def write_at(self, data: Bytes, offset: int) -> None:
        """Write all of ``data`` at ``offset`` (OSError when the storage fails: a full disk)."""

    def write_pieces(self, pieces: Sequence[Bytes], offset: int) -> None:
        """Write ``pieces`` back to back from ``offset`` without joining them into one copy."""

    def lend_pieces(self, pieces: Sequence[Bytes], offset: int) -> None:
        """``write_pieces``, the caller promising that ``pieces`` stay alive and unchanged until
        the blob is finished, so the blob may keep references instead of copies. The default
        writes them now (a local file has nothing to gain from holding them)."""
        self.write_pieces(pieces, offset)

    def close(self) -> None:
        """Finish the blob: everything written is in the storage once this returns."""


@runtime_checkable
class Folder(Protocol):
    """The objects of one folder beside a blob, each read whole (an incremental checkpoint's chunk
    store): local files (``ckpt.storage.localfile.LocalFolder``) or objects under a prefix of the
    blob's own store, read with its options (``ckpt.storage.objfolder.RemoteFolder``: one GET per
    object, many in flight). ``ckpt.formats.base.open_folder(blob, name)`` opens the folder beside
    a blob.
    """

    @property
    def location(self) -> str:
        """The folder's path or URL."""

    def where(self, name: str) -> str:
        """The path or URL of the object ``name``, as error messages show it."""

    def read_objects(self, items: Sequence[tuple[str, memoryview]]) -> list[str | bytes | None]:
        """Read each ``(name, view)``'s object ``name`` (several at once where the store allows),
        the fast path of raw chunks: None when it is exactly ``len(view)`` bytes (``view`` holds
        them); its bytes when it is shorter (an encoded chunk, ``view`` is left unspecified);
        otherwise what is wrong with it ("is missing", "holds more than N bytes").

        Raises:
            StorageError: the store failed (an outage, not the objects' fault).
        """

    def read_whole(self, names: Sequence[str], limit: int) -> list[bytes | str]:
        """The whole bytes of each object of ``names``, of any length up to ``limit`` (several at
        once where the store allows), or what is wrong with it ("is missing", "holds more than
        ``limit`` bytes": no more than ``limit + 1`` bytes are read, so a damaged or hostile
        object cannot exhaust memory).

        Raises:
            StorageError: the store failed (an outage, not the objects' fault).
        """

    def read_ranges(self, items: Sequence[tuple[str, int, memoryview]]) -> list[tuple[str | None, int | None]]:
        """Fill each ``(name, offset, view)``'s view with the bytes of object ``name`` from
        ``offset`` on (several at once, and neighbouring ranges of one object in one request,
        where the store allows): the chunks of a pack file. Each answer is None when the view is
        filled, else what is wrong ("is missing", "is truncated ..."), with the crc32c of the view
        where the folder computes it while the bytes are in cache (None otherwise).

        Raises:
            StorageError: the store failed (an outage, not the objects' fault).
        """

    def sizes(self) -> dict[str, int]:
        """``{name: size in bytes}`` of every object in the folder (one listing)."""


class Catalog(Protocol):
    """What a Store asks about checkpoint formats, which storage does not know: which paths and
    names are checkpoints, and whether one verifies. The format registry answers
    (``ckpt.saving.stores.REGISTRY``, handed to every Store the library opens); storage never
    imports it, so formats can sit on top of storage.
    """

    def claims(self, path: str) -> bool:
        """True when a format claims the local ``path`` that is no plain file (a TensorFlow
        prefix, a sharded checkpoint's directory)."""

    def extension(self, name: str) -> str | None:
        """The extension by which a format claims ``name`` ("model-3.h5" -> ".h5"), or None."""

    def writable(self, name: str) -> bool:
        """True when ``name`` has the extension of a format a Saver writes."""

    def verifies(self, path: str, blob: ReadableBlob | None) -> bool:
        """True when the checkpoint ``path`` (read from ``blob``, which it then owns, where given)
        verifies, False when it opens but does not.

        Raises:
            CheckpointError: it cannot be opened (the store decides what that means).
        """


class _FilesOnly:
    """The Catalog of a Store opened without the registry: plain files only, nothing verifies."""

    def claims(self, path: str) -> bool:
        return False

    def extension(self, name: str) -> str | None:
        return None

    def writable(self, name: str) -> bool:
        return False

    def verifies(self, path: str, blob: ReadableBlob | None) -> bool:
        if blob is not None:
            blob.close()
        return False  # nothing is known to be a checkpoint


#: The Catalog that knows no format (a Store built for writing plain files: shard files).
FILES_ONLY: Catalog = _FilesOnly()

#: A change of a directory's state file: the state read (None: no state file yet) -> the
#: state to write and the names of checkpoints to delete once it is written.
StateChange = Callable[["CheckpointState | None"], "tuple[CheckpointState, list[str]]"]


@runtime_checkable
class Store(Protocol):
    """A directory-like location holding checkpoints and their state file ("checkpoint").

    Names are plain names in the location ("model-1000.h5"); ``join`` makes the path or URL
    users see. Every method raises a :class:`ckpt.CheckpointError` naming the location.

    Example:
        >>> import os, tempfile, ckpt
        >>> from ckpt.saving.stores import open_store
        >>> store = open_store(tempfile.mkdtemp())
        >>> path = ckpt.Saver({"w": ckpt.Variable(1.0)}).save(store.join("m.h5"))
        >>> isinstance(store, ckpt.storage.Store), store.exists("m.h5"), store.latest() == path
        (True, True, True)
    """

    @property
    def location(self) -> str:
        """The directory's path or URL."""

    def join(self, name: str) -> str:
        """The path or URL of ``name`` in this location."""

    def open(self, name: str) -> ReadableBlob:
        """Open the checkpoint blob ``name`` for reading (CheckpointNotFoundError if absent)."""

    def exists(self, name: str) -> bool:
        """True when ``name`` exists in the location (a checkpoint, or something in its way)."""

    def list_names(self) -> list[str]:
        """The names of what the location holds, sorted, without the store's own bookkeeping
        (temporary files, locks, uncommitted data)."""

    def delete_checkpoints(self, names: Sequence[str]) -> None:
        """Delete each named checkpoint if it exists (a sharded one's commit record first)."""

    def write_checkpoint(self, name: str, write: Callable[[WritableBlob], None],
                         check: Callable[[ReadableBlob], None] | None = None) -> None:
        """Create ``name`` atomically from ``write(blob)``, which writes the checkpoint's bytes into
        the :class:`WritableBlob` the store hands it (in the blob write order): whole or not at
        all, never half-written (local: temporary file, fsync, rename, fsync of the directory;
        object store: a data object under a unique name, uploaded as it is written, then a
        create-only commit record). ``check(blob)``, if given, is called with the complete but not
        yet visible bytes opened for reading (``blob.name``: their path or URL; a reader may take
        the blob over, the store closes it after ``check``); if it raises, nothing is created."""

    def write_file(self, name: str, write: Callable[[WritableBlob], None],
                   check: Callable[[ReadableBlob], None] | None = None) -> int:
        """Create the plain file ``name`` like ``write_checkpoint`` (whole or not at all; local:
        temporary file and rename; object store: a create-only upload streamed as it is written)
        but without a commit record of its own: for the files of a checkpoint whose own commit
        names them (a sharded checkpoint's shard files). Return its size in bytes."""

    def commit(self, name: str, write: Callable[[WritableBlob], None], change: StateChange,
               step: int | None = None, metrics: Mapping[str, float] | None = None) -> CheckpointState:
        """``write_checkpoint``, then record it in the state file with ``change`` as one step
        (no other save's retention can delete it in between), then delete what ``change``
        dropped; return the state written. Just before the commit (the rename, the commit
        record) the state file is written with ``name`` (at ``step``, with ``metrics``) *pending*,
        so that retention by a metric ranks it even if the save is killed there, and so a save killed
        after its commit still leaves the new checkpoint the latest. ``step`` is the save's global
        step (an object store also binds it into the commit record; a local file is bound by its
        name alone). If the state file cannot be written, the new checkpoint is removed again
        (unless it replaced one the state file lists) and a CheckpointWriteError says that the
        previous checkpoint is still the latest."""

    def read_state(self) -> CheckpointState | None:
        """The parsed state file, or None when there is none."""

    def effective_state(self) -> CheckpointState | None:
        """The state readers go by: ``read_state`` with pending entries settled (``ckpt.storage.state.settle``);
        for a damaged state file, the directory's verified checkpoints, with a StateFileWarning."""

    def update_state(self, change: Callable[[CheckpointState | None], tuple[CheckpointState, T]]) -> T:
        """Read, change and write the state file with no other writer in between (local: under
        its lock; object store: compare-and-swap, retried); return ``change``'s second item."""

    def latest(self) -> str | None:
        """The path or URL of the newest checkpoint the state file lists that exists, or None."""

    def listing(self) -> list[Listed]:
        """``(name, step, time, size, note, metrics)`` per checkpoint (``ckpt.list_checkpoints``'s rows): the
        state file's entries (note "latest", "preserved", "missing" or ""), then checkpoints it does
        not list; CheckpointNotFoundError when the directory does not exist."""
