"""What was opened for a path before a format's ``open`` ran, handed to it instead of being
opened again: the blob ``open_reader`` sniffed through, what a declining format opened
(``decline``; Keras's HDF5 reader, taken by the hdf5 format).

Example:
    >>> from ckpt.formats import _offers
    >>> class Opened:
    ...     def close(self): print("closed")
    >>> with _offers.offering("w.h5", Opened()):
    ...     type(_offers.handed("w.h5", Opened)).__name__
    'Opened'
    >>> with _offers.offering("w.h5", Opened()):
    ...     pass  # nobody took it
    closed
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NoReturn, TypeVar

from ckpt.errors import UnsupportedCheckpointError


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
