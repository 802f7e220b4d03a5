"""Reading checkpoints without a model: load_checkpoint, list_variables, load_variable.

Opening a checkpoint reads its index only; ``get_tensor`` reads just that tensor.

Example:
    >>> import ckpt, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "m.msgpack")
    >>> with ckpt.name_scope("enc"):
    ...     k = ckpt.Variable([[1.0, 2.0, 3.0]], name="kernel")
    >>> _ = ckpt.Saver([k]).save(path)
    >>> ckpt.list_variables(path)
    [('enc/kernel', [1, 3])]
    >>> ckpt.load_variable(path, "enc/kernel:0")
    array([[1., 2., 3.]], dtype=float32)
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from ckpt.saving import locations as _locations
from ckpt.storage.urls import StorageOptions, check_options, is_url
from ckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ckpt.formats.base import Reader, open_reader  # the registry; importing it registers the built-ins

__all__ = ["CheckpointReader", "open_checkpoint", "load_checkpoint", "list_variables", "load_variable"]


def open_checkpoint(path: str | os.PathLike[str], storage_options: StorageOptions | None = None) -> Reader:
    """Open a checkpoint file, or a directory's latest checkpoint, as a format Reader.

    A directory's latest checkpoint can be deleted by another process's ``max_to_keep``
    between looking it up and opening it; then the lookup is repeated. Object-store URLs
    are opened with ``storage_options`` (see ``ckpt.storage.remote``).

    Raises:
        TypeError: ``storage_options`` is not a mapping.
    """
    check_options(storage_options)
    is_dir = os.path.isdir(path)
    for attempt in range(5):
        try:
            return open_reader(_locations.resolve_checkpoint(path, storage_options), storage_options=storage_options)
        except FileNotFoundError as exc:  # also from a format's own open(), after the sniffing one
            if not is_dir or attempt == 4:
                if isinstance(exc, CheckpointError):
                    raise
                where = str(exc.filename or os.fspath(path))
                raise CheckpointNotFoundError(f"{where}: no such checkpoint file", path=where) from exc
        except OSError as exc:  # the state file or a format's own open() failing (EIO, EMFILE)
            if isinstance(exc, CheckpointError):
                raise
            where = str(exc.filename or os.fspath(path))
            raise CorruptCheckpointError(f"{where}: cannot read: {exc.strerror or exc}", path=where) from exc
    raise AssertionError("unreachable")


class CheckpointReader(Mapping[str, np.ndarray]):
    """TensorFlow's CheckpointReader over any supported checkpoint file, and a read-only
    Mapping of key -> tensor: ``reader["k"]`` reads that tensor only, ``"k" in reader``,
    ``len(reader)``, iteration and ``.keys()`` use the index alone.

    Use it as a context manager (or call ``close``) to release the file.

    Example:
        >>> import ckpt, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "r.h5")
        >>> _ = ckpt.Saver({"w": ckpt.Variable([1, 2])}).save(path)
        >>> with ckpt.load_checkpoint(path) as reader:
        ...     reader.get_variable_to_shape_map(), reader.get_tensor("w")
        ({'w': [2]}, array([1, 2], dtype=int32))
        >>> with ckpt.load_checkpoint(path) as reader:
        ...     list(reader), "w" in reader, len(reader), reader["w"]
        (['w'], True, 1, array([1, 2], dtype=int32))
    """

    def __init__(self, reader: Reader) -> None:
        self._reader = reader

    def __getitem__(self, key: str) -> np.ndarray:
        """Read one tensor; a missing key raises KeyNotFoundError (a KeyError)."""
        return self.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._reader.tensors)

    def __len__(self) -> int:
        return len(self._reader.tensors)

    def __contains__(self, key: object) -> bool:
        return key in self._reader.tensors  # the index only: no tensor is read

    # a reader is a file handle: equal only to itself (Mapping would compare every tensor)
    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__

    @property
    def path(self) -> str:
        """The checkpoint file."""
        return str(self._reader.path)

    @property
    def format(self) -> str:
        """The format's registered name ("hdf5", "msgpack", ...)."""
        return str(self._reader.format_name)

    @property
    def metadata(self) -> dict[str, Any]:
        """The user metadata saved with the checkpoint."""
        return dict(self._reader.metadata)

    @property
    def tensors(self) -> Any:
        """A read-only mapping key -> TensorInfo (dtype, shape, nbytes) of every tensor, in file order."""
        return self._reader.tensors

    def get_variable_to_shape_map(self) -> dict[str, list[int]]:
        """Return key -> shape (a list) for every tensor."""
        return {k: list(info.shape) for k, info in self._reader.tensors.items()}

    def get_variable_to_dtype_map(self) -> dict[str, np.dtype]:
        """Return key -> numpy dtype for every tensor."""
        return {k: info.dtype for k, info in self._reader.tensors.items()}

    def has_tensor(self, key: str) -> bool:
        """True if the checkpoint holds ``key``."""
        return key in self._reader.tensors

    def get_tensor(self, key: str) -> np.ndarray:
        """Read one tensor (only its bytes are read), verifying its checksum.

        Raises:
            KeyNotFoundError: no such key (the message lists the closest keys).
            CorruptCheckpointError: its data is damaged.
        """
        value: np.ndarray = self._reader.read(key)
        return value

    def read_into(self, key: str, out: np.ndarray) -> None:
        """Read one tensor into ``out`` (C-contiguous, writable, its exact dtype and shape),
        verifying its checksum: no new array is made.

        Raises:
            KeyNotFoundError: no such key.
            MismatchError: ``out`` does not fit the tensor.
            CorruptCheckpointError: its data is damaged.
        """
        self._reader.read_into(key, out)

    def get_slice(self, key: str, index: Any) -> np.ndarray:
        """Read a block of one tensor: ``index`` is ints and step-1 slices, as ``np.s_[2:4, :]``.

        Formats that can read part of a tensor do (ckpt's msgpack and HDF5 files read and verify
        just the 1 MiB checksum blocks holding it; TensorFlow's sliced variables the slices it
        overlaps); others read the tensor and cut the block out.

        Example:
            >>> import ckpt, numpy as np, tempfile, os
            >>> path = os.path.join(tempfile.mkdtemp(), "s.h5")
            >>> _ = ckpt.Saver({"w": ckpt.Variable(np.arange(6).reshape(2, 3))}).save(path)
            >>> with ckpt.load_checkpoint(path) as reader:
            ...     reader.get_slice("w", np.s_[1, 1:])
            array([4, 5])
        """
        try:
            part: np.ndarray = self._reader.read_slice(key, index)
        except IndexError as exc:  # the index argument: say which tensor of which file it was for
            raise IndexError(f"{self.path}: get_slice({key!r}, ...): {exc}") from None
        return part

    @property
    def checksummed(self) -> bool:
        """Whether the file carries checksums (False for e.g. HDF5 written by other tools)."""
        return bool(self._reader.checksummed)

    def verify(self, progress: Callable[[int], None] | None = None) -> list[str]:
        """Check the structure and every checksum; return one line per problem (empty when sound).

        Args:
            progress: called with the number of bytes checked, as the work goes on.
        """
        return list(self._reader.verify(progress))

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ckpt.CheckpointReader {self.path!r} format={self.format} tensors={len(self.tensors)}>"


_BATCH_BYTES = 64 << 20  # small tensors are read in batches of about this size (few syscalls, bounded lists)
# an object is read by a few large ranged GETs side by side: batches big enough to keep them all in flight
_REMOTE_BATCH_BYTES = 1 << 30


def read_in_batches(reader: Reader, pairs: Iterable[tuple[Any, np.ndarray]],
                    read: Callable[[list[tuple[Any, np.ndarray]]], None] | None = None) -> None:
    """Read each ``(key, buffer)`` pair into its buffer, many small tensors per ``read_into_many`` call.

    ``read`` replaces ``reader.read_into_many``: ``reader.read_planned`` takes (TensorInfo, buffer) pairs.
    """
    read = read or reader.read_into_many
    batch: list[tuple[Any, np.ndarray]] = []
    size = 0
    limit = _REMOTE_BATCH_BYTES if is_url(reader.path) else _BATCH_BYTES
    for pair in pairs:
        batch.append(pair)
        size += pair[1].nbytes
        if size >= limit:
            read(batch)
            batch, size = [], 0
    if batch:
        read(batch)


def batch_bounds(reader: Reader, nbytes: Iterable[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` index ranges that cut tensors of ``nbytes`` bytes into the batches
    ``read_in_batches`` reads (each closes with the tensor that reaches the batch size), found
    with a running sum and bisection rather than a step per tensor."""
    ends = list(itertools.accumulate(nbytes))
    limit = _REMOTE_BATCH_BYTES if is_url(reader.path) else _BATCH_BYTES
    bounds, start = [], 0
    while start < len(ends):
        stop = min(len(ends), bisect.bisect_left(ends, (ends[start - 1] if start else 0) + limit, start) + 1)
        bounds.append((start, stop))
        start = stop
    return bounds


def load_checkpoint(ckpt_dir_or_file: str | os.PathLike[str],
                    storage_options: StorageOptions | None = None) -> CheckpointReader:
    """Open a checkpoint (a file, or a directory -> its latest) for reading without a model.

    Either may be an object-store URL ("s3://bucket/run/model-10.msgpack", "s3://bucket/run"):
    opening reads the index with ranged GETs, ``get_tensor`` only that tensor's bytes.
    ``storage_options`` go to the store's fsspec filesystem (credentials and endpoints
    otherwise come from the store's usual configuration, e.g. the AWS_* variables).

    Raises:
        CheckpointNotFoundError: no such file, or a directory without checkpoints.
        UnsupportedCheckpointError: a file of a kind no registered format reads.
        CorruptCheckpointError: a damaged or truncated file.
    """
    return CheckpointReader(open_checkpoint(ckpt_dir_or_file, storage_options))


def list_variables(ckpt_dir_or_file: str | os.PathLike[str],
                   storage_options: StorageOptions | None = None) -> list[tuple[str, list[int]]]:
    """Return ``[(key, shape)]`` for every tensor, sorted by key (only the index is read)."""
    with load_checkpoint(ckpt_dir_or_file, storage_options) as reader:
        return sorted(reader.get_variable_to_shape_map().items())


def load_variable(ckpt_dir_or_file: str | os.PathLike[str], name: str,
                  storage_options: StorageOptions | None = None) -> np.ndarray:
    """Return one tensor's value; a trailing ":0" in ``name`` is ignored.

    Unless the checkpoint holds ``name`` itself: Keras 2 files keep the ":0" in their keys.
    """
    with load_checkpoint(ckpt_dir_or_file, storage_options) as reader:
        if name.endswith(":0") and not reader.has_tensor(name):
            name = name[:-2]
        return reader.get_tensor(name)
