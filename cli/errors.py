"""How the ``ckpt`` command reports failures: one "Error: ..." line on stderr and an exit code.

A checkpoint problem (missing, unreadable, corrupted, key not found) exits 1; a usage error
exits 2 (click's own code); ``ckpt diff`` reports trouble with 2, as diff(1) does. Under
``--json`` the error is one JSON line instead: ``{"error": ..., "file": ..., "key": ...}``
("file" and "key" are null when the error concerns no one file or key).

Example:
    >>> @reports_errors()
    ... def command():
    ...     raise ckpt.KeyNotFoundError("m.h5: tensor w not found; closest keys: w0")
    >>> try:
    ...     command()
    ... except Failure as exc:
    ...     exc.exit_code, error_lines(exc.format_message())
    (1, ['Error: m.h5: tensor w not found', '  closest keys: w0'])
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Any, TypeVar

import click

import ckpt

__all__ = ["Failure", "reports_errors", "error_lines", "error_json", "check_regex", "check_compression"]

F = TypeVar("F", bound=Callable[..., Any])
_HINT = "; closest keys: "
# click's own control flow (usage errors keep their code, exits, ^C), and a closed pipe
# ("ckpt inspect ... | head"), which click ends quietly
_PASSED_ON = (click.ClickException, click.exceptions.Exit, click.Abort, BrokenPipeError)


#: The arguments of the commands that name files (an error's "file" when it names none itself).
_PATH_PARAMETERS = ("path", "src", "dst", "a", "b", "directory")


class Failure(click.ClickException):
    """A checkpoint problem, shown as an "Error:" line; exits with ``exit_code``.

    ``file`` and ``key`` say what it concerns, for ``--json`` errors (None when unknown).
    """

    def __init__(self, message: str, exit_code: int = 1, file: str | None = None,
                 key: str | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click types it per class; ours is per failure
        self.file = file
        self.key = key


def _file_of(exc: BaseException, paths: list[str]) -> str | None:
    """The file an error is about: the one it carries (CheckpointError.path, OSError.filename),
    else the command's only path."""
    carried = exc.path if isinstance(exc, ckpt.CheckpointError) else getattr(exc, "filename", None)
    if carried is not None:
        return str(carried)
    return paths[0] if len(paths) == 1 else None


def reports_errors(exit_code: int = 1) -> Callable[[F], F]:
    """Turn what a command raises into a Failure with ``exit_code``: never a traceback."""

    def decorate(command: F) -> F:
        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            paths = [str(kwargs[p]) for p in _PATH_PARAMETERS if kwargs.get(p) is not None]
            try:
                return command(*args, **kwargs)
            except Failure as exc:
                if exc.file is None:
                    exc.file = paths[0] if len(paths) == 1 else None
                raise
            except _PASSED_ON:
                raise
            except (ckpt.CheckpointError, OSError) as exc:
                key = exc.key if isinstance(exc, ckpt.CheckpointError) else None
                raise Failure(str(exc) or type(exc).__name__, exit_code, _file_of(exc, paths), key) from exc
            except Exception as exc:  # a bug, or a foreign reader failing in its own way
                raise Failure(f"unexpected {type(exc).__name__}: {exc} (this is a bug; please report it)",
                              exit_code, paths[0] if len(paths) == 1 else None) from exc

        return wrapper  # type: ignore[return-value]

    return decorate


def check_regex(pattern: str, param_hint: str) -> None:
    """A usage error (exit 2) naming the option unless ``pattern`` is a valid regular expression."""
    try:
        re.compile(pattern)
    except re.error as exc:
        raise click.BadParameter(f"{pattern!r} is not a regular expression: {exc}", param_hint=param_hint) from exc


def check_compression(compression: str, fmt: Any, path: str) -> str | None:
    """The codec a ``--compression`` value asks for (None for "none"); a usage error (exit 2)
    naming the file when its format does not offer it (checked before any input is opened)."""
    codec = None if compression.lower() == "none" else compression.lower()
    if codec is not None and codec not in fmt.compressions:
        raise click.BadParameter(f"{path}: the {fmt.name} format does not compress; .msgpack files offer {codec}",
                                 param_hint="--compression")
    return codec


def error_json(message: str, exc: click.ClickException) -> str:
    """The one-line JSON form of an error, for commands run with ``--json``.

    Example:
        >>> print(error_json("m.h5: tensor 'w' not found", Failure("m.h5: tensor 'w' not found", file="m.h5", key="w")))
        {"error": "m.h5: tensor 'w' not found", "file": "m.h5", "key": "w"}
    """
    return json.dumps({"error": message, "file": getattr(exc, "file", None), "key": getattr(exc, "key", None)})


def error_lines(message: str) -> list[str]:
    """The lines of an error: "Error: ...", then the closest keys on an indented line."""
    first, sep, hint = message.partition(_HINT)
    return [f"Error: {first}"] + ([f"  closest keys: {hint}"] if sep else [])
