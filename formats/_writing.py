"""What writers share: reading the tensors handed to them (``materialize``, ``source_chunks``, and
``LazySource``, the base of sources that stream),
and ``stage``, running a writer that needs a local file (libhdf5) for any blob.

Example:
    >>> import numpy as np
    >>> from ckpt.formats import _writing
    >>> _writing.materialize(np.ones(2)).tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ckpt import dtypes
from ckpt.lazy import LazySource
from ckpt.storage import WritableBlob

from . import _io


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
    import tempfile  # lazy: only libhdf5's rare layouts stage (start-up cost)

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


def source_chunks(source: Any) -> Iterator[memoryview] | None:
    """A lazy numeric source's C-order bytes in pieces, or None when it does not stream
    (it is not a :class:`LazySource`, or its ``chunks()`` says None)."""
    if not isinstance(source, LazySource) or dtypes.is_string(np.dtype(source.dtype)):
        return None
    chunks = source.chunks()
    return None if chunks is None else (memoryview(c).cast("B") for c in chunks)


def checked_checksums(source: Any, block_bytes: int) -> tuple[int, bytes | None] | None:
    """The checksums a streaming source checked its bytes against (``LazySource.checked_crc32c``),
    or None: a writer that gets them writes the chunks without a crc32c pass of its own. Use them
    only after the stream ended without an error; the read-back of a converted file checks them."""
    return source.checked_crc32c(block_bytes) if isinstance(source, LazySource) else None


def materialize(source: Any) -> np.ndarray:
    """The array behind a tensor handed to a writer: an ndarray itself, a lazy source read now."""
    return source if isinstance(source, np.ndarray) else np.asarray(source)
