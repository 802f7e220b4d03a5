"""Averaging checkpoints: ``ckpt.average_checkpoints`` and ``ckpt average``.

Floating-point tensors (bfloat16 and complex included) become the weighted mean of the
inputs, accumulated in float64 (complex128) and written in each tensor's own dtype; every
other tensor (integers, bools, strings) must be equal in every input and is copied. The inputs
stream through in bounded chunks, each input's checksums checked as it is read, so memory holds
a few chunks per input, never a whole tensor of one.

Example:
    >>> import ckpt, numpy as np, tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> paths = [ckpt.save_file({"w": np.full(2, x, np.float32), "step": np.int64(7)}, os.path.join(d, f"{x}.h5"))
    ...          for x in (1.0, 2.0, 6.0)]
    >>> out = ckpt.average_checkpoints(paths, os.path.join(d, "avg.msgpack"))
    >>> ckpt.load_file(out)
    {'w': array([3., 3.], dtype=float32), 'step': array(7)}
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from typing import Any

import numpy as np

from ckpt import dtypes
from ckpt.errors import CheckpointError, CheckpointWriteError, MismatchError, UnsupportedCheckpointError
from ckpt.formats.base import check_compression, normalize_metadata, write_with
from ckpt.lazy import LazySource
from ckpt.saving.reader import CheckpointReader
from ckpt.saving.stores import store_of
from ckpt.storage import WritableBlob
from ckpt.storage.urls import StorageOptions, is_url
from ckpt.tools.chunks import OneThread, aligned_chunks, reusing_buffers
from ckpt.tools.conversion import writable_format
from ckpt.tools.sources import Checkpoint, opened

__all__ = ["average_checkpoints", "averaging_weights"]

#: Elements summed at a time: two float64 blocks of this size (1 MiB) per thread stay in a core's L2 cache.
_BLOCK = 64 << 10
_second = OneThread("ckpt-average")  # takes half of each chunk's blocks (numpy's ufuncs release the GIL)


def averaging_weights(count: int, weights: Sequence[float] | None) -> list[float]:
    """Each input's share of the mean: ``weights`` divided by their sum (None: equal shares).

    Raises:
        ValueError: not one weight per input, or a weight negative or not finite, or all zero.

    Example:
        >>> averaging_weights(2, None), averaging_weights(2, [1, 3])
        ([0.5, 0.5], [0.25, 0.75])
    """
    if count < 1:
        raise ValueError("average_checkpoints needs at least one checkpoint")
    if weights is None:
        return [1.0 / count] * count
    values = [float(w) for w in weights]
    if len(values) != count:
        raise ValueError(f"{len(values)} weights for {count} checkpoints: give one weight per checkpoint")
    if any(not math.isfinite(w) or w < 0 for w in values) or not sum(values) > 0:
        raise ValueError(f"weights must be finite, non-negative and not all zero, got {values}")
    total = math.fsum(values)
    return [w / total for w in values]


def _averaged(dtype: np.dtype) -> bool:
    return dtypes.kind(dtype) in ("f", "c")


def _check_alike(readers: list[CheckpointReader]) -> None:
    """Raise one MismatchError listing every key missing from some input and every key whose
    shape or dtype differs between inputs (before anything is written)."""
    problems = []
    every = list(dict.fromkeys(k for r in readers for k in r.tensors))
    for key in every:
        lacking = [r.path for r in readers if key not in r.tensors]
        if lacking:
            problems.append(f"tensor {key!r} is missing from {', '.join(lacking)}")
            continue
        seen = {(tuple(r.tensors[key].shape), dtypes.dtype_label(r.tensors[key].dtype)) for r in readers}
        if len(seen) > 1:
            found = "; ".join(f"{r.path}: {dtypes.dtype_label(r.tensors[key].dtype)}{list(r.tensors[key].shape)}"
                              for r in readers)
            problems.append(f"tensor {key!r} differs ({found})")
    if problems:
        first = readers[0].path
        raise MismatchError(f"cannot average {len(readers)} checkpoints ({first}, ...): they do not hold the same "
                            "tensors:\n  " + "\n  ".join(problems), path=first)


class _Mean(LazySource):
    """The weighted mean of one floating-point tensor over the inputs, streamed in chunks."""

    def __init__(self, readers: list[CheckpointReader], key: str, shares: list[float]) -> None:
        info = readers[0].tensors[key]
        self.dtype, self.shape = info.dtype, tuple(info.shape)
        self._readers, self._key, self._shares = readers, key, shares
        self._wide = np.dtype(np.complex128 if self.dtype.kind == "c" else np.float64)

    def _values(self) -> Iterator[np.ndarray]:
        scratch = [(np.empty(_BLOCK, self._wide), np.empty(_BLOCK, self._wide)) for _ in range(2)]  # per thread
        out = np.empty(0, self.dtype)
        for pieces in aligned_chunks(self._readers, self._key):
            n = pieces[0].size
            if out.size < n:
                out = np.empty(n, self.dtype)
            starts = range(0, n, _BLOCK)
            if len(starts) < 4:  # a hand-off costs more than a few blocks
                self._blocks(pieces, out, starts, *scratch[0])
            else:
                half = len(starts) // 2
                job = _second.get().submit(self._blocks, pieces, out, starts[half:], *scratch[1])
                try:
                    self._blocks(pieces, out, starts[:half], *scratch[0])
                finally:
                    job.result()  # the pieces are reused buffers: the second thread must be done with them
            yield out[:n]

    def _blocks(self, pieces: list[np.ndarray], out: np.ndarray, starts: range, acc: np.ndarray,
                tmp: np.ndarray) -> None:
        """The mean of the blocks of ``pieces`` that begin at ``starts``, into ``out`` (on either thread)."""
        n = pieces[0].size
        for lo in starts:  # blocks whose float64 sums stay in the CPU's cache
            hi = min(n, lo + _BLOCK)
            a, t = acc[:hi - lo], tmp[:hi - lo]
            # widen first (exact), then multiply in place: the product itself in float64, as a
            # float16 loop would round before widening; a plain cast is cheaper than a ufunc's buffered one
            np.copyto(a, pieces[0][lo:hi], casting="unsafe")
            np.multiply(a, self._shares[0], out=a)
            for piece, share in zip(pieces[1:], self._shares[1:]):
                np.copyto(t, piece[lo:hi], casting="unsafe")
                np.multiply(t, share, out=t)
                np.add(a, t, out=a)
            np.copyto(out[lo:hi], a, casting="unsafe")  # rounded to the tensor's dtype once

    def chunks(self) -> Iterator[np.ndarray]:
        """The mean's C-order bytes in chunks (writers that stream)."""
        for values in self._values():
            yield values.view(np.uint8)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        value = np.empty(math.prod(self.shape), self.dtype)  # the output's memory only (a writer that does not stream)
        pos = 0
        for values in self._values():
            value[pos:pos + values.size] = values
            pos += values.size
        return value.reshape(self.shape)


class _Same(LazySource):
    """A tensor that is not averaged: equal in every input (checked as it streams), copied."""

    def __init__(self, readers: list[CheckpointReader], key: str) -> None:
        info = readers[0].tensors[key]
        self.dtype, self.shape = info.dtype, tuple(info.shape)
        self._readers, self._key = readers, key

    def _differs(self, other: CheckpointReader) -> MismatchError:
        first = self._readers[0].path
        return MismatchError(f"tensor {self._key!r} is not a floating-point tensor and differs between {first} and "
                             f"{other.path}: integer, bool and string tensors must be equal in every checkpoint "
                             "averaged", path=other.path, key=self._key)

    def chunks(self) -> Iterator[np.ndarray]:
        for pieces in aligned_chunks(self._readers, self._key):
            for piece, reader in zip(pieces[1:], self._readers[1:]):
                if not np.array_equal(piece.view(np.uint8), pieces[0].view(np.uint8)):
                    raise self._differs(reader)
            yield pieces[0].view(np.uint8)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        value: np.ndarray = self._readers[0].get_tensor(self._key)
        for reader in self._readers[1:]:
            # reshape(-1): a 0-d array cannot be viewed as bytes of another itemsize
            other = reader.get_tensor(self._key)
            same = (value.reshape(-1).tolist() == other.reshape(-1).tolist() if dtypes.is_string(self.dtype)
                    else np.array_equal(value.reshape(-1).view(np.uint8), other.reshape(-1).view(np.uint8)))
            if not same:
                raise self._differs(reader)
        return value


def average_checkpoints(checkpoints: Sequence[Checkpoint], out: str | os.PathLike[str],
                        weights: Sequence[float] | None = None, *, format: str | None = None,
                        overwrite: bool = False, storage_options: StorageOptions | None = None,
                        compression: str | None = None) -> str:
    """Write the weighted average of ``checkpoints`` to ``out``; return ``out``.

    Floating-point tensors (float16, bfloat16, float32, float64, complex) are averaged in
    float64 (complex128) and written in their own dtype; integer, bool and string tensors must be
    equal in every input and are copied. The inputs stream through in bounded chunks, each
    input's checksums checked; the metadata is the first checkpoint's. ``out`` is written
    atomically (a temporary file renamed, or a create-only object-store commit).

    Args:
        checkpoints: paths or URLs (a directory means its latest checkpoint), or open readers.
        out: the new checkpoint, a path or URL; its extension names the format.
        weights: one non-negative weight per checkpoint, divided by their sum (None: equal).
        format: the format's registered name, if not ``out``'s extension.
        overwrite: replace an existing ``out`` (never for a URL).
        storage_options: for URLs, options for the store's fsspec filesystem.
        compression: "zstd" writes a .msgpack ``out`` with compressed numeric tensors (as
            ``save_file(..., compression="zstd")``); None uncompressed.

    Raises:
        MismatchError: the checkpoints do not hold the same keys, shapes and dtypes (all listed,
            before anything is written), or a non-float tensor differs between two of them.
        CorruptCheckpointError: an input fails a checksum (``out`` is not written).
        CheckpointWriteError: ``out`` exists (without ``overwrite``), or writing it failed.
        UnsupportedCheckpointError: ``out``'s format is unknown or cannot be written, or does not
            offer ``compression`` (.h5, .safetensors).
        ValueError: bad weights.
    """
    out = os.fspath(out)
    shares = averaging_weights(len(checkpoints), weights)
    fmt = writable_format(out, format)
    check_compression(fmt, compression, out)
    remote = is_url(out)
    if remote and overwrite:
        raise ValueError("an object-store destination is written once (create-only): no overwrite")
    if not remote and os.path.lexists(out) and not overwrite:
        raise CheckpointWriteError(f"{out} exists; pass overwrite=True to replace it", path=out)
    with ExitStack() as stack:
        readers = [stack.enter_context(opened(c, storage_options)) for c in checkpoints]
        _check_alike(readers)
        try:
            metadata = normalize_metadata(readers[0].metadata, out)
        except ValueError as exc:
            raise UnsupportedCheckpointError(f"cannot average into {out}: {exc}", path=out) from exc
        keys = list(readers[0].tensors)
        tensors = [(key, _Mean(readers, key, shares) if _averaged(readers[0].tensors[key].dtype)
                    else _Same(readers, key)) for key in keys]

        def write(blob: WritableBlob) -> None:
            with reusing_buffers():
                write_with(fmt, blob, tensors, metadata, compression)

        try:  # atomic (docs/storage.md): nothing appears at ``out`` unless every tensor was written
            store_of(out, storage_options).write_checkpoint(os.path.basename(out), write)
        except (ValueError, TypeError) as exc:  # a writer refusing a dtype it cannot store
            if isinstance(exc, CheckpointError):
                raise
            raise UnsupportedCheckpointError(f"{out}: {exc}", path=out) from exc
    return out
