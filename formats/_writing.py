"""Calling a format's writer (``write_into``: ``write_blob``, or an older path-taking ``write``
staged through a local file), and reading the tensors handed to a writer (``materialize``,
``source_chunks``).

Example:
    >>> import numpy as np, os, tempfile
    >>> from ckpt.formats import _io, _writing, base
    >>> path = os.path.join(tempfile.mkdtemp(), "m.msgpack")
    >>> with _io.LocalSink(path) as blob:
    ...     _writing.write_into(base.get_format("msgpack"), blob, [("w", np.ones(2))], {})
    >>> _writing.materialize(np.ones(2)).tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ckpt import dtypes
from ckpt.storage import WritableBlob

from . import _io

if TYPE_CHECKING:  # annotations only: the contract's WritableFormat stages through this module
    from ._contract import WritableFormat


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
