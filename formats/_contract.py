"""The format contract: :class:`Format` (recognise and open a checkpoint) and
:class:`WritableFormat` (also write one), the base classes every format, built-in or plugin,
subclasses (``ckpt.Format``, ``ckpt.WritableFormat``), and :func:`decline`, a format's
"not mine" answer from ``open``.

Example:
    >>> from ckpt.formats import _contract, base
    >>> fmt = base.get_format("msgpack")
    >>> isinstance(fmt, _contract.WritableFormat), fmt.claims("m.msgpack")
    (True, False)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, final

from ckpt.errors import UnsupportedCheckpointError
from ckpt.storage import ReadableBlob, WritableBlob

from . import _io
from ._readers import Reader
from ._validation import normalize_metadata, validate_keys


class Declined(UnsupportedCheckpointError):
    """``Format.open``'s answer for a file its ``sniff`` accepted that a closer look shows is
    not its own (raised by :func:`decline`): ``open_reader`` asks the next format whose
    ``sniff`` accepts the file, handing it ``opened`` (what this format opened on the way, e.g.
    Keras's reader of a plain HDF5 file) as ``open``'s ``declined`` argument; anyone else sees an
    UnsupportedCheckpointError."""

    def __init__(self, message: str, opened: Reader | None = None) -> None:
        super().__init__(message)
        self.opened = opened


def decline(path: str, why: str, opened: Reader | None = None) -> NoReturn:
    """Raise :class:`Declined` from ``Format.open``: ``path`` is not this format's (``why``).

    ``opened`` (a reader of the container format this format opened on the way) goes to the
    next format ``open_reader`` asks, which may return it as its reader instead of opening the
    file again; ``open_reader`` closes it when none does. The blob ``open`` was given stays
    open: the next format reads through it.

    Example:
        >>> from ckpt.formats import base
        >>> try:
        ...     base.decline("w.h5", "no Keras layout")
        ... except base.Declined as exc:
        ...     print(exc, exc.opened)
        w.h5: no Keras layout None
    """
    raise Declined(f"{path}: {why}", opened)


class Format(ABC):
    """The read side of a checkpoint format: a name, extensions, recognition, a reader.

    A format recognises its checkpoints in two ways, both declared here: ``claims(path)``,
    asked of every format for every path before any file is opened (for checkpoints that are
    not one file: TensorFlow's "model.ckpt-7" prefix, a directory of shards), then
    ``sniff(head)`` on the first bytes of the file; both are asked in registry order, and
    the first format to say yes opens the checkpoint. A format whose files are some of another
    format's (Keras's HDF5 files are HDF5 files) registers before it
    (``register_format(fmt, before="hdf5")``) and, when a look inside shows the file is not its
    own after all, calls :func:`decline` in ``open``: the registry then asks the next format.
    Formats that also write subclass :class:`WritableFormat`.
    """

    #: The registered name ("hdf5").
    name: str
    #: Lower-case extensions with the dot, first is the default: (".h5", ".hdf5").
    extensions: tuple[str, ...]
    #: True for a WritableFormat (foreign formats may be read-only).
    can_write: bool = False

    def claims(self, path: str) -> bool:
        """True if ``path`` names a checkpoint of this format that sniffing cannot see.

        Asked first, for every path, before any file is opened; most formats return False.
        """
        return False

    @abstractmethod
    def sniff(self, head: bytes) -> bool:
        """True if a file starting with ``head`` (up to SNIFF_BYTES) is in this format."""

    @abstractmethod
    def open(self, path: str, blob: ReadableBlob | None = None, declined: Reader | None = None) -> Reader:
        """Open the checkpoint ``path`` and read its index.

        ``blob`` is the file the registry already opened to sniff it (None when ``claims``
        recognised the path, or when called directly: open ``path`` then, e.g. with
        ``base.open_blob``). Once ``open`` returns, the format owns it (its reader reads through
        it, or it closes it); when ``open`` raises, the caller closes it. ``declined`` is what a
        format asked before this one opened and handed on when declining the file
        (:func:`decline`): return it as the reader if it serves, the registry closes it otherwise.

        Raise a CheckpointError for a bad file, or :func:`decline` for a file that is not this
        format's (leaving ``blob`` open for the next format).
        """


class ChunkedFormat(Format):
    """A Format whose checkpoints are an index over content-addressed chunks kept once in a
    folder (``chunk_dir``) beside them: what an incremental save writes. The Saver finds it in the
    registry (``get_format``) and stores the chunks and the index; the format says how a tensor
    is cut and named and how the index is laid out."""

    #: the chunk folder's name, in the directory of the checkpoints that reference it
    chunk_dir: str = ""

    @abstractmethod
    def tensor_entry(self, array: Any, chunk_bytes: int, put: Callable[[bytes, bytes | memoryview], None], *,
                     previous: list[Any] | None = None, exists: Callable[[bytes], bool] | None = None,
                     get: Callable[[bytes, int], bytes] | None = None, compression: str | None = None,
                     max_chain: int = 0, recall: dict[bytes, Any] | None = None,
                     note: dict[bytes, Any] | None = None, turn: int | None = None) -> list[Any]:
        """Cut ``array`` into chunks of ``chunk_bytes``, hand each the store lacks to
        ``put(name, stored bytes)`` (possibly from several threads), return its index entry once
        every chunk is stored. ``exists(name)`` and ``get(name, limit)`` (its stored bytes, at
        most ``limit``) look into the store; ``previous`` is the tensor's entry in the previous
        save (the base of delta-encoded chunks, at most ``max_chain`` deep); ``compression``
        encodes whole chunks. ``recall`` is
        what the format noted in ``note`` during the Saver's previous save (the Saver keeps it
        between saves; the format may take entries out of it). ``turn`` (the Saver's save count
        plus a number drawn from the tensor's key; None: unknown) says which chunks' delta chains
        restart whole in this save, so that they restart in turn rather than all at once."""

    @abstractmethod
    def pack_index(self, metadata: dict[str, Any], chunk_bytes: int, entries: dict[str, list[Any]],
                   nested: bool = False, packs: dict[bytes, tuple[bytes, int, int]] | None = None) -> bytes:
        """The bytes of a checkpoint file holding these index ``entries`` (by key); ``nested``: a
        shard file inside a sharded checkpoint's directory, whose chunks are in the ``chunk_dir``
        beside that directory; ``packs``: where the chunks written into pack files are (chunk name
        -> (pack id, offset, stored length); the others are files of their own)."""

    @abstractmethod
    def references(self, path: str, blob: ReadableBlob | None = None) -> set[bytes]:
        """The names of every file of the chunk store the checkpoint ``path`` reads (pack ids and
        chunk files; read from ``blob``, which it then owns, where given: an object opened with
        the caller's storage options)."""

    def locations(self, path: str) -> dict[bytes, tuple[bytes, int, int]]:
        """Where the chunks the checkpoint ``path`` stores in pack files are (``pack_index``'s
        ``packs``); a format without packs has none."""
        return {}

    def entry_files(self, entry: list[Any], dtype: Any, shape: tuple[int, ...], chunk_bytes: int) -> \
            tuple[int, list[bytes]] | None:
        """For reusing ``entry`` (an index entry this format made) as is, for a tensor of ``dtype``
        and ``shape`` cut into ``chunk_bytes``: the crc32c of the tensor's bytes it records and the
        chunk files it reads; None when it cannot be reused so (another layout, a string tensor)."""
        return None


class WritableFormat(Format):
    """A Format that also writes checkpoints: it implements ``write_blob``, the one write method.

    ``write_blob`` writes into a :class:`ckpt.storage.WritableBlob` its caller hands it (a local
    temporary file, an upload to an object store), so one writer saves to every kind of
    storage. ``write(path, ...)`` is a convenience over it for a local file.
    """

    can_write = True
    #: The ``compression=`` values ``write_blob`` accepts (("zstd",) for msgpack); callers refuse
    #: any other with :func:`check_compression` and pass ``compression`` only when it is not None.
    compressions: tuple[str, ...] = ()

    @abstractmethod
    def write_blob(self, blob: WritableBlob, tensors: Sequence[tuple[str, Any]],
                   metadata: Mapping[str, Any], *, compression: str | None = None) -> None:
        """Write a complete checkpoint into ``blob`` (new and empty; ``blob.name`` names it in
        errors), keeping the blob write order (the head first and small, patched at any time;
        everything after it front to back). Do not close the blob: its Store does.

        Keys and metadata arrive validated: every caller checks them once before writing
        (``Saver``, ``save_file``, ``convert``, :meth:`write`), so a writer does not check them
        again; ``metadata`` is a JSON-like dict (``normalize_metadata``'s result).
        ``compression`` is None or one of ``compressions`` (a format that compresses nothing
        may leave the argument out: it is only passed when not None).

        Each tensor is an ndarray or a lazy source with ``dtype``, ``shape`` and
        ``__array__()``; writers read a lazy source only when they write its bytes
        (``materialize``), one at a time, so converting a file needs memory for one tensor.
        A lazy source that subclasses ``base.LazySource`` may also stream (``chunks()``, read
        with ``source_chunks``): writers that can write a tensor in pieces take its bytes chunk
        by chunk, and memory holds a chunk.
        """

    @final
    def write(self, path: str, tensors: Sequence[tuple[str, Any]], metadata: Mapping[str, Any], *,
              compression: str | None = None) -> None:
        """Write a complete checkpoint to the local file ``path`` (created or emptied): check the
        keys and metadata, then ``write_blob`` on a LocalSink over it."""
        validate_keys((key for key, _ in tensors), path)
        normalized = normalize_metadata(metadata, path)
        with _io.LocalSink(path) as blob:
            write_with(self, blob, tensors, normalized, compression)


def check_compression(fmt: Format, compression: str | None, path: str) -> None:
    """Refuse a ``compression=`` that ``fmt`` does not write, naming the file and what it offers.

    Raises:
        UnsupportedCheckpointError: e.g. compression="zstd" for an .h5 file (HDF5 files stay
            readable by plain h5py, without filter plugins).

    Example:
        >>> from ckpt.formats import base
        >>> check_compression(base.get_format("msgpack"), "zstd", "m.msgpack")
        >>> try:
        ...     check_compression(base.get_format("hdf5"), "zstd", "m.h5")
        ... except UnsupportedCheckpointError as exc:
        ...     print(exc)
        m.h5: the hdf5 format does not compress (compression='zstd'); .msgpack files offer compression='zstd'
    """
    if compression is None:
        return
    offered = fmt.compressions if isinstance(fmt, WritableFormat) else ()
    if compression not in offered:
        others = "" if offered else "; .msgpack files offer compression='zstd'"
        what = f"offers {', '.join(map(repr, offered))}" if offered else "does not compress"
        raise UnsupportedCheckpointError(f"{path}: the {fmt.name} format {what} (compression={compression!r})"
                                         f"{others}", path=path)


def write_with(fmt: WritableFormat, blob: WritableBlob, tensors: Sequence[tuple[str, Any]],
               metadata: Mapping[str, Any], compression: str | None) -> None:
    """``fmt.write_blob``, passing ``compression`` only when set (writers without it keep working)."""
    if compression is None:
        fmt.write_blob(blob, tensors, metadata)
    else:
        check_compression(fmt, compression, blob.name)
        fmt.write_blob(blob, tensors, metadata, compression=compression)
