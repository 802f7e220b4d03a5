"""The format contract: :class:`Format` (recognise and open a checkpoint) and
:class:`WritableFormat` (also write one), the Protocols every format, built-in or plugin,
implements (``ckpt.Format``, ``ckpt.WritableFormat``).

Example:
    >>> from ckpt.formats import _contract, base
    >>> fmt = base.get_format("msgpack")
    >>> isinstance(fmt, _contract.WritableFormat), fmt.claims("m.msgpack")
    (True, False)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from ckpt.storage import WritableBlob

from . import _io
from ._readers import Reader
from ._writing import stage


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
