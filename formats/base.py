"""The Reader/Format protocol every checkpoint format implements, and the format registry.

A format knows how to recognise its files (``sniff``), open them (``open`` -> a Reader that
has read only the index) and, optionally, write them. The built-in formats register
themselves with :func:`register_format`, the same function a user calls for their own.

Example:
    >>> from ckpt.formats import base
    >>> base.format_for_path("model.msgpack").name
    'msgpack'
"""

from __future__ import annotations

import importlib
import itertools
import math
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NamedTuple, NoReturn, Protocol, TypeVar, runtime_checkable

import numpy as np

from ckpt import dtypes
from ckpt._urls import is_url
from ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    KeyNotFoundError,
    MismatchError,
    UnsupportedCheckpointError,
    closest_hint,
)
from ckpt.gcpause import gc_paused
from ckpt.storage import ReadableBlob, WritableBlob

from . import _io
from ._io import LocalFile

__all__ = ["TensorInfo", "Reader", "BaseReader", "FileReader", "Format", "WritableFormat", "register_format",
           "unregister_format", "LazyFormat", "lazy_format", "Declined", "decline", "handed", "offering",
           "get_format", "formats", "format_for_path", "open_reader", "validate_keys",
           "key_problem", "normalize_metadata", "materialize", "source_chunks", "check_tensors", "open_blob",
           "SNIFF_BYTES"]

#: How many bytes from the start of a file ``Format.sniff`` is shown.
SNIFF_BYTES = 4096


class TensorInfo(NamedTuple):
    """What a checkpoint says about one tensor, known without reading its data."""

    key: str
    dtype: np.dtype
    shape: tuple[int, ...]
    #: Bytes the tensor's data occupies in the file.
    nbytes: int
    #: Format-specific location details (offsets, checksums); opaque to callers.
    extra: Any = None

    @property
    def size(self) -> int:
        """Number of elements (1 for a scalar)."""
        n = 1
        for d in self.shape:
            n *= d
        return n


@runtime_checkable
class Reader(Protocol):
    """An open checkpoint. Opening reads the index only; data is read on request."""

    path: str
    format_name: str
    checksummed: bool

    @property
    def metadata(self) -> dict[str, Any]: ...

    @property
    def tensors(self) -> Mapping[str, TensorInfo]: ...

    def info(self, key: str) -> TensorInfo:
        """The TensorInfo of ``key``; KeyNotFoundError (naming the closest keys) if there is none."""

    def read_into(self, key: str, out: np.ndarray) -> None:
        """Read one tensor into ``out`` (C-contiguous, its exact shape and dtype), verifying it."""

    def read_into_many(self, items: Sequence[tuple[str, np.ndarray]]) -> None:
        """``read_into`` for several tensors at once (lets a format merge nearby reads)."""

    def read(self, key: str) -> np.ndarray:
        """Read one tensor into a new array."""

    def verify(self, progress: Callable[[int], None] | None = None) -> list[str]:
        """Check the whole file; return one line per problem found (empty when sound).

        ``progress``, if given, is called with the number of bytes checked as work goes on.
        """

    def close(self) -> None: ...

    def __enter__(self) -> Reader: ...

    def __exit__(self, *exc: object) -> None: ...


class BaseReader:
    """Shared behaviour for readers: key lookup with clear errors, ``read``, context manager.

    Subclasses set ``path``, ``format_name``, ``_tensors`` and ``_metadata`` and implement
    ``_read_into(info, out)``. Entries a file holds that are not tensors (TensorFlow's object
    graph) go into ``_metadata["non_tensors"]`` as {key: description}; inspect shows them.
    """

    path: str = ""
    format_name: str = ""
    #: False for files whose data carries no checksums (foreign files): verify() cannot vouch for them.
    checksummed: bool = True
    _tensors: dict[str, TensorInfo]
    _metadata: dict[str, Any]

    @property
    def metadata(self) -> dict[str, Any]:
        return self._metadata

    @property
    def tensors(self) -> Mapping[str, TensorInfo]:
        return self._tensors

    def info(self, key: str) -> TensorInfo:
        """Return the TensorInfo for ``key`` or raise KeyNotFoundError naming the closest keys."""
        try:
            return self._tensors[key]
        except KeyError:
            raise KeyNotFoundError(
                f"{self.path}: tensor {key!r} not found in checkpoint{closest_hint(key, self._tensors)}"
            ) from None

    def read_into(self, key: str, out: np.ndarray) -> None:
        self.read_into_many([(key, out)])

    def read_into_many(self, items: Sequence[tuple[str, np.ndarray]]) -> None:
        """Read several tensors into their buffers; formats batch nearby reads into one call."""
        pairs = []
        tensors = self._tensors
        for key, out in items:
            info = tensors.get(key) or self.info(key)  # info() raises the KeyNotFoundError
            if out.shape != info.shape or out.dtype != info.dtype or not (
                    out.flags.c_contiguous and out.flags.writeable):
                raise MismatchError(f"{self.path}: tensor {key!r} is {info.dtype} {list(info.shape)}; "
                                    f"cannot read it into a {out.dtype} {list(out.shape)} array")
            pairs.append((info, out))
        self._read_many(pairs)

    def read_planned(self, pairs: Sequence[tuple[TensorInfo, np.ndarray]]) -> None:
        """``read_into_many`` for pairs a caller has already matched against this reader's index.

        Each pair is a TensorInfo of ``self.tensors`` and a C-contiguous, writable buffer of its
        exact shape and dtype (a restore's plan checks both once): nothing is looked up or
        checked again, which matters for 10,000s of small tensors.
        """
        self._read_many(pairs if isinstance(pairs, list) else list(pairs))

    def read(self, key: str) -> np.ndarray:
        info = self.info(key)
        try:
            out = np.empty(info.shape, dtype=info.dtype)
        except ValueError as exc:  # numpy's "array is too big": check_tensors should have refused it
            raise CorruptCheckpointError(f"{self.path}: tensor {key!r} declares {info.dtype} "
                                         f"{list(info.shape)}, which no array can hold") from exc
        self._read_many([(info, out)])
        return out

    def _read_many(self, pairs: list[tuple[TensorInfo, np.ndarray]]) -> None:
        for info, out in pairs:
            self._read_into(info, out)

    def _read_into(self, info: TensorInfo, out: np.ndarray) -> None:
        raise NotImplementedError

    def verify(self, progress: Callable[[int], None] | None = None) -> list[str]:
        problems = []
        for key, info in self._tensors.items():
            try:
                self.read(key)
            except CorruptCheckpointError as exc:
                problems.append(str(exc))
            if progress is not None:
                progress(info.nbytes)
        return problems

    def close(self) -> None:
        pass

    def __enter__(self) -> BaseReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.path!r} format={self.format_name} tensors={len(self._tensors)}>"


class FileReader(BaseReader):
    """A reader that keeps its checkpoint open and reads the index on construction.

    Subclasses implement ``_open()``, reading through ``self._source`` (a
    :class:`ckpt.storage.ReadableBlob`: the local file, or for a URL the object in its
    store); a failure there closes it again.
    """

    #: True for formats whose ``_open`` bounds every shape itself (check_tensors would repeat it).
    _checks_shapes = False

    def __init__(self, path: str) -> None:
        self.path = path
        self._source: ReadableBlob = open_blob(path)
        try:
            with gc_paused():  # an index of many entries creates many small, acyclic objects
                self._open()
            if not self._checks_shapes:
                check_tensors(self._tensors, path)
        except BaseException:
            self._source.close()
            raise

    def _open(self) -> None:
        raise NotImplementedError

    def data_extents(self, key: str) -> list[tuple[int, int]] | None:
        """The (file offset, length) pieces holding a numeric tensor's bytes in C order, or None
        when its bytes are not stored that way (strings); lets callers read part of a tensor."""
        return None

    def stored_crc32c(self, key: str) -> int | None:
        """The crc32c the file stores for the bytes ``data_extents`` lists, or None (no extents,
        no checksum); lets callers check a tensor they read in parts."""
        crc = getattr(self.info(key).extra, "crc32c", None)
        return crc if isinstance(crc, int) and self.data_extents(key) is not None else None

    def read_range_into(self, offset: int, out: memoryview, what: str) -> None:
        """Read ``len(out)`` bytes at ``offset`` of the file into ``out`` (no checksum: the
        caller verifies)."""
        self._source.read_into(out, offset, what)

    def close(self) -> None:
        self._source.close()


def open_blob(path: str) -> ReadableBlob:
    """The readable blob behind a checkpoint path: a local file, or an object for a URL.

    The one place a format's path becomes bytes: formats never ask whether a path is a URL.
    A blob already opened for ``path`` and offered to the format being opened (``offering``:
    ``open_reader`` sniffed through it, a sharded reader opened a shard file) is taken instead
    of opening the path again.
    """
    if is_url(path):  # an object store: ranged GETs instead of preads
        # lazy: object-store code loads only for URLs (start-up cost of local reads)
        from ckpt._remote import RemoteFile

        return handed(path, RemoteFile) or RemoteFile(path)
    return handed(path, LocalFile) or LocalFile(path)


@runtime_checkable
class Format(Protocol):
    """The read side of a checkpoint format: a name, extensions, recognition, a reader.

    A format recognises its checkpoints in two ways, both declared here: ``claims(path)``,
    asked of every format for every path before any file is opened (for checkpoints that are
    not one file: TensorFlow's "model.ckpt-7" prefix, a directory of shards), then
    ``sniff(head)`` on the first bytes of the file; both are asked in registry order, and
    the first format to say yes opens the file. A format whose files are some of another
    format's (Keras's HDF5 files are HDF5 files) registers before it
    (``register_format(fmt, before="hdf5")``) and, when a look inside the opened file shows
    it is not its own after all, calls :func:`decline` in ``open``: the registry then asks the
    next format. Formats that also write implement :class:`WritableFormat`. Built-in formats
    subclass these Protocols (inheriting ``claims`` that returns False); a plugin may too, or
    just provide the members.
    """

    @property
    def name(self) -> str:
        """The registered name ("hdf5")."""

    @property
    def extensions(self) -> tuple[str, ...]:
        """Lower-case extensions with the dot, first is the default: (".h5", ".hdf5")."""

    @property
    def can_write(self) -> bool:
        """Whether this is a WritableFormat (foreign formats may be read-only)."""

    def claims(self, path: str) -> bool:
        """True if ``path`` names a checkpoint of this format that sniffing cannot see.

        Asked first, for every path, before any file is opened; most formats return False.
        """
        return False

    def sniff(self, head: bytes) -> bool:
        """True if a file starting with ``head`` (up to SNIFF_BYTES) is in this format."""

    def open(self, path: str) -> Reader:
        """Open ``path`` and read its index; raise a CheckpointError for a bad file, or
        :func:`decline` (a CheckpointError too) for a file that is not this format's."""


class Declined(UnsupportedCheckpointError):
    """``Format.open``'s answer for a file its ``sniff`` accepted that a closer look shows is
    not its own (raised by :func:`decline`): ``open_reader`` asks the next format whose
    ``sniff`` accepts the file; anyone else sees an UnsupportedCheckpointError."""


class _Offer:
    """What was opened for ``path`` before a format's ``open`` (the blob ``open_reader`` sniffed,
    what a declining format opened), offered to the format: taken with ``handed``."""

    def __init__(self, path: str, values: list[Any]) -> None:
        self.path, self.values = path, values

    def close(self) -> None:
        values, self.values = self.values, []
        for value in values:
            value.close()


_offer: ContextVar[_Offer | None] = ContextVar("ckpt_offer", default=None)
T = TypeVar("T")


@contextmanager
def offering(path: str, *opened: Any) -> Iterator[None]:
    """Offer ``opened`` (blobs, readers: anything with ``close()``) to the ``open`` of ``path``
    inside the block, which takes what it needs with :func:`handed`; what nobody took is closed
    when the block ends.

    Example:
        >>> import os, tempfile
        >>> from ckpt.formats import base
        >>> from ckpt.formats._io import LocalFile
        >>> path = os.path.join(tempfile.mkdtemp(), "x")
        >>> open(path, "wb").close()
        >>> blob = LocalFile(path)
        >>> with base.offering(path, blob):
        ...     base.open_blob(path) is blob
        True
        >>> blob.close()
    """
    offer = _Offer(path, list(opened))
    token = _offer.set(offer)
    try:
        yield
    finally:
        _offer.reset(token)
        offer.close()


def decline(path: str, why: str, opened: Any = None) -> NoReturn:
    """Raise :class:`Declined` from ``Format.open``: ``path`` is not this format's (``why``).

    ``opened`` (something with ``close()``, e.g. a reader of the container format) is what the
    format opened on the way: the next format ``open_reader`` asks may take it with
    :func:`handed` instead of opening the file again; it is closed when none does (at once
    when ``open`` was not called by ``open_reader``).

    Example:
        >>> from ckpt.formats import base
        >>> try:
        ...     base.decline("w.h5", "no Keras layout")
        ... except base.Declined as exc:
        ...     print(exc)
        w.h5: no Keras layout
    """
    offer = _offer.get()
    if opened is not None:
        if offer is not None and offer.path == path:
            offer.values.append(opened)
        else:
            opened.close()
    raise Declined(f"{path}: {why}")


def handed(path: str, kind: type[T]) -> T | None:
    """The ``kind`` offered to the ``open`` of ``path`` (see ``offering``, ``decline``), or None.

    Taken once: the caller owns it from then on. ``open_blob`` takes the blob ``open_reader``
    sniffed; h5plain's guarded open takes the H5pyReader the Keras format opened before seeing
    no Keras layout, so libhdf5 opens the file once.
    """
    offer = _offer.get()
    if offer is None or offer.path != path:
        return None
    for i, value in enumerate(offer.values):
        if kind is not None and isinstance(value, kind):  # (kind None: a test made the class unusable)
            del offer.values[i]
            found: T = value
            return found
    return None


def _first_to_open(path: str, head: bytes) -> Reader | None:
    """The reader of the first format whose ``sniff`` accepts ``head`` and does not decline."""
    for fmt in formats():
        if fmt.sniff(head):
            try:
                return fmt.open(path)
            except Declined:
                continue
    return None


@runtime_checkable
class WritableFormat(Format, Protocol):
    """A Format that also writes checkpoints (``can_write`` is True).

    A writer implements ``write_blob``: it writes into a :class:`ckpt.storage.WritableBlob` the
    Store hands it (a local temporary file, an upload to an object store), so one writer saves
    to every kind of storage. ``write(path, ...)`` is the path-taking convenience (a
    :class:`~ckpt.formats._io.LocalSink` on ``path``). A format written before blobs existed,
    which subclasses WritableFormat and overrides only ``write(path, ...)``, keeps working:
    its inherited ``write_blob`` has ``write`` fill a local file and copies that into the blob
    (``write_into`` picks whichever method the format's class overrides last).
    """

    def write_blob(self, blob: WritableBlob, tensors: Sequence[tuple[str, Any]],
                   metadata: Mapping[str, Any]) -> None:
        """Write a complete checkpoint into ``blob`` (new and empty; ``blob.name`` names it in
        errors), keeping the blob write order (the head first and small, patched at any time;
        everything after it front to back). Do not close the blob: its Store does.

        Each tensor is an ndarray or a lazy source with ``dtype``, ``shape`` and
        ``__array__()``; writers read a lazy source only when they write its bytes
        (``materialize``), one at a time, so converting a file needs memory for one tensor.
        A lazy source may also stream (``source_chunks``): writers that can write a tensor in
        pieces take its bytes chunk by chunk, and memory holds a chunk.

        The default (for formats that override only ``write``) stages through ``write(path)``.
        """
        stage(self.write, blob, tensors, metadata)

    def write(self, path: str, tensors: Sequence[tuple[str, Any]], metadata: Mapping[str, Any]) -> None:
        """Write a complete checkpoint to the local file ``path`` (created or emptied):
        ``write_blob`` on a LocalSink over it."""
        with _io.LocalSink(path) as blob:
            self.write_blob(blob, tensors, metadata)


def _writes_by_path(fmt: WritableFormat) -> bool:
    """True when the nearest definition of ``write`` or ``write_blob`` (a method set on the object
    itself, then its classes, most derived first) is ``write`` only: a format written against the
    path-taking contract."""
    for namespace in (getattr(fmt, "__dict__", {}), *map(vars, type(fmt).__mro__)):
        if "write_blob" in namespace:
            return False
        if "write" in namespace:
            return True
    return False


def write_into(fmt: WritableFormat, blob: WritableBlob, tensors: Sequence[tuple[str, Any]],
               metadata: Mapping[str, Any]) -> None:
    """Have ``fmt`` write a checkpoint into ``blob``: its ``write_blob``, or, for a format whose
    class overrides the path-taking ``write`` after ``write_blob`` (a subclass of a built-in
    written before blobs), that ``write`` staged through a local file (``stage``).

    Example:
        >>> import numpy as np, os, tempfile
        >>> from ckpt.formats import base, _io
        >>> path = os.path.join(tempfile.mkdtemp(), "m.msgpack")
        >>> with _io.LocalSink(path) as blob:
        ...     base.write_into(base.get_format("msgpack"), blob, [("w", np.ones(2))], {})
        >>> base.open_reader(path).close()
    """
    if _writes_by_path(fmt):  # a lazy format's own write_blob loads the real format and comes back here
        stage(fmt.write, blob, tensors, metadata)
    else:
        fmt.write_blob(blob, tensors, metadata)


#: Bytes copied at a time from a staged file into its blob.
_STAGE_CHUNK = 8 << 20


def stage(write: Callable[[str, Sequence[tuple[str, Any]], Mapping[str, Any]], None], blob: WritableBlob,
          tensors: Sequence[tuple[str, Any]], metadata: Mapping[str, Any]) -> None:
    """Run a path-taking ``write(path, tensors, metadata)`` for ``blob``: on the blob's own file
    when it is a new local file (no copy), else on a local temporary file that is then copied
    into the blob front to back in bounded chunks."""
    if isinstance(blob, _io.LocalSink) and blob.size == 0:
        write(blob.name, tensors, metadata)
        return
    import tempfile  # lazy: only formats written against the path-taking contract stage (start-up cost)

    fd, path = tempfile.mkstemp(prefix=".ckpt-stage-")
    try:
        os.close(fd)
        write(path, tensors, metadata)
        with open(path, "rb", buffering=0) as f:
            buf = memoryview(bytearray(_STAGE_CHUNK))
            offset = 0
            while True:
                n = f.readinto(buf)
                if not n:
                    break
                blob.write_at(buf[:n], offset)
                offset += n
    finally:
        os.unlink(path)


class LazyFormat(Format):
    """A registered format whose module is imported the first time it is needed.

    The registry asks every format's ``claims`` for every path and each format's ``sniff``
    in turn: with lazy formats, recognising one of ckpt's own files imports that format's
    module only (``ckpt inspect`` starts faster). ``may_claim`` is a cheap test of a path
    that is True wherever the format's own ``claims`` may be (a directory, an extension);
    without it the format claims nothing. Likewise ``may_sniff``, a cheap test of the first
    bytes True wherever the format's ``sniff`` may be, lets a format asked early (before
    "hdf5") say no without its module. Anything else asked of it goes to the real format.

    Example:
        >>> from ckpt.formats import base
        >>> fmt = base.lazy_format("hdf5", (".h5", ".hdf5"), True, "ckpt.formats.hdf5:Hdf5Format")
        >>> fmt.name, fmt.claims("model.h5"), type(fmt.load()).__name__
        ('hdf5', False, 'Hdf5Format')
    """

    def __init__(self, name: str, extensions: tuple[str, ...], can_write: bool, target: str,
                 may_claim: Callable[[str], bool] | None = None,
                 may_sniff: Callable[[bytes], bool] | None = None) -> None:
        self._name, self._extensions, self._can_write = name, extensions, can_write
        self._target, self._may_claim, self._may_sniff = target, may_claim, may_sniff
        self._format: Format | None = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def extensions(self) -> tuple[str, ...]:
        return self._extensions

    @property
    def can_write(self) -> bool:
        return self._can_write

    def load(self) -> Format:
        """Import the format's module (once) and return the real format."""
        fmt = self._format
        if fmt is None:
            module, _, cls = self._target.partition(":")
            fmt = getattr(importlib.import_module(module), cls)()
            if (fmt.name, tuple(fmt.extensions), fmt.can_write) != (self._name, self._extensions, self._can_write):
                raise TypeError(f"{self._target} is format {fmt.name!r} {fmt.extensions} (can_write={fmt.can_write}); "
                                f"it was registered as {self._name!r} {self._extensions} (can_write={self._can_write})")
            self._format = fmt
        return fmt

    def claims(self, path: str) -> bool:
        return self._may_claim is not None and self._may_claim(path) and self.load().claims(path)

    def sniff(self, head: bytes) -> bool:
        return (self._may_sniff is None or self._may_sniff(head)) and self.load().sniff(head)

    def open(self, path: str) -> Reader:
        return self.load().open(path)

    def __getattr__(self, attr: str) -> Any:
        # the real format's other members; never the Protocol's (isinstance checks must not import)
        if attr.startswith("_") or attr in ("write", "write_blob"):
            raise AttributeError(attr)
        return getattr(self.load(), attr)

    def __repr__(self) -> str:
        return f"<format {self._name} ({self._target}{', loaded' if self._format is not None else ''})>"


class _LazyWritableFormat(LazyFormat, WritableFormat):
    def write_blob(self, blob: WritableBlob, tensors: Sequence[tuple[str, Any]],
                   metadata: Mapping[str, Any]) -> None:
        fmt = self.load()
        assert isinstance(fmt, WritableFormat)  # load() checked can_write
        write_into(fmt, blob, tensors, metadata)

    def write(self, path: str, tensors: Sequence[tuple[str, Any]], metadata: Mapping[str, Any]) -> None:
        fmt = self.load()
        assert isinstance(fmt, WritableFormat)  # load() checked can_write
        fmt.write(path, tensors, metadata)


def lazy_format(name: str, extensions: tuple[str, ...], can_write: bool, target: str,
                may_claim: Callable[[str], bool] | None = None,
                may_sniff: Callable[[bytes], bool] | None = None) -> LazyFormat:
    """A :class:`LazyFormat` for the format class ``target`` ("package.module:Class"), to register.

    Example:
        >>> from ckpt.formats import base
        >>> base.lazy_format("msgpack", (".msgpack",), True, "ckpt.formats.msgpack:MsgpackFormat").can_write
        True
    """
    cls = _LazyWritableFormat if can_write else LazyFormat
    return cls(name, extensions, can_write, target, may_claim, may_sniff)


_registry: dict[str, Format] = {}
_lock = threading.Lock()


def register_format(fmt: Format, *, replace: bool = False, before: str | None = None) -> None:
    """Make a format available to ``Saver``, ``load_checkpoint`` and the CLI.

    The registry's order is the order in which formats are asked (``claims``, ``sniff``, an
    extension in ``format_for_path``): a new format comes last unless ``before`` names a
    registered format it must be asked before.

    Args:
        fmt: an object with the Format protocol's attributes and methods.
        replace: allow replacing a registered format of the same name (it keeps its place
            unless ``before`` is given).
        before: the name of a registered format; ``fmt`` is asked before it. For a format
            whose files are some of that format's (the built-in "keras" is registered before
            "hdf5": Keras's weights files are HDF5 files with Keras's layout).

    Example:
        >>> from ckpt.formats import base
        >>> class Nothing(base.Format):
        ...     name, extensions, can_write = "nothing", (".nothing",), False
        ...     def sniff(self, head): return head.startswith(b"NOTHING")
        ...     def open(self, path): raise NotImplementedError
        >>> base.register_format(Nothing())
        >>> base.format_for_path("x.nothing").name
        'nothing'
        >>> base.unregister_format("nothing")
    """
    missing = [m for m in ("name", "extensions", "can_write", "claims", "sniff", "open") if not hasattr(fmt, m)]
    if missing:  # a plugin written against the Protocol without subclassing it
        raise TypeError(f"{fmt!r} is not a Format: it has no {', '.join(map(repr, missing))}")
    if fmt.can_write and hasattr(fmt, "write") and not hasattr(fmt, "write_blob"):
        raise TypeError(f"{fmt!r}: a writable format needs write_blob(blob, tensors, metadata): subclass "
                        "ckpt.WritableFormat (its write_blob runs a path-taking write through a local file) "
                        "or define write_blob (docs/storage.md)")
    if fmt.can_write != isinstance(fmt, WritableFormat):
        raise TypeError(f"{fmt!r}: can_write is {fmt.can_write} but it {'has no' if fmt.can_write else 'has a'} "
                        "write method")
    if isinstance(fmt, WritableFormat) and not isinstance(fmt, LazyFormat) and not any(
            "write" in vars(k) or "write_blob" in vars(k) for k in type(fmt).__mro__ if k is not WritableFormat):
        raise TypeError(f"{fmt!r}: a writable format must define write_blob (or the older write(path, ...))")
    with _lock:
        if fmt.name in _registry and not replace:
            raise ValueError(f"a format named {fmt.name!r} is already registered")
        if before is None:
            _registry[fmt.name] = fmt
            return
        if before not in _registry or before == fmt.name:
            raise ValueError(f"cannot register {fmt.name!r} before {before!r}: no other format of that name "
                             f"is registered (known: {', '.join(_registry)})")
        order = [(name, f) for name, f in _registry.items() if name != fmt.name]
        at = next(i for i, (name, _) in enumerate(order) if name == before)
        _registry.clear()
        _registry.update(order[:at] + [(fmt.name, fmt)] + order[at:])


def unregister_format(name: str) -> None:
    """Remove a registered format (mainly for tests and plugins)."""
    with _lock:
        _registry.pop(name, None)


def formats() -> list[Format]:
    """Return the registered formats, built-ins first."""
    with _lock:
        return list(_registry.values())


def get_format(name: str) -> Format:
    """Return the registered format called ``name``."""
    for fmt in formats():
        if fmt.name == name:
            return fmt
    raise ValueError(f"unknown checkpoint format {name!r}; known: {', '.join(f.name for f in formats())}")


def format_for_path(path: str | os.PathLike[str]) -> Format | None:
    """Return the first registered format whose extension ``path`` ends with, or None.

    ckpt's own formats are registered first, so ".msgpack" means ckpt's msgpack, not Flax's.
    """
    lower = os.fspath(path).lower()
    for fmt in formats():
        if any(lower.endswith(ext) for ext in fmt.extensions):
            return fmt
    return None


def open_reader(path: str | os.PathLike[str]) -> Reader:
    """Open a checkpoint file, recognising its format from its content.

    Raises:
        CheckpointNotFoundError: the file does not exist.
        UnsupportedCheckpointError: no registered format recognises it.
    """
    path = os.fspath(path)
    for fmt in formats():
        if fmt.claims(path):
            return fmt.open(path)
    source = _open_to_sniff(path)
    try:
        head = _io.pread(source, 0, min(source.size, SNIFF_BYTES), "the first bytes")
        with offering(path, source):  # the format's reader reads through the same blob
            reader = _first_to_open(path, head)
    except BaseException:
        source.close()
        raise
    if reader is not None:
        return reader
    known = ", ".join(f"{f.name} ({'/'.join(f.extensions)})" for f in formats())
    what = "an empty file" if not head else "not a checkpoint in any supported format"
    raise UnsupportedCheckpointError(f"{path}: {what}; supported formats: {known}")


def _open_to_sniff(path: str) -> ReadableBlob:
    """``open_blob(path)``, an OSError turned into the CheckpointError it means."""
    try:
        return open_blob(path)
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such checkpoint file") from None
    except IsADirectoryError:
        raise CheckpointNotFoundError(f"{path}: is a directory, not a checkpoint file") from None
    except PermissionError as exc:  # it exists: not a "not found" that code may take for a fresh start
        raise CheckpointError(f"{path}: cannot open: {exc.strerror or exc}") from exc
    except OSError as exc:  # EIO and friends: the storage under the file is failing
        raise CorruptCheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from exc


def source_chunks(source: Any) -> Iterator[memoryview] | None:
    """A lazy numeric source's C-order bytes in pieces, or None when it does not stream.

    A streaming source has ``chunks()``, yielding flat byte buffers in order, each valid until
    the next is asked for; the writer checks that they add up to ``dtype`` x ``shape``.
    """
    if isinstance(source, np.ndarray) or dtypes.is_string(np.dtype(source.dtype)):
        return None
    chunks = getattr(source, "chunks", None)
    return None if chunks is None else (memoryview(c).cast("B") for c in chunks())


def materialize(source: Any) -> np.ndarray:
    """The array behind a tensor handed to a writer: an ndarray itself, a lazy source read now."""
    return source if isinstance(source, np.ndarray) else np.asarray(source)


def validate_keys(keys: Iterable[str], where: str = "checkpoint") -> None:
    """Raise ValueError unless every key follows ckpt's key rules.

    Keys are "/"-separated, with no empty, "." or ".." parts, no NUL, valid UTF-8, unique,
    and no key may also be a prefix of another ("a" and "a/b"), so any checkpoint can be
    converted to any format.
    """
    keys = list(keys)
    seen: set[str] = set(keys) if keys_plainly_valid(keys) else set()  # all at once, or one by one
    if len(seen) != len(keys):
        seen = set()
        for key in keys:
            problem = key_problem(key)
            if problem:
                raise ValueError(f"{where}: invalid key {key!r}: {problem}")
            if key in seen:
                raise ValueError(f"{where}: duplicate key {key!r}")
            seen.add(key)
    scopes: set[str] = set()
    for key in seen:
        scope = key.rpartition("/")[0]
        while scope and scope not in scopes:  # siblings share their scopes: stop at a known one
            scopes.add(scope)
            scope = scope.rpartition("/")[0]
    clash = sorted(seen & scopes)
    if clash:
        child = next(k for k in sorted(seen) if k.startswith(clash[0] + "/"))
        raise ValueError(f"{where}: key {clash[0]!r} is both a tensor and a scope of {child!r}")


def key_problem(key: object) -> str:
    """Return why ``key`` breaks the key rules, or "" when it is valid."""
    if type(key) is not str:
        return f"keys are strings, got {type(key).__name__}"
    if not key:
        return "empty key"
    if "\x00" in key:
        return "contains NUL"
    wrapped = f"/{key}/"
    if "//" in wrapped or "/./" in wrapped or "/../" in wrapped:
        return "empty, '.' or '..' part (keys are '/'-separated names)"
    if not key.isascii():
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            return "not valid UTF-8"
    return ""


def keys_plainly_valid(keys: Sequence[Any]) -> bool:
    """True when every key is a valid key (``key_problem``), checked on all of them at once.

    One pass of C string searches over the joined keys instead of a Python call per key (an
    index can hold 10,000s). False says only "look closer": the caller then checks key by key
    with ``key_problem``, which names the problem. Duplicates are not looked for.
    """
    try:
        joined = "\x00".join(keys)  # TypeError for a key that is not a str
    except TypeError:
        return False
    if joined.count("\x00") != len(keys) - 1:  # a NUL inside a key
        return False
    wrapped = "/" + joined.replace("\x00", "/\x00/") + "/"  # "/key/" each: empty, "." and ".." parts show
    if "//" in wrapped or "/./" in wrapped or "/../" in wrapped:
        return False
    if not wrapped.isascii():
        try:
            wrapped.encode("utf-8")
        except UnicodeEncodeError:
            return False
    return True


def all_lists(values: Iterable[Any], length: int | None = None) -> bool:
    """True when every value is a list (of ``length`` items, if given): one C pass each, for
    index checks over 10,000s of entries. Also True for no values."""
    values = values if isinstance(values, (list, tuple)) else list(values)
    return set(map(type, values)) <= {list} and (length is None or set(map(len, values)) <= {length})


def all_exactly(values: Iterable[Any], kind: type) -> bool:
    """True when every value's type is exactly ``kind`` (no subclass: bool is not an int)."""
    return set(map(type, values)) <= {kind}


def plain_extents(shapes: Sequence[Any], offsets: Sequence[Any], sizes: Sequence[Any], crcs: Sequence[Any],
                  found: Sequence[np.dtype], start: int, end: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The offsets and the ends of tensors' bytes as int64 columns, when every entry of an index
    is plain: a shape list of at most 64 positive ints and at most MAX_ELEMENTS elements, a
    numeric dtype, a uint32 checksum, and bytes that fit its shape and lie in file order within
    ``[start, end)``; else None. Checked on all entries at once (numpy over whole columns), for
    the index fast paths of ckpt's own formats: None only says "look closer", entry by entry.
    """
    if not all_lists(shapes) or max(map(len, shapes)) > 64:
        return None
    dims = list(itertools.chain.from_iterable(shapes))
    columns = (offsets, sizes, crcs, dims)
    if not all_exactly(itertools.chain(*columns), int):
        return None
    try:
        offset, n, crc, dim = (np.array(c, dtype=np.int64) for c in columns)
    except OverflowError:  # beyond 64 bits: the loop says which
        return None
    if len(dim) and (dim.min() < 1 or dim.max() > MAX_ELEMENTS):  # zero dimensions: the loop
        return None
    counts = list(map(math.prod, shapes))  # exact: Python ints
    if max(counts) > MAX_ELEMENTS or any(d.kind == "O" for d in found):
        return None
    ends = offset + n
    if offset[0] < start or n.min() < 0 or ends.max() > end or (ends[:-1] > offset[1:]).any() or \
            crc.min() < 0 or crc.max() >= 2 ** 32 or \
            not np.array_equal(np.array(counts, dtype=np.int64) * [d.itemsize for d in found], n):
        return None
    return offset, ends


def unique_pairs(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """A decoder's map from its (key, value) pairs; ValueError for a key given twice.

    For ``object_pairs_hook`` (json, msgpack): a plain dict would keep the last value silently.
    """
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[Any] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"duplicate key {dup!r}")
    return out


def check_version(version: Any, supported: int, what: str, path: str) -> None:
    """Refuse a format version that is not a positive int, or newer than ``supported``."""
    if type(version) is not int or version < 1:
        raise CorruptCheckpointError(f"{path}: invalid format version {version!r}")
    if version > supported:
        raise UnsupportedCheckpointError(
            f"{path}: written by a newer ckpt ({what} format version {version}; this version of ckpt "
            f"reads up to {supported}): upgrade ckpt to read it")


_FILE_DTYPES = {name: dtypes.as_dtype(name) for name in dtypes.NAMES}


def dtype_or_raise(name: Any, path: str, key: str) -> np.dtype:
    """Resolve a canonical dtype name read from a file, or raise CorruptCheckpointError."""
    dtype = _FILE_DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        raise CorruptCheckpointError(f"{path}: tensor {key!r} has unknown dtype {name!r}")
    return dtype


#: The most elements a shape may describe, zero dimensions aside (numpy refuses larger arrays
#: even when they are empty, and no file holds that many).
MAX_ELEMENTS = 2 ** 48


def check_shape(shape: Any, path: str, key: str) -> tuple[int, ...]:
    """Validate a shape read from a file: a list (or tuple) of non-negative ints of sane rank and
    size; the product of its non-zero dimensions is bounded too, since numpy cannot make even an
    empty array of shape [0, 2**62]."""
    if type(shape) not in (list, tuple) or len(shape) > 64:
        raise CorruptCheckpointError(f"{path}: tensor {key!r} has an invalid shape {shape!r}")
    count = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise CorruptCheckpointError(f"{path}: tensor {key!r} has an invalid shape {shape!r}")
        count *= max(d, 1)
        if count > MAX_ELEMENTS:
            raise CorruptCheckpointError(f"{path}: tensor {key!r} declares shape {shape!r}, more elements "
                                         f"than any checkpoint holds (at most {MAX_ELEMENTS})")
    return tuple(shape)


def check_tensors(tensors: Mapping[str, TensorInfo], path: str) -> None:
    """Every tensor a reader lists must have a shape numpy can hold (``check_shape``).

    Called for every reader once its index is read (FileReader does it itself), so a format's
    own parsing may miss a bound without a raw numpy error reaching the user later.
    """
    for key, info in tensors.items():
        check_shape(info.shape, path, key)


def check_metadata(metadata: Any, path: str) -> dict[str, Any]:
    """Metadata read from a file must be plain JSON-like data (what ckpt writes), or it is corrupt."""
    try:
        return normalize_metadata(metadata, path)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{path}: the metadata is not what ckpt writes: {exc}") from None


def normalize_metadata(metadata: Mapping[str, Any] | None, path: str) -> dict[str, Any]:
    """Return ``metadata`` as plain JSON-like data both formats store, or raise ValueError.

    Keys are strings; values are None, bool, int (64-bit), float, str, lists and maps of
    these. numpy scalars and arrays are converted with ``tolist()``.
    """

    def convert(value: Any, where: str, depth: int) -> Any:
        if depth > 32:
            raise ValueError(f"{path}: metadata {where} is nested too deeply")
        if isinstance(value, (np.generic, np.ndarray)) and value.dtype.kind in "biufc":
            value = value.tolist()
        if value is None or isinstance(value, (bool, float, str)):
            return value
        if isinstance(value, int):
            if not -(2 ** 63) <= value < 2 ** 64:
                raise ValueError(f"{path}: metadata {where} = {value} does not fit in 64 bits")
            return value
        if isinstance(value, (list, tuple)):
            return [convert(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            out: dict[str, Any] = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    raise ValueError(f"{path}: metadata keys must be strings, got {k!r} in {where}")
                out[k] = convert(v, f"{where}.{k}" if where else k, depth + 1)
            return out
        raise ValueError(f"{path}: metadata {where or 'value'} is a {type(value).__name__}; use None, "
                         "bool, int, float, str, lists and dicts")

    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise ValueError(f"{path}: metadata must be a dict, got {type(metadata).__name__}")
    normalized: dict[str, Any] = convert(metadata, "", 0)
    return normalized
