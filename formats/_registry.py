"""The format registry: which formats exist and in which order they are asked, and
``open_reader``, which recognises a checkpoint's format from its path or its first bytes.

Example:
    >>> from ckpt.formats import _registry
    >>> _registry.format_for_path("model.msgpack").name
    'msgpack'
"""

from __future__ import annotations

import os
import threading

from ckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, UnsupportedCheckpointError
from ckpt.storage import ReadableBlob
from ckpt.storage.urls import StorageOptions

from . import _io
from ._blobs import open_blob
from ._contract import Declined, Format, WritableFormat
from ._readers import BaseReader, Reader

#: How many bytes from the start of a file ``Format.sniff`` is shown.
SNIFF_BYTES = 4096


_registry: dict[str, Format] = {}
_lock = threading.Lock()


def register_format(fmt: Format, *, replace: bool = False, before: str | None = None) -> None:
    """Make a format available to ``Saver``, ``load_checkpoint`` and the CLI.

    The registry's order is the order in which formats are asked (``claims``, ``sniff``, an
    extension in ``format_for_path``): a new format comes last unless ``before`` names a
    registered format it must be asked before.

    Args:
        fmt: an instance of a :class:`Format` subclass (a :class:`WritableFormat` to write).
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
    if not isinstance(fmt, Format):
        raise TypeError(f"{fmt!r} is not a Format: subclass ckpt.Format (or ckpt.WritableFormat to write)")
    if fmt.can_write != isinstance(fmt, WritableFormat):
        raise TypeError(f"{fmt!r}: can_write is {fmt.can_write} but it {'is not' if fmt.can_write else 'is'} "
                        "a ckpt.WritableFormat")
    if isinstance(fmt, WritableFormat) and type(fmt).write is not WritableFormat.write:
        # the Saver, convert and sharded saves call write_blob only: an overridden write would be skipped
        raise TypeError(f"{fmt!r} overrides write(path, ...), which only runs write_blob on a local file; "
                        "override write_blob(blob, tensors, metadata) instead (docs/storage.md)")
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


def open_reader(path: str | os.PathLike[str], blob: ReadableBlob | None = None,
                storage_options: StorageOptions | None = None) -> Reader:
    """Open a checkpoint, recognising its format from its path or its first bytes.

    ``blob``, if given, is ``path``'s bytes already opened (a Store reading back what it has not
    committed yet): they are sniffed and read instead of opening ``path``; the reader owns them.
    Otherwise ``path`` is opened with ``storage_options`` (for an object-store URL: its fsspec
    filesystem's options), and the format is handed that blob: what it opens next to it (a
    sharded checkpoint's shard files) goes through the same store.

    Raises:
        CheckpointNotFoundError: the file does not exist.
        UnsupportedCheckpointError: no registered format recognises it.
    """
    path = os.fspath(path)
    for fmt in formats():
        if fmt.claims(path):
            if blob is not None:
                blob.close()
            return _checked(fmt, fmt.open(path))
    source = _open_to_sniff(path, storage_options) if blob is None else blob
    try:
        head = _io.pread(source, 0, min(source.size, SNIFF_BYTES), "the first bytes")
        reader = _first_to_open(path, source, head)
    except BaseException:
        source.close()
        raise
    if reader is not None:
        return reader
    source.close()
    known = ", ".join(f.name + (f" ({'/'.join(f.extensions)})" if f.extensions else "") for f in formats())
    what = "an empty file" if not head else "not a checkpoint in any supported format"
    raise UnsupportedCheckpointError(f"{path}: {what}; supported formats: {known}")


def _open_to_sniff(path: str, storage_options: StorageOptions | None) -> ReadableBlob:
    """``open_blob(path, storage_options)``, an OSError turned into the CheckpointError it means."""
    try:
        return open_blob(path, storage_options)
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such checkpoint file", path=path) from None
    except IsADirectoryError:
        raise CheckpointNotFoundError(f"{path}: is a directory, not a checkpoint file", path=path) from None
    except PermissionError as exc:  # it exists: not a "not found" that code may take for a fresh start
        raise CheckpointError(f"{path}: cannot open: {exc.strerror or exc}", path=path) from exc
    except OSError as exc:  # EIO and friends: the storage under the file is failing
        raise CorruptCheckpointError(f"{path}: cannot read: {exc.strerror or exc}", path=path) from exc


def _checked(fmt: Format, reader: Reader) -> Reader:
    """``reader`` itself, if it is a BaseReader: callers use the optional abilities that class
    declares with their defaults (``read_slice``, ``stored_crc32c``, ...) without probing for them."""
    if not isinstance(reader, BaseReader):
        reader.close()
        raise TypeError(f"format {fmt.name!r}: open() returned a {type(reader).__name__}, not a reader: "
                        "subclass ckpt.formats.base.BaseReader (or FileReader)")
    return reader


def _first_to_open(path: str, blob: ReadableBlob, head: bytes) -> Reader | None:
    """The reader of the first format whose ``sniff`` accepts ``head`` and does not decline.

    Each is given ``blob`` (the reader it returns owns it) and what the format before it opened
    and handed on when declining (``Declined.opened``), which is closed unless it is the reader.
    """
    declined: Reader | None = None
    try:
        for fmt in formats():
            if fmt.sniff(head):
                try:
                    reader = fmt.open(path, blob, declined)
                except Declined as exc:
                    if declined is not None and exc.opened is not declined:
                        declined.close()
                    declined = exc.opened
                    continue
                if reader is declined:
                    declined = None
                return _checked(fmt, reader)
        return None
    finally:
        if declined is not None:
            declined.close()
