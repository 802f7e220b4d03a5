"""Registered formats whose module loads on first use (``lazy_format``): recognising one of
ckpt's own files imports that format's module only.

Example:
    >>> from ckpt.formats import _lazy
    >>> fmt = _lazy.lazy_format("msgpack", (".msgpack",), True, "ckpt.formats.msgpack:MsgpackFormat")
    >>> fmt.name, fmt.can_write
    ('msgpack', True)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ckpt.storage import WritableBlob

from ._contract import Format, WritableFormat
from ._readers import Reader
from ._writing import write_into


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
