"""The Reader protocol every format's open checkpoint implements, and the base classes the
formats build their readers on (key lookup with clear errors, batched reads, a kept-open blob).

Example:
    >>> import numpy as np
    >>> from ckpt.formats import _readers
    >>> class One(_readers.BaseReader):
    ...     path, format_name = "one", "demo"
    ...     _tensors = {"w": _readers.TensorInfo("w", np.dtype("float32"), (2,), 8)}
    ...     _metadata = {}
    ...     def _read_into(self, info, out): out[...] = 1
    >>> One().read("w")
    array([1., 1.], dtype=float32)
"""

from __future__ import annotations

import operator
from collections.abc import Callable, ItemsView, Iterator, Mapping, Sequence, ValuesView
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from ckpt.checksums import crc32c
from ckpt.errors import CorruptCheckpointError, KeyNotFoundError, MismatchError, closest_hint
from ckpt.gcpause import gc_paused
from ckpt.storage import ReadableBlob

from ._blobs import open_blob
from ._slicing import box, check_box
from ._validation import check_tensors


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


_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")


class LazyIndex(Mapping[str, TensorInfo]):
    """An index of many tensors kept as a key → row map and columns, each TensorInfo built when
    asked for (``build(key, row)``).

    Why: 10,000s of TensorInfo tuples built on open are mostly never looked at, and all of them
    are objects the cyclic GC walks at its next pass. A dict of str → int and columns of ints
    hold the same facts in a handful of objects the GC does not track. The reader validates
    every row before it hands out the index, exactly as for a dict of TensorInfo. What is built
    is kept (until the reader goes): only the entries a caller asked for.
    """

    __slots__ = ("_build", "_build_all", "_built", "_rows")

    def __init__(self, rows: dict[str, int], build: Callable[[str, int], TensorInfo],
                 build_all: Callable[[], dict[str, TensorInfo]] | None = None) -> None:
        self._rows = rows
        self._build = build
        self._build_all = build_all  # every entry at once, in C loops: ~2x faster per entry than build
        self._built: dict[str, TensorInfo] = {}  # each built once: a restore looks every key up twice

    def as_dict(self) -> dict[str, TensorInfo]:
        """Every entry, built at once: for callers that visit most keys (a restore's plan)."""
        if len(self._built) < len(self._rows):
            if self._build_all is None:
                self._built = {key: self[key] for key in self._rows}
            else:
                self._built = self._build_all()
        return self._built

    def __getitem__(self, key: str) -> TensorInfo:
        info = self._built.get(key)
        if info is None:
            info = self._built[key] = self._build(key, self._rows[key])
        return info

    def get(self, key: str, default: Any = None) -> Any:
        info = self._built.get(key)
        if info is None:
            row = self._rows.get(key)
            if row is None:
                return default
            info = self._built[key] = self._build(key, row)
        return info

    def items(self) -> ItemsView[str, TensorInfo]:
        return self.as_dict().items()  # visiting every entry: all built at once

    def values(self) -> ValuesView[TensorInfo]:
        return self.as_dict().values()

    def __contains__(self, key: object) -> bool:
        return key in self._rows

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        return f"<LazyIndex of {len(self._rows)} tensors>"


def as_dict(tensors: Mapping[str, TensorInfo]) -> Mapping[str, TensorInfo]:
    """``tensors`` with every entry built (a LazyIndex's ``as_dict``): plain dict lookups for a
    caller about to visit most of them."""
    return tensors.as_dict() if isinstance(tensors, LazyIndex) else tensors


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

    # the optional abilities: BaseReader declares each with a default, so callers call them directly

    partial_reads: bool

    def read_planned(self, pairs: Sequence[tuple[TensorInfo, np.ndarray]]) -> None:
        """``read_into_many`` for (TensorInfo, buffer) pairs already checked against the index."""

    def match_exact(self, keys: Sequence[str], shapes: Sequence[tuple[int, ...]],
                    dtypes: Sequence[np.dtype]) -> Sequence[Any] | None:
        """A handle per key when every ``keys[i]`` is a tensor of exactly ``shapes[i]`` and
        ``dtypes[i]``, for ``read_matched``; None otherwise."""

    def read_matched(self, handles: Sequence[Any], buffers: Sequence[np.ndarray]) -> None:
        """Read the tensors of ``match_exact`` handles into ``buffers``, verifying them."""

    def read_slice(self, key: str, index: Any) -> np.ndarray:
        """Read ``tensor[index]`` (ints and step-1 slices)."""

    def read_box_into(self, key: str, offset: Sequence[int], out: np.ndarray) -> None:
        """Read the block ``[offset, offset + out.shape)`` of tensor ``key`` into ``out``."""

    def data_extents(self, key: str) -> list[tuple[int, int]] | None:
        """The (file offset, length) pieces of a tensor's C-order bytes, or None."""

    def stored_crc32c(self, key: str) -> int | None:
        """The crc32c the file stores for the bytes ``data_extents`` lists, or None."""

    def block_checksums(self, key: str) -> tuple[np.ndarray, int] | None:
        """The crc32c of each block of a tensor's stored bytes and the block size, or None."""

    def read_range_into(self, offset: int, out: memoryview, what: str) -> None:
        """Read ``len(out)`` bytes at ``offset`` of the file into ``out`` (unchecked)."""

    def read_range_crc32c(self, offset: int, out: memoryview, what: str) -> int:
        """``read_range_into``, returning the crc32c of the bytes read."""

    def byte_reader(self, key: str) -> Callable[[int, memoryview], None] | None:
        """A function reading a tensor's C-order bytes from a position (unchecked), or None."""

    def close(self) -> None: ...

    def __enter__(self) -> Reader: ...

    def __exit__(self, *exc: object) -> None: ...


class BaseReader:
    """Shared behaviour for readers: key lookup with clear errors, ``read``, context manager,
    and every optional ability a reader may have, each with a default that works for any format.

    Subclasses set ``path``, ``format_name``, ``_tensors`` (a mapping: a dict, or a LazyIndex)
    and ``_metadata`` and implement
    ``_read_into(info, out)``. Entries a file holds that are not tensors (TensorFlow's object
    graph) go into ``_metadata["non_tensors"]`` as {key: description}; inspect shows them.

    The abilities (override what the format does better than the default): ``read_box_into``
    (and so ``read_slice``) for reading part of a tensor, setting ``partial_reads``;
    ``data_extents``, ``stored_crc32c`` and ``read_range_into`` for tensors stored as checksummed
    bytes at known offsets (streamed in chunks); ``byte_reader`` for tensors whose bytes are not
    at file offsets but can be read in parts; ``block_checksums``; ``read_planned``;
    ``match_exact`` and ``read_matched`` for restores of many tensors that all match.
    """

    path: str = ""
    format_name: str = ""
    #: False for files whose data carries no checksums (foreign files): verify() cannot vouch for them.
    checksummed: bool = True
    #: True when ``read_box_into`` reads only (about) the block asked for; the default reads the whole
    #: tensor, so callers that would read a big tensor in many blocks read it whole once instead.
    partial_reads: bool = False
    #: A dict, or a LazyIndex for formats whose indexes run to 10,000s of entries.
    _tensors: Mapping[str, TensorInfo]
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
                f"{self.path}: tensor {key!r} not found in checkpoint{closest_hint(key, self._tensors)}",
                path=self.path, key=key) from None

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
                                    f"cannot read it into a {out.dtype} {list(out.shape)} array",
                                    path=self.path, key=key)
            pairs.append((info, out))
        self._read_many(pairs)

    def read_planned(self, pairs: Sequence[tuple[TensorInfo, np.ndarray]]) -> None:
        """``read_into_many`` for pairs a caller has already matched against this reader's index.

        Each pair is a TensorInfo of ``self.tensors`` and a C-contiguous, writable buffer of its
        exact shape and dtype (a restore's plan checks both once): nothing is looked up or
        checked again, which matters for 10,000s of small tensors.
        """
        self._read_many(pairs if isinstance(pairs, list) else list(pairs))

    def match_exact(self, keys: Sequence[str], shapes: Sequence[tuple[int, ...]],
                    dtypes: Sequence[np.dtype]) -> Sequence[Any] | None:
        """Handles for ``read_matched`` when tensor ``keys[i]`` is in the index with exactly
        ``shapes[i]`` and ``dtypes[i]`` for every i (shapes as tuples, both as lists: they are
        compared as whole lists); None when any key is missing or differs, and the caller then
        matches key by key to name each problem. Nothing is read.

        Why: a restore of 10,000s of small tensors that all match (the usual case) is checked in
        a few C loops instead of a Python loop per tensor. The default's handles are TensorInfos;
        a format with a columnar index (msgpack) hands out row numbers and builds none.
        """
        tensors = as_dict(self._tensors)
        infos = list(map(tensors.get, keys))
        if None in infos or list(map(_SHAPE, infos)) != shapes or list(map(_DTYPE, infos)) != dtypes:
            return None
        return infos

    def read_matched(self, handles: Sequence[Any], buffers: Sequence[np.ndarray]) -> None:
        """Read the tensors ``match_exact`` returned ``handles`` for into ``buffers`` (C-contiguous,
        writable, each of its tensor's shape and dtype), verifying every checksum; any part of
        ``handles`` may be read at a time."""
        self.read_planned(list(zip(handles, buffers)))

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

    def read_slice(self, key: str, index: Any) -> np.ndarray:
        """Read ``tensor[index]`` (ints and step-1 slices, as ``np.s_[2:4, :]``) through
        ``read_box_into``."""
        info = self.info(key)
        bounds, shape = box(index, info.shape)
        out = np.empty(tuple(b - a for a, b in bounds), info.dtype)
        self.read_box_into(key, tuple(a for a, _ in bounds), out)
        return out.reshape(shape)

    def read_box_into(self, key: str, offset: Sequence[int], out: np.ndarray) -> None:
        """Read the block ``[offset, offset + out.shape)`` of tensor ``key`` into ``out``
        (MismatchError if it is not inside the tensor). The default reads the whole tensor
        (verified) and copies the block out; formats that can read part of a tensor override it."""
        bounds = check_box(self.info(key), offset, out.shape, self.path)
        out[...] = self.read(key)[tuple(slice(a, b) for a, b in bounds)]

    def data_extents(self, key: str) -> list[tuple[int, int]] | None:
        """The (file offset, length) pieces holding a numeric tensor's bytes in C order, or None
        when its bytes are not stored that way (strings, most foreign formats); lets callers read
        part of a tensor with ``read_range_into``."""
        return None

    def stored_crc32c(self, key: str) -> int | None:
        """The crc32c the file stores for the bytes ``data_extents`` lists, or None (no extents,
        no checksum); lets callers check a tensor they read in parts."""
        return None

    def block_checksums(self, key: str) -> tuple[np.ndarray, int] | None:
        """The crc32c of each block of a tensor's stored bytes and the block size in bytes, as the
        file stores them; None when it stores no such table (one checksum for the tensor, or none)."""
        return None

    def read_range_into(self, offset: int, out: memoryview, what: str) -> None:
        """Read ``len(out)`` bytes at ``offset`` of the file into ``out`` (no checksum: the
        caller verifies). Only asked of a reader whose ``data_extents`` lists extents."""
        raise NotImplementedError(f"{type(self).__name__} lists data_extents but does not read ranges")

    def read_range_crc32c(self, offset: int, out: memoryview, what: str) -> int:
        """``read_range_into``, returning the crc32c of the bytes read (for the caller to check)."""
        self.read_range_into(offset, out, what)
        return crc32c(out)

    def byte_reader(self, key: str) -> Callable[[int, memoryview], None] | None:
        """For a numeric tensor whose bytes ``data_extents`` cannot list (an incremental index's
        chunks): ``fetch(start, out)``, filling ``out`` with the tensor's C-order bytes from byte
        ``start`` without checking them (the caller holds checksums of them: a sharded
        checkpoint's commit record); None when the reader cannot read part of the tensor."""
        return None

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
    :class:`ckpt.storage.ReadableBlob`: ``blob`` when given, the one ``Format.open`` was handed,
    else the local file or, for a URL, the object in its store). A failure there closes a blob
    the reader opened itself; a blob handed in stays its caller's until the constructor returns.
    """

    #: True for formats whose ``_open`` bounds every shape itself (check_tensors would repeat it).
    _checks_shapes = False

    def __init__(self, path: str, blob: ReadableBlob | None = None) -> None:
        self.path = path
        self._source: ReadableBlob = open_blob(path) if blob is None else blob
        try:
            with gc_paused():  # an index of many entries creates many small, acyclic objects
                self._open()
            if not self._checks_shapes:
                check_tensors(self._tensors, path)
        except BaseException:
            if blob is None:
                self._source.close()
            raise

    def _open(self) -> None:
        raise NotImplementedError

    def stored_crc32c(self, key: str) -> int | None:
        # ckpt's own formats keep a tensor's crc32c as the ``crc32c`` field of its TensorInfo.extra
        crc = getattr(self.info(key).extra, "crc32c", None)
        return crc if isinstance(crc, int) and self.data_extents(key) is not None else None

    def read_range_into(self, offset: int, out: memoryview, what: str) -> None:
        self._source.read_into(out, offset, what)

    def read_range_crc32c(self, offset: int, out: memoryview, what: str) -> int:
        # the storage layer reads on the I/O pool and checksums the bytes there, still in cache
        return int(self._source.read_spans([(offset, out)], lambda i: what)[0])

    def close(self) -> None:
        self._source.close()
