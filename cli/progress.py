"""Progress bars for long operations: on stderr, on a terminal only, for large data only.

Piped or redirected, the command stays quiet. While a bar is shown, a command's report is
held back and printed when the bar is done, so the two never interleave.

Example:
    >>> import io
    >>> shows_progress(1 << 40, stream=io.StringIO())  # not a terminal
    False
"""

from __future__ import annotations

import os
import sys
import threading
from typing import IO, Any, Callable, Iterable, Iterator, Sequence, TypeVar

import click

__all__ = ["MIN_BYTES", "shows_progress", "tracked", "emit", "run_with_read_progress"]

#: Less data than this is read too fast to be worth a bar.
MIN_BYTES = 64 << 20
_PROC_IO = "/proc/self/io"
T = TypeVar("T")


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


def _bytes_read() -> int:
    with open(_PROC_IO, "rb") as f:
        for line in f:
            if line.startswith(b"rchar:"):
                return int(line.split()[1])
    raise OSError(f"{_PROC_IO} has no rchar line")


def run_with_read_progress(work: Callable[[], T], nbytes: int, label: str,
                           stream: IO[str] | None = None) -> T:
    """Run ``work`` (which reads about ``nbytes``), with a bar of this process's reads meanwhile.

    For work that reports no progress of its own (a reader's ``verify``): it runs in a
    thread while the bar follows the bytes the process has read (Linux's /proc/self/io).
    Without a terminal or /proc, ``work`` simply runs.
    """
    stream = sys.stderr if stream is None else stream
    if not shows_progress(nbytes, stream) or not os.path.exists(_PROC_IO):
        return work()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # re-raised in the calling thread
            outcome["error"] = exc

    start = _bytes_read()
    worker = threading.Thread(target=run, name="ckpt-progress-work", daemon=True)
    worker.start()
    with click.progressbar(length=nbytes, label=label, file=stream) as bar:
        while worker.is_alive():
            worker.join(0.1)
            bar.update(min(nbytes, _bytes_read() - start) - bar.pos)
        if "error" not in outcome:
            bar.update(nbytes - bar.pos)  # done, even if it read less than estimated
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]  # type: ignore[no-any-return]
