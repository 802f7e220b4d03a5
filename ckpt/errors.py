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
    "CheckpointWriteError",
    "ReplacedWriteError",
    "StorageError",
    "StateFileWarning",
    "InvalidURLError",
    "closest_hint",
]


class CheckpointError(Exception):
    """The root of every error ckpt raises about checkpoints and variables."""


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
    """The file is of a kind ckpt cannot read, or written by a newer version of a format."""


class UninitializedVariableError(CheckpointError, RuntimeError):
    """A variable was read before it was initialized or restored."""


class InvalidMetadataError(CheckpointError, ValueError):
    """Metadata given to a save that no format stores: not JSON-like data, a key that is not a
    string, an int beyond 64 bits, nesting deeper than 32 levels."""


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
