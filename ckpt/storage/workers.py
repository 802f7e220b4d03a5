"""The I/O worker threads: checksums of large buffers and pieces of large reads run on them,
side by side with the thread that writes or reads the next bytes (crc32c and the kernel's copies
release the GIL), so they cost almost nothing in wall time.

Example:
    >>> from ckpt.checksums import crc32c
    >>> with one_thread():
    ...     checksum_async(memoryview(bytes(BIG)))() == crc32c(bytes(BIG))
    True
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar
from collections.abc import Callable, Iterator, Sequence

from ckpt.checksums import crc32c

if TYPE_CHECKING:
    from concurrent.futures import Executor, Future, ThreadPoolExecutor

__all__ = ["BIG", "WAITERS", "WORKERS", "Piece", "checksum_async", "one_thread", "side_by_side", "steal", "submit",
           "waiters", "workers"]

T = TypeVar("T")

#: Buffers at least this big are checksummed on a worker thread, overlapping I/O.
BIG = 4 << 20
#: Threads that copy and checksum large tensors side by side (two copies in parallel move ~1.4x
#: the bytes of one on a 2-core machine; crc32c and the kernel's copies release the GIL).
WORKERS = max(2, min(4, os.cpu_count() or 1))

#: Threads for jobs that mostly wait on the disk (a chunk written and fsynced per job): more than
#: the cores, since fsyncs in flight together share the filesystem's journal commits (256 small
#: files fsynced by 8 threads: ~4x faster than one at a time on this project's ext4 disk).
WAITERS = 8

_pool: ThreadPoolExecutor | None = None  # started with the first large tensor (concurrent.futures loads then)
_waiters: ThreadPoolExecutor | None = None  # started with the first incremental save's large tensor
_pool_lock = threading.Lock()
_this_thread = threading.local()  # .inline: True inside ``one_thread()``; .waiter: on a waiters() thread
_inline: Executor | None = None


def workers() -> Executor:
    """The shared pool of I/O worker threads (inside ``one_thread()``: this thread itself)."""
    global _pool
    if getattr(_this_thread, "inline", False):
        return _inline_executor()
    with _pool_lock:
        if _pool is None:
            from concurrent.futures import ThreadPoolExecutor  # lazy: no big checksum, no threads

            _pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="ckpt-io")
        return _pool


def waiters() -> Executor:
    """The shared pool of threads for jobs that wait on the disk (inside ``one_thread()``: this
    thread itself)."""
    global _waiters
    if getattr(_this_thread, "inline", False):
        return _inline_executor()
    with _pool_lock:
        if _waiters is None:
            from concurrent.futures import ThreadPoolExecutor  # lazy, as in workers()

            _waiters = ThreadPoolExecutor(max_workers=WAITERS, thread_name_prefix="ckpt-wait",
                                          initializer=_mark_waiter)
        return _waiters


def _mark_waiter() -> None:
    _this_thread.waiter = True


def side_by_side(fn: Callable[..., T], jobs: Sequence[tuple[Any, ...]], *, helping: bool = False) -> list[T]:
    """``fn(*job)`` of every job on the ``waiters()`` threads; the results in order, or the first
    job's error in order. Every job has ended when this returns, even after an error (none may
    still use a caller's buffer). Called on a waiter thread, the jobs run on it one by one (a pool
    waiting on its own jobs could run out of threads). ``helping``: this thread runs the jobs no
    waiter has started yet (from the last), rather than wait idle (jobs that use a core: copies)."""
    if getattr(_this_thread, "waiter", False):
        return [fn(*job) for job in jobs]
    futures = [waiters().submit(fn, *job) for job in jobs]
    if helping:
        for i in reversed(range(len(futures))):
            if futures[i].cancel():
                futures[i] = _run_here(fn, jobs[i])
    for future in futures:
        future.exception()  # waits
    return [future.result() for future in futures]


def _run_here(fn: Callable[..., T], job: tuple[Any, ...]) -> Future[T]:
    """``fn(*job)`` run in this thread, as a finished Future."""
    from concurrent.futures import Future  # lazy: as ThreadPoolExecutor in workers()

    done: Future[T] = Future()
    try:
        done.set_result(fn(*job))
    except BaseException as exc:  # raised in order, as a waiter's would be
        done.set_exception(exc)
    return done


@contextmanager
def one_thread() -> Iterator[None]:
    """Inside the block, work this thread would hand to the I/O worker threads (checksums,
    parallel pieces) runs in this thread instead: a background save keeps to one core and
    leaves the others to the training loop."""
    before = getattr(_this_thread, "inline", False)
    _this_thread.inline = True
    try:
        yield
    finally:
        _this_thread.inline = before


def _inline_executor() -> Executor:
    """An Executor whose ``submit`` runs the call at once in the calling thread."""
    global _inline
    if _inline is None:
        from concurrent.futures import Executor, Future  # lazy: as ThreadPoolExecutor in workers()

        class InlineExecutor(Executor):
            def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
                future: Future[Any] = Future()
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:
                    future.set_exception(exc)
                return future

        _inline = InlineExecutor()
    return _inline


def _forget_workers() -> None:
    global _pool, _waiters, _pool_lock
    _pool, _waiters, _pool_lock = None, None, threading.Lock()  # a forked child has no such threads


os.register_at_fork(after_in_child=_forget_workers)


def checksum_async(view: memoryview, big: int = BIG) -> Callable[[], int]:
    """Start the crc32c of ``view`` (on a worker when it is ``big`` bytes or more); return a
    function that waits for and returns it."""
    if len(view) < big:
        value = crc32c(view)
        return lambda: value
    return workers().submit(crc32c, view).result


class Piece:
    """A worker's job that the submitting thread may run itself while the job is still queued."""

    __slots__ = ("args", "fn", "job")

    def __init__(self, job: Future[int], fn: Callable[..., int], args: tuple[Any, ...]) -> None:
        self.job, self.fn, self.args = job, fn, args


def submit(fn: Callable[..., int], *args: Any) -> Piece:
    """Queue ``fn(*args)`` on the workers as a :class:`Piece`."""
    return Piece(workers().submit(fn, *args), fn, args)


def steal(piece: Piece) -> None:
    """Run a queued piece in this thread instead of waiting idle for a worker to take it (on a
    busy machine the wait for a free core costs more than the copy)."""
    if piece.job.cancel():
        try:
            from concurrent.futures import Future  # lazy: as ThreadPoolExecutor in workers()

            piece.job = Future()
            piece.job.set_result(piece.fn(*piece.args))
        except BaseException as exc:
            piece.job.set_exception(exc)
