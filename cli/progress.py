"""Progress bars for long operations: on stderr, on a terminal only, for large data only.

Piped or redirected, the command stays quiet. While a bar is shown, a command's report is
held back and printed when the bar is done, so the two never interleave.

Example:
    >>> import io
    >>> shows_progress(1 << 40, stream=io.StringIO())  # not a terminal
    False
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import IO, Any, Callable, Iterable, Iterator, Sequence

import click

__all__ = ["MIN_BYTES", "shows_progress", "tracked", "emit", "byte_bar"]

#: Less data than this is read too fast to be worth a bar.
MIN_BYTES = 64 << 20


def shows_progress(nbytes: int, stream: IO[str] | None = None) -> bool:
    """True when a bar for ``nbytes`` of work belongs on ``stream`` (default stderr)."""
    stream = sys.stderr if stream is None else stream
    return nbytes >= MIN_BYTES and stream.isatty()


def tracked(label: str) -> Callable[[Sequence[Any]], Iterator[Any]]:
    """Return a wrapper that iterates TensorInfos, advancing a bar by each one's bytes."""

    def wrap(infos: Sequence[Any]) -> Iterator[Any]:
        total = sum(info.nbytes for info in infos)
        with click.progressbar(length=max(total, 1), label=label, file=sys.stderr) as bar:
            for info in infos:
                yield info
                bar.update(info.nbytes)

    return wrap


def emit(lines: Iterable[str], held: bool) -> None:
    """Print ``lines``; when ``held`` (a bar is running while they are made), all at the end."""
    for line in list(lines) if held else lines:
        click.echo(line)


@contextmanager
def byte_bar(nbytes: int, label: str, stream: IO[str] | None = None) -> Iterator[Callable[[int], None] | None]:
    """Yield a ``progress(nbytes_done)`` callback drawing a bar, or None when no bar belongs here."""
    stream = sys.stderr if stream is None else stream
    if not shows_progress(nbytes, stream):
        yield None
        return
    with click.progressbar(length=max(nbytes, 1), label=label, file=stream) as bar:
        yield bar.update
