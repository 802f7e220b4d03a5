"""The pre-pass of an incremental save: reuse, without hashing, the entries of Variables not written
since the Saver's previous save.

Hashing (SHA-256) every byte of every save costs one pass over the model even when 90% of it is a
frozen backbone. A Variable counts its writes (``Variable._writes``: assign, assign_add/sub,
initialize, restores); the Saver remembers each key's count when its previous save snapshotted it
(:func:`write_counts`). A key whose count is unchanged reuses that save's entry as is, when

- the format can tell the entry's crc32c and chunk files for this dtype, shape and chunk size
  (``ChunkedFormat.entry_files``),
- the crc32c of the bytes being saved equals the entry's (a cheap pass, ~6x faster than SHA-256:
  it catches a write the counter missed, and the tensor is then hashed as any other), and
- every chunk file the entry reads is in the store (checked under the save's lock or hold, as
  unchanged chunks are: retention or another saver may have collected them).

Everything else (changed Variables, non-Variable tensors, string tensors) goes through the chunk
path; :meth:`Reuse.join` puts the entries back in the save's order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from ckpt.checksums import crc32c
from ckpt.formats.base import ChunkedFormat
from ckpt.runtime.variables import Variable

__all__ = ["Reuse", "unchanged_keys", "write_counts"]


def write_counts(variables: Mapping[str, Variable]) -> dict[str, int]:
    """Each key's write count now; taken before the save reads any byte, so a write after it is
    seen by the next save."""
    return {key: var._writes for key, var in variables.items()}


def unchanged_keys(before: Mapping[str, int], now: Mapping[str, int]) -> frozenset[str]:
    """The keys whose count is the one ``before`` (the previous save's) recorded."""
    return frozenset(key for key, count in now.items() if before.get(key) == count)


class Reuse:
    """One save's pre-pass: :meth:`rest` yields the tensors to encode and keeps the entries of
    ``previous`` it reuses for ``unchanged`` keys; :meth:`join` merges them back in order."""

    def __init__(self, fmt: ChunkedFormat, previous: Mapping[str, list[Any]], unchanged: frozenset[str],
                 chunk_bytes: int, exists: Callable[[bytes], bool]) -> None:
        self._fmt, self._previous, self._unchanged = fmt, previous, unchanged
        self._chunk_bytes, self._exists = chunk_bytes, exists
        self._order: list[str] = []
        self.reused: dict[str, list[Any]] = {}
        #: chunk references of the reused entries
        self.chunks = 0

    def rest(self, tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The tensors not reused, lazily and in order: a source is materialized at most once
        here, and handed on as it came (an asynchronous save's gate sees it read in order)."""
        for key, source in tensors:
            self._order.append(key)
            if key in self._unchanged and key in self._previous and self._try(key, source):
                continue
            yield key, source

    def _try(self, key: str, source: Any) -> bool:
        entry = self._previous[key]
        value = np.asarray(source)
        found = self._fmt.entry_files(entry, value.dtype, value.shape, self._chunk_bytes)
        if found is None or not value.flags.c_contiguous:
            return False
        crc, files = found
        if crc32c(value.reshape(-1).view(np.uint8)) != crc or not all(map(self._exists, files)):
            return False  # a write the count missed, or chunks collected since: encode it
        self.reused[key] = entry
        self.chunks += -(-value.nbytes // self._chunk_bytes)
        return True

    def join(self, encoded: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
        """Every entry of the save, reused or ``encoded``, in the order of its tensors."""
        return {key: self.reused[key] if key in self.reused else encoded[key] for key in self._order}
