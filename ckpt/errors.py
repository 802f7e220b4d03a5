"""The exceptions ckpt raises.

Every failure a user can cause ends in a :class:`CheckpointError`. Each child also
subclasses the matching builtin, so ``except KeyError`` or ``except FileNotFoundError``
keeps working in code that does not know about ckpt.

Example:
    >>> import ckpt
    >>> try:
    ...     ckpt.load_checkpoint("/no/such/model.h5")
    ... except ckpt.CheckpointNotFoundError as exc:
    ...     print(type(exc).__name__)
    CheckpointNotFoundError
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "KeyNotFoundError",
    "MismatchError",
    "CorruptCheckpointError",
    "UnsupportedCheckpointError",
    "UninitializedVariableError",
    "InvalidMetadataError",
    "InvalidMetricsError",
    "CheckpointWriteError",
    "ReplacedWriteError",
    "StorageError",
    "StateFileWarning",
    "InvalidURLError",
    "closest_hint",
    "checksum_message",
    "checksum_error",
]


class CheckpointError(Exception):
    """The root of every error ckpt raises about checkpoints and variables.

    ``path`` (the file, directory or URL) and ``key`` (the tensor) say what the error concerns,
    where the code that raised it knew them (None otherwise); the message names them too.

    Example:
        >>> exc = CheckpointError("m.h5: tensor 'w' is damaged", path="m.h5", key="w")
        >>> exc.path, exc.key
        ('m.h5', 'w')
    """

    def __init__(self, *args: object, path: str | None = None, key: str | None = None) -> None:
        super().__init__(*args)
        self.path = path
        self.key = key


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint file, a directory's latest checkpoint or a save's parent directory is missing."""

    def __str__(self) -> str:
        # FileNotFoundError would format "[Errno ...]" only when given errno; keep the message
        return str(self.args[0]) if self.args else ""


class KeyNotFoundError(CheckpointError, KeyError, ValueError):
    """A key was asked for that the checkpoint does not hold.

    It is a KeyError (a lookup that failed) and a ValueError (TensorFlow's
    ``init_from_checkpoint`` raises ValueError for the same problem).
    """

    def __str__(self) -> str:
        # KeyError would print repr(message) with quotes around it
        return str(self.args[0]) if self.args else ""


class MismatchError(CheckpointError, ValueError):
    """A tensor's shape or dtype in the checkpoint differs from the variable's."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """The file is truncated, damaged, fails a checksum, or breaks the format's rules."""


class UnsupportedCheckpointError(CheckpointError, ValueError):
    """The file is of a kind ckpt cannot read, or written by a newer version of a format; or a save
    names what ckpt cannot write (a directory, an extension no format writes)."""


class UninitializedVariableError(CheckpointError, RuntimeError):
    """A variable was read before it was initialized or restored."""


class InvalidMetadataError(CheckpointError, ValueError):
    """Metadata given to a save that no format stores: not JSON-like data, a key that is not a
    string, an int beyond 64 bits, nesting deeper than 32 levels."""


class InvalidMetricsError(CheckpointError, ValueError):
    """Metrics given to a save (``save(..., metrics=)``) that are not finite numbers by name:
    NaN, inf, a string, a bool. The message names the file and the metric."""


class CheckpointWriteError(CheckpointError, OSError):
    """Writing a checkpoint or the directory's state file failed; nothing was replaced."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ReplacedWriteError(CheckpointWriteError):
    """The new file is complete and replaced the old one, but flushing it to disk failed."""


class StorageError(CheckpointError, OSError):
    """The storage under a checkpoint failed: an object store that cannot be reached, refuses
    the credentials or the access, or times out. The message names the URL."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StateFileWarning(UserWarning):
    """A directory's state file is damaged (empty, not JSON, malformed): ckpt went by the
    checkpoints it found in the directory instead, each verified. The message names the state
    file, what was wrong and what was found; the next save rewrites the state file."""


class InvalidURLError(CheckpointError, ValueError):
    """A location given as an object-store URL that names no bucket (``s3://``) or has an empty
    part (``s3://bucket//run``). The message names the URL."""


def closest_hint(key: str, keys: Iterable[str]) -> str:
    """Return "; closest keys: a, b" for a key that was not found (empty when nothing is close)."""
    close = difflib.get_close_matches(key, list(keys), n=3, cutoff=0.5)
    return f"; closest keys: {', '.join(close)}" if close else ""


def checksum_message(path: str, what: str, got: int | None = None, expected: int | str | None = None,
                     checksum: str = "crc32c", cause: str = "the file is damaged") -> str:
    """The one wording of a checksum failure: "<path>: <what> fails its checksum (<checksum> <got>,
    expected <expected>): <cause>" (the values where known); for lists of problems (verify).

    Example:
        >>> checksum_message("m.h5", "tensor 'w'", 1, 2)
        "m.h5: tensor 'w' fails its checksum (crc32c 0x00000001, expected 0x00000002): the file is damaged"
        >>> checksum_message("m.msgpack", "the index")
        'm.msgpack: the index fails its checksum: the file is damaged'
    """
    shown = f"{expected:#010x}" if isinstance(expected, int) else expected  # a damaged value, shown as found
    values = "" if got is None or expected is None else f" ({checksum} {got:#010x}, expected {shown})"
    return f"{path}: {what} fails its checksum{values}: {cause}"


def checksum_error(path: str, what: str, got: int | None = None, expected: int | str | None = None, *,
                   key: str | None = None, checksum: str = "crc32c",
                   cause: str = "the file is damaged") -> CorruptCheckpointError:
    """The error of a checksum failure (:func:`checksum_message`), carrying ``path`` and ``key``.

    Example:
        >>> exc = checksum_error("m.h5", "tensor 'w'", 1, 2, key="w")
        >>> isinstance(exc, CorruptCheckpointError), exc.path, exc.key
        (True, 'm.h5', 'w')
    """
    return CorruptCheckpointError(checksum_message(path, what, got, expected, checksum, cause), path=path, key=key)
