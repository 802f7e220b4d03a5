"""Local files as blobs: :class:`LocalFile` (the :class:`ckpt.storage.ReadableBlob` of a file on
disk: ``preadv`` of nearby spans in one call, big spans read in pieces on the I/O workers) and
:class:`LocalSink` (the :class:`ckpt.storage.WritableBlob`: ``pwrite``/``pwritev`` of the
callers' buffers, no copies).

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "f")
    >>> with LocalSink(path) as out:
    ...     out.write_pieces([b"ab", b"cd"], 0)
    >>> with LocalFile(path) as blob:
    ...     buf = bytearray(2)
    ...     blob.read_into(memoryview(buf), 1, "two bytes")
    ...     bytes(buf), blob.size
    (b'bc', 4)
"""

from __future__ import annotations

import bisect
import itertools
import operator
import os
import threading
from typing import Any
from collections.abc import Callable, Sequence

from ckpt import checksums
from ckpt.checksums import crc32c, crc32c_combine
from ckpt.errors import CorruptCheckpointError
from ckpt.storage import Bytes, WritableBlob
from ckpt.storage.blobio import read_checked
from ckpt.storage.regular import open_regular
from ckpt.storage.workers import BIG, WAITERS, Piece, side_by_side, steal, submit

__all__ = ["GAP", "MAX_IOV", "PIECE", "LocalFile", "LocalFolder", "LocalSink", "pwrite_all", "pwritev_all"]

#: Reads of nearby spans are merged when the gap between them is at most this many bytes.
GAP = 4096
#: Pieces per ``preadv``/``pwritev`` call: well under IOV_MAX (1024 on Linux); gap fillers count too.
MAX_IOV = 512
_MAX_BATCH = 64 << 20
#: Large spans are read in pieces of this size, several at once, and their crc32c values
#: combined (a tensor of one piece could only use one core).
PIECE = 4 << 20


class LocalFile:
    """A local file opened for positioned reads: the :class:`ckpt.storage.ReadableBlob` of
    every format reading a file on disk.

    ``name`` (default: ``path``) is what error messages call the file. Spans of ``big`` bytes or
    more are read in pieces of ``piece`` bytes by the I/O workers, side by side.
    """

    def __init__(self, path: str, name: str | None = None, *, piece: int = PIECE, big: int = BIG) -> None:
        self._file = open_regular(path)  # a FileIO: closed (and warned about) like any file
        self.fd = self._file.fileno()
        self._name = path if name is None else name
        self._piece, self._big = piece, big

    @property
    def name(self) -> str:
        return self._name

    @property
    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> LocalFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_into(self, view: memoryview, offset: int, what: str) -> None:
        """Fill ``view`` at ``offset``; a short file or EIO is a CorruptCheckpointError."""
        done, total, fd = 0, len(view), self.fd
        while done < total:
            try:
                n = os.preadv(fd, [view[done:]], offset + done)
            except OSError as exc:
                raise CorruptCheckpointError(f"{self._name}: cannot read {what}: {exc.strerror or exc}") from exc
            if n == 0:
                raise CorruptCheckpointError(
                    f"{self._name}: file ends in the middle of {what} (offset {offset + done}): it is truncated")
            done += n

    def read_spans(self, spans: Sequence[tuple[int, memoryview]], name: Callable[[int], str]) -> list[int]:
        """Fill each ``(offset, view)`` from the file and return the views' crc32c values.

        Spans within GAP bytes of each other are read by one ``preadv`` (the gaps land in a
        scratch buffer); big spans are read by the worker threads, several at once. ``name(i)``
        labels span i in errors.
        """
        fd, path, piece_size = self.fd, self._name, self._piece
        crcs = [0] * len(spans)
        order: Sequence[int] = range(len(spans))
        offsets = [offset for offset, _ in spans]
        if any(map(operator.gt, offsets, offsets[1:])):
            order = sorted(order, key=offsets.__getitem__)
        group: list[int] = []
        iov: list[memoryview] = []
        scratch = memoryview(bytearray(GAP))
        gaps: dict[int, memoryview] = {}  # scratch views by length (msgpack's bin headers: a few lengths)
        start = end = 0

        def flush() -> None:
            if not group:
                return
            try:
                n = os.preadv(fd, iov, start) if end > start else 0
            except OSError as exc:
                raise CorruptCheckpointError(f"{path}: cannot read {name(group[0])}: {exc.strerror or exc}") from exc
            if n != end - start:  # a short read: redo span by span, which names what is missing
                for i in group:
                    self.read_into(spans[i][1], spans[i][0], name(i))
            check = checksums._crc32c or crc32c  # the compiled function itself: many small spans
            for i in group:
                crcs[i] = check(spans[i][1])
            group.clear()
            iov.clear()

        jobs: list[tuple[int, list[Piece]]] = []
        for i in order:
            offset, view = spans[i]
            n = len(view)
            if n >= self._big:  # pieces of piece_size bytes (the odd remainder first), read side by side
                first = n % piece_size or piece_size
                jobs.append((i, [submit(read_checked, self, view[a:b], offset + a, name(i))
                                 for a, b in zip([0, *range(first, n, piece_size)], range(first, n + 1, piece_size))]))
                continue
            if group:
                if offset < end or offset - end > GAP or len(iov) >= MAX_IOV - 1 or end - start > _MAX_BATCH:
                    flush()
                    start = offset
                elif offset > end:
                    gap = gaps.get(offset - end)
                    if gap is None:
                        gap = gaps[offset - end] = scratch[:offset - end]
                    iov.append(gap)
            else:
                start = offset
            if n:
                iov.append(view)
            group.append(i)
            end = offset + n
        try:
            flush()
            for _, pieces in reversed(jobs):  # pieces no worker has started yet, this thread reads itself
                for piece in reversed(pieces):
                    steal(piece)
        finally:
            errors = []
            for i, pieces in jobs:  # wait for every piece: none may write into a buffer after we return
                try:
                    crc = pieces[0].job.result()
                    for piece in pieces[1:]:
                        crc = crc32c_combine(crc, piece.job.result(), piece_size)
                    crcs[i] = crc
                except CorruptCheckpointError as exc:
                    errors.append(exc)
                    for piece in pieces:
                        piece.job.exception()  # wait for the rest of this tensor's pieces too
        if errors:
            raise errors[0]
        return crcs


    def read_buffers(self, offsets: Sequence[int], buffers: Sequence[Any], name: Callable[[int], str],
                     byte_view: Callable[[Any], memoryview]) -> list[int]:
        """``read_spans`` for buffers that need not be byte views: C-contiguous, writable objects
        with ``nbytes`` (numpy arrays of any dtype) at disjoint ``offsets``. Returns each buffer's
        crc32c. When any buffer has ``big`` bytes or more, all go to ``read_spans`` as
        ``byte_view(buffer)`` (whose workers read the big ones while this thread reads the rest).

        Why: a byte view costs a buffer export and a cast per tensor, a tenth of a restore of
        10,000 small tensors, while ``preadv`` and crc32c take the arrays themselves. Buffers
        within GAP bytes of each other are read in runs, one ``preadv`` each, built by C loops.
        """
        if max(map(_NBYTES, buffers), default=0) >= self._big:
            return self.read_spans(list(zip(offsets, map(byte_view, buffers))), name)
        return self._read_small(offsets, buffers, name)

    def _read_small(self, offsets: Sequence[int], buffers: Sequence[Any], name: Callable[[int], str]) -> list[int]:
        """``read_buffers`` of buffers under ``big`` bytes."""
        order: list[int] | None = None
        if any(map(operator.gt, offsets, offsets[1:])):
            order = sorted(range(len(offsets)), key=offsets.__getitem__)
            offsets, buffers = list(map(offsets.__getitem__, order)), list(map(buffers.__getitem__, order))
        ends = list(map(operator.add, offsets, map(_NBYTES, buffers)))
        gaps = list(map(operator.sub, offsets[1:], ends[:-1]))  # gaps[i]: the bytes between buffers i and i + 1
        if min(gaps, default=0) < 0:
            raise ValueError("read_buffers takes disjoint buffers")
        scratch = memoryview(bytearray(GAP))
        fillers = {gap: scratch[:gap] for gap in set(gaps)}  # a few lengths (msgpack's bin headers)
        per_run = (MAX_IOV - 1) // 2  # a buffer and the gap before it: two iovecs
        cuts = [i + 1 for i, gap in enumerate(gaps) if gap > GAP] if max(gaps, default=0) > GAP else []  # far apart
        for first, last in itertools.pairwise([0, *cuts, len(ends)]):
            while first < last:  # at most per_run buffers, ending by _MAX_BATCH bytes past the run's start
                stop = min(first + per_run,
                           max(first + 1, bisect.bisect_right(ends, offsets[first] + _MAX_BATCH, first, last)))
                iov = [buffers[first], *itertools.chain.from_iterable(
                    zip(map(fillers.__getitem__, gaps[first:stop - 1]), buffers[first + 1:stop]))]
                try:
                    done = self._preadv_run(iov, offsets[first], ends[stop - 1])
                except OSError as exc:
                    what = name(first if order is None else order[first])
                    raise CorruptCheckpointError(f"{self._name}: cannot read {what}: {exc.strerror or exc}") from exc
                if done < ends[stop - 1]:
                    cut = bisect.bisect_right(ends, done, first, stop)
                    raise CorruptCheckpointError(f"{self._name}: file ends in the middle of "
                                                 f"{name(cut if order is None else order[cut])} (offset {done}): "
                                                 "it is truncated")
                first = stop
        crcs = list(map(checksums._crc32c or crc32c, buffers))  # the compiled function itself: many calls
        if order is None:
            return crcs
        out = [0] * len(crcs)
        for i, crc in zip(order, crcs):
            out[i] = crc
        return out

    def _preadv_run(self, iov: list[Any], start: int, end: int) -> int:
        """``preadv`` of a run from ``start``; return where the bytes read end (``end`` unless the
        file is shorter; a short read is tried once more, in case the file was being extended)."""
        done = start + os.preadv(self.fd, iov, start)
        if done < end:
            done = start + os.preadv(self.fd, iov, start)
        return done


_NBYTES = operator.attrgetter("nbytes")


class LocalSink(WritableBlob):
    """A local file being written: the :class:`ckpt.storage.WritableBlob` of ckpt's writers
    for a path on disk (``pwrite``/``pwritev`` of the callers' buffers, no copies). The file is
    created empty, or with ``create=False`` opened as it is (libhdf5 wrote its structure)."""

    def __init__(self, path: str, *, create: bool = True) -> None:
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | (os.O_CREAT | os.O_TRUNC if create else 0)
        self.fd = os.open(path, flags, 0o666)
        self._name = path

    @property
    def name(self) -> str:
        return self._name

    @property
    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def write_at(self, data: Bytes, offset: int) -> None:
        pwrite_all(self.fd, data, offset)

    def write_pieces(self, pieces: Sequence[Bytes], offset: int) -> None:
        pwritev_all(self.fd, pieces, offset)

    def lend_pieces(self, pieces: Sequence[Bytes], offset: int) -> None:
        # the default, restated here: a save's writes stay in this module (no call through the base)
        self.write_pieces(pieces, offset)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __enter__(self) -> LocalSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write every byte of ``data`` at ``offset``."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def pwritev_all(fd: int, pieces: Sequence[Any], offset: int) -> None:
    """Write ``pieces`` (bytes or flat byte memoryviews) back to back from ``offset``, many per
    system call, without joining them into one copy."""
    for start in range(0, len(pieces), MAX_IOV):
        batch = pieces[start:start + MAX_IOV]
        total = sum(map(len, batch))
        done = os.pwritev(fd, batch, offset)
        if done < total:  # a short write (a signal, a full quota): finish piece by piece
            pwrite_all(fd, b"".join(batch)[done:], offset + done)
        offset += total


class LocalFolder:
    """A local folder's files read whole: the :class:`ckpt.storage.Folder` of a local
    incremental checkpoint's chunk store (one ``readinto`` per file; a batch of at least ``BIG``
    bytes read side by side on the I/O threads that wait on the disk, so its queue fills)."""

    def __init__(self, path: str) -> None:
        self.path = path
        # descriptors of the files read by ranges (packs), kept until ``close``: the kernel reads
        # ahead per descriptor, and a fresh one for every batch would start each cold
        self._fds: dict[str, int | str] = {}
        self._fds_lock = threading.Lock()

    def __del__(self) -> None:  # a reader left unclosed still gives its descriptors back
        if getattr(self, "_fds", None):
            self.close()

    def close(self) -> None:
        """Close the descriptors of the files read by ranges."""
        with self._fds_lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            if isinstance(fd, int):
                os.close(fd)

    def _held(self, name: str) -> int | str:
        with self._fds_lock:
            fd = self._fds.get(name)
            if fd is None:
                fd = self._fds[name] = self._open(name)
            return fd

    @property
    def location(self) -> str:
        return self.path

    def where(self, name: str) -> str:
        return os.path.join(self.path, name)

    def read_objects(self, items: Sequence[tuple[str, memoryview]]) -> list[str | bytes | None]:
        if len(items) > 1 and sum(len(view) for _, view in items) >= BIG:
            return side_by_side(self._read, items)
        return [self._read(name, view) for name, view in items]

    def read_checked(self, items: Sequence[tuple[str, memoryview]]) -> list[tuple[str | bytes | None, int]]:
        """``read_objects``, each answer with the crc32c of the view it filled (0 when not filled),
        computed by the thread that read it, while the bytes are still in its core's cache."""
        if len(items) > 1 and sum(len(view) for _, view in items) >= BIG:
            # runs of files, one job each, as many as threads wait on the disk: a job per file costs
            # more in handoffs between threads than it reads (a 1 MiB chunk: ~0.1 ms from the cache)
            per_job = -(-len(items) // WAITERS)
            runs = side_by_side(self._read_run, [(items[i:i + per_job],) for i in range(0, len(items), per_job)],
                                helping=True)
            return [answer for run in runs for answer in run]
        return self._read_run(items)

    def prefetch(self, names: Sequence[str]) -> None:
        """Ask the kernel to read the files ``names`` ahead (a hint: errors are left to the reads),
        so a cold disk's queue stays full between two groups of reads."""
        for name in names:
            fd = self._open(name)
            if isinstance(fd, int):
                _will_need(fd)
                os.close(fd)

    def prefetch_ranges(self, items: Sequence[tuple[str, int, int]]) -> None:
        """``prefetch`` of ``(name, offset, length)`` byte ranges (neighbouring ones in one hint)."""
        spans: dict[str, list[list[int]]] = {}
        for name, offset, length in sorted(items):
            held = spans.setdefault(name, [])
            if held and held[-1][1] == offset:
                held[-1][1] = offset + length
            else:
                held.append([offset, offset + length])
        for name, ranges in spans.items():
            fd = self._open(name)
            if isinstance(fd, int):
                for start, end in ranges:
                    _will_need(fd, start, end - start)
                os.close(fd)

    def _read_run(self, items: Sequence[tuple[str, memoryview]]) -> list[tuple[str | bytes | None, int]]:
        """Each file read into its view and checksummed, in turn, ``_HINTED`` files at a time: the
        kernel is first told to read those ahead, so a cold disk holds their reads in its queue."""
        answers: list[tuple[str | bytes | None, int]] = []
        for first in range(0, len(items), _HINTED):
            part = items[first:first + _HINTED]
            opened = [self._open(name) for name, _ in part]
            try:
                for fd in opened if len(part) > 1 else ():
                    if isinstance(fd, int):
                        _will_need(fd)
                for fd, (_, view) in zip(opened, part):
                    answer = self._fill(fd, view) if isinstance(fd, int) else fd
                    answers.append((answer, crc32c(view) if answer is None else 0))
            finally:
                for fd in opened:
                    if isinstance(fd, int):
                        os.close(fd)
        return answers

    def _read(self, name: str, view: memoryview) -> str | bytes | None:
        fd = self._open(name)
        if isinstance(fd, str):
            return fd
        try:
            return self._fill(fd, view)
        finally:
            os.close(fd)

    def _open(self, name: str) -> int | str:
        """A descriptor of the file ``name`` (os.open, no Python file object: a restore opens a
        file per chunk, 1,000 per GiB), or what is wrong with it."""
        try:
            return os.open(self.where(name), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return "is missing"
        except OSError as exc:
            return f"cannot be read: {exc.strerror or exc}"

    def _fill(self, fd: int, view: memoryview) -> str | bytes | None:
        """Read_objects' answer for the open file ``fd``."""
        try:
            size = os.fstat(fd).st_size
            if size < len(view):
                return _read_fd(fd, size)  # an encoded chunk: the caller decodes it
            if size > len(view):
                return f"holds more than {len(view)} bytes"
            got = _preadv_full(fd, view)
        except OSError as exc:
            return f"cannot be read: {exc.strerror or exc}"
        return None if got == len(view) else f"holds {got} bytes, not {len(view)}: it is truncated"

    def read_whole(self, names: Sequence[str], limit: int) -> list[bytes | str]:
        if len(names) > 1:  # a delta chain's files, each up to a chunk: side by side
            return side_by_side(self._read_whole, [(name, limit) for name in names])
        return [self._read_whole(name, limit) for name in names]

    def _read_whole(self, name: str, limit: int) -> bytes | str:
        try:
            with open(self.where(name), "rb") as f:
                data = f.read(limit + 1)
                return data if len(data) <= limit else f"holds more than {limit} bytes"
        except FileNotFoundError:
            return "is missing"
        except OSError as exc:
            return f"cannot be read: {exc.strerror or exc}"

    def read_ranges(self, items: Sequence[tuple[str, int, memoryview]]) -> list[tuple[str | None, int | None]]:
        """Neighbouring ranges of one file are read with one ``preadv`` (up to ``_RUN`` bytes), so
        the kernel sees large sequential reads of a pack, as of one big checkpoint file: a batch of
        at least ``BIG`` bytes is read as a big tensor is (those pieces in file order on the
        workers, this thread taking the ones none has started), through one descriptor per file
        kept until ``close`` (the kernel's readahead follows a descriptor), and the thread that
        read a view computes its crc32c while the bytes are in its cache."""
        order = sorted(range(len(items)), key=lambda i: (items[i][0], items[i][1]))
        runs: list[list[int]] = []
        size = 0
        for i in order:
            name, offset, view = items[i]
            if runs:
                last = items[runs[-1][-1]]
                if last[0] == name and last[1] + len(last[2]) == offset and len(runs[-1]) < MAX_IOV \
                        and size + len(view) <= _RUN:
                    runs[-1].append(i)
                    size += len(view)
                    continue
            runs.append([i])
            size = len(view)
        opened = {name: self._held(name) for name in dict.fromkeys(name for name, _, _ in items)}
        answers: list[tuple[str | None, int | None]] = [(None, None)] * len(items)
        if len(runs) > 1 and sum(len(view) for _, _, view in items) >= BIG:
            # as a big tensor of one file is read: pieces in file order on the workers, this thread
            # reading those none has started (from the last)
            jobs = [submit(self._read_runs, items, [run], opened, answers) for run in runs]
            for job in reversed(jobs):
                steal(job)
            for job in jobs:  # every piece waited for: none may write into a view after we return
                job.job.exception()
            for job in jobs:  # then the first error in file order, if any
                job.job.result()
        else:
            self._read_runs(items, runs, opened, answers)
        return answers

    @staticmethod
    def _read_runs(items: Sequence[tuple[str, int, memoryview]], runs: list[list[int]], opened: dict[str, int | str],
                   answers: list[tuple[str | None, int | None]]) -> int:
        """Each run of neighbouring ranges read with one ``preadv`` from the file's descriptor
        (``opened``: one per file, shared by the threads, so the kernel sees one reader of the
        file and reads it ahead as one), in order, each item's answer put in ``answers``;
        returns how many runs."""
        for run in runs:
            fd = opened[items[run[0]][0]]
            if isinstance(fd, str):
                for i in run:
                    answers[i] = (fd, None)
                continue
            start = items[run[0]][1]
            try:
                got = _preadv_views(fd, [items[i][2] for i in run], start)
            except OSError as exc:
                for i in run:
                    answers[i] = (f"cannot be read: {exc.strerror or exc}", None)
                continue
            for i in run:
                _, offset, view = items[i]
                answers[i] = (None, crc32c(view)) if got >= offset - start + len(view) else \
                    (f"is truncated: the file ends at byte {start + got}, before byte {offset + len(view)}", None)
        return len(runs)

    def sizes(self) -> dict[str, int]:
        try:
            with os.scandir(self.path) as entries:
                return {e.name: e.stat().st_size for e in entries if e.is_file()}
        except FileNotFoundError:
            return {}


#: Files a run of reads holds open and hinted at once (few descriptors, whatever the chunk size).
_HINTED = 32


#: Bytes of neighbouring ranges of one file read with one ``preadv`` (a piece, as of a big tensor).
_RUN = PIECE


def _will_need(fd: int, offset: int = 0, length: int = 0) -> None:
    """Tell the kernel the file (``length`` bytes from ``offset``; 0: to its end) will be read
    soon (where it takes the hint)."""
    advise = getattr(os, "posix_fadvise", None)  # not on macOS
    if advise is not None:
        try:
            advise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # a hint: the read itself reports what is wrong


def _preadv_full(fd: int, view: memoryview) -> int:
    """Fill ``view`` from the start of ``fd``; the bytes read (fewer when the file ends first)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], done)
        if n == 0:
            break
        done += n
    return done


def _preadv_views(fd: int, views: list[memoryview], offset: int) -> int:
    """Fill ``views`` back to back from ``offset`` of ``fd``; the bytes read (fewer when the file
    ends first)."""
    total, done, first = sum(map(len, views)), 0, 0
    while done < total:
        n = os.preadv(fd, views[first:], offset + done)
        if n == 0:
            break
        done += n
        while first < len(views) and n >= len(views[first]):  # a short read: go on where it stopped
            n -= len(views[first])
            first += 1
        if n:
            views = views[:first] + [views[first][n:]] + views[first + 1:]
    return done


def _read_fd(fd: int, size: int) -> bytes:
    """The first ``size`` bytes of ``fd`` (fewer when the file ends first)."""
    data = os.pread(fd, size, 0)
    while len(data) < size:
        more = os.pread(fd, size - len(data), len(data))
        if not more:
            break
        data += more
    return data
