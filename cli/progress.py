"""Progress bars for long operations: on stderr, on a terminal only, for large data only.

Piped or redirected, the command stays quiet. While a bar is shown, a command's report is
held back and printed when the bar is done, so the two never interleave.

Bars advance by bytes: by each finished tensor, and in between by the bytes this process has
read meanwhile (Linux's /proc/self/io), so one 1 GiB tensor moves the bar as it is read
instead of sitting at 0% and jumping to 100%.

Example:
    >>> import io
    >>> shows_progress(1 << 40, stream=io.StringIO())  # not a terminal
    False
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Any, TextIO

import click

__all__ = ["MIN_BYTES", "shows_progress", "tracked", "emit", "byte_bar", "ByteProgress"]

#: Less data than this is read too fast to be worth a bar.
MIN_BYTES = 64 << 20
#: Seconds between redraws from the bytes read so far.
POLL_SECONDS = 0.2


def read_bytes() -> int | None:
    """Bytes this process has read so far (all threads), or None where the system does not say."""
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f:
                if line.startswith(b"rchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


class ByteProgress:
    """Drives a click bar: ``advance(n)`` for finished work; ``refresh()`` moves it on by the
    bytes read since the start (divided by ``io_factor`` when each byte of progress reads
    several, as diff reads two files), never past ``total`` nor backwards.

    Example:
        >>> class Bar:
        ...     pos = 0
        ...     def update(self, n): self.pos += n
        >>> reads = iter([1000, 1000 + 300, 1000 + 600])
        >>> bar = ByteProgress(Bar(), total=500, reader=lambda: next(reads))
        >>> bar.refresh(); bar._bar.pos  # 300 bytes read: 60% before any tensor finished
        300
        >>> bar.advance(200); bar._bar.pos  # finished work counts only when it is further
        500
    """

    def __init__(self, bar: Any, total: int, io_factor: int = 1,
                 reader: Callable[[], int | None] = read_bytes) -> None:
        self._bar, self._total, self._factor, self._reader = bar, total, max(io_factor, 1), reader
        self._start = reader()
        self._done = self._shown = 0
        self._lock = threading.Lock()

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self._done += nbytes
            self._draw()

    def refresh(self) -> None:
        with self._lock:
            self._draw()

    def _draw(self) -> None:
        target = self._done
        now = self._reader() if self._start is not None else None
        if now is not None and self._start is not None:
            target = max(target, (now - self._start) // self._factor)
        target = min(target, self._total)
        if target > self._shown:
            self._bar.update(target - self._shown)
            self._shown = target


@contextmanager
def _driven(bar: Any, total: int, io_factor: int) -> Iterator[ByteProgress]:
    """A ByteProgress for ``bar``, refreshed from the bytes read by a thread while in use."""
    progress = ByteProgress(bar, total, io_factor, read_bytes)
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(POLL_SECONDS):
            progress.refresh()

    poller = threading.Thread(target=poll, name="ckpt-progress", daemon=True)
    poller.start()
    try:
        yield progress
    finally:
        stop.set()
        poller.join()


def shows_progress(nbytes: int, stream: IO[str] | None = None, min_bytes: int = MIN_BYTES) -> bool:
    """True when a bar for ``nbytes`` of work belongs on ``stream`` (default stderr): a terminal, and
    at least ``min_bytes`` of work."""
    stream = sys.stderr if stream is None else stream
    return nbytes >= min_bytes and stream.isatty()


def tracked(label: str, io_factor: int = 1) -> Callable[[Sequence[Any]], Iterator[Any]]:
    """Return a wrapper that iterates TensorInfos, advancing a bar by bytes (see ByteProgress)."""

    def wrap(infos: Sequence[Any]) -> Iterator[Any]:
        total = sum(info.nbytes for info in infos)
        with click.progressbar(length=max(total, 1), label=label, file=sys.stderr) as bar, \
                _driven(bar, total, io_factor) as progress:
            for info in infos:
                yield info
                progress.advance(info.nbytes)

    return wrap


def emit(lines: Iterable[str], held: bool) -> None:
    """Print ``lines``; when ``held`` (a bar is running while they are made), all at the end."""
    for line in list(lines) if held else lines:
        click.echo(line)


@contextmanager
def byte_bar(nbytes: int, label: str, stream: TextIO | None = None, io_factor: int = 1,
             min_bytes: int = MIN_BYTES) -> Iterator[Callable[[int], None] | None]:
    """Yield a ``progress(nbytes_done)`` callback drawing a bar, or None when no bar belongs here
    (``shows_progress``).

    Between callbacks the bar follows the bytes read (``io_factor`` bytes read per byte of
    progress), so a single large tensor advances it too.
    """
    stream = sys.stderr if stream is None else stream
    if not shows_progress(nbytes, stream, min_bytes):
        yield None
        return
    with click.progressbar(length=max(nbytes, 1), label=label, file=stream) as bar, \
            _driven(bar, nbytes, io_factor) as progress:
        yield progress.advance
