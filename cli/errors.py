"""How the ``ckpt`` command reports failures: one "Error: ..." line on stderr and an exit code.

A checkpoint problem (missing, unreadable, corrupted, key not found) exits 1; a usage error
exits 2 (click's own code); ``ckpt diff`` reports trouble with 2, as diff(1) does.

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
import re
from typing import Any, Callable, TypeVar

import click

import ckpt

__all__ = ["Failure", "reports_errors", "error_lines", "check_regex"]

F = TypeVar("F", bound=Callable[..., Any])
_HINT = "; closest keys: "
# click's own control flow (usage errors keep their code, exits, ^C), and a closed pipe
# ("ckpt inspect ... | head"), which click ends quietly
_PASSED_ON = (click.ClickException, click.exceptions.Exit, click.Abort, BrokenPipeError)


class Failure(click.ClickException):
    """A checkpoint problem, shown as an "Error:" line; exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def reports_errors(exit_code: int = 1) -> Callable[[F], F]:
    """Turn what a command raises into a Failure with ``exit_code``: never a traceback."""

    def decorate(command: F) -> F:
        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return command(*args, **kwargs)
            except _PASSED_ON:
                raise
            except (ckpt.CheckpointError, OSError) as exc:
                raise Failure(str(exc) or type(exc).__name__, exit_code) from exc
            except Exception as exc:  # a bug, or a foreign reader failing in its own way
                raise Failure(f"unexpected {type(exc).__name__}: {exc} (this is a bug; please report it)",
                              exit_code) from exc

        return wrapper  # type: ignore[return-value]

    return decorate


def check_regex(pattern: str, param_hint: str) -> None:
    """A usage error (exit 2) naming the option unless ``pattern`` is a valid regular expression."""
    try:
        re.compile(pattern)
    except re.error as exc:
        raise click.BadParameter(f"{pattern!r} is not a regular expression: {exc}", param_hint=param_hint)


def error_lines(message: str) -> list[str]:
    """The lines of an error: "Error: ...", then the closest keys on an indented line."""
    first, sep, hint = message.partition(_HINT)
    return [f"Error: {first}"] + ([f"  closest keys: {hint}"] if sep else [])
