"""Low-level file I/O shared by the built-in formats: the local implementations of the storage
layer's blobs (``LocalFile`` reads, ``LocalSink`` writes; see ``ckpt.storage``), helpers that
read or write any blob, and crc32c checksums computed on the same bytes.

Tensors move as ``memoryview``s of the arrays that hold them: nothing here copies a tensor.
Checksums of large tensors run on a worker thread (crc32c releases the GIL) while the main
thread writes or reads the next bytes, so they cost almost nothing in wall time; small
tensors are checksummed inline, and runs of small tensors close together in the file are read
with one ``preadv`` call.
"""

from __future__ import annotations

import io
import operator
import os
import sys
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from ckpt.errors import CorruptCheckpointError
from ckpt.storage import Bytes, ReadableBlob, WritableBlob
from ckpt.storage.regular import open_regular

if TYPE_CHECKING:
    from concurrent.futures import Executor, Future, ThreadPoolExecutor

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("ckpt's file formats are implemented for little-endian hosts only")

#: Granularity of streamed checksums and of verification reads (bounded memory).
CHUNK = 2 << 20
#: Tensors at least this big are checksummed on the worker thread, overlapping I/O.
BIG = 4 << 20
#: Reads of nearby spans are merged when the gap between them is at most this many bytes.
GAP = 4096
_MAX_IOV = 512  # well under IOV_MAX (1024 on Linux); gap fillers count too
_MAX_BATCH = 64 << 20

_crc32c: Any = None


def crc32c(data: Any, value: int = 0) -> int:
    """Return the crc32c of ``data`` (a bytes-like object), continuing from ``value``."""
    global _crc32c
    if _crc32c is None:
        _crc32c = _load_crc32c()
    return int(_crc32c(data, value))


def _load_crc32c() -> Any:
    """The crc32c package's compiled function, loaded on first use without running the
    package's ``__init__``: that imports importlib.metadata to look up its own version, 30-60 ms
    of a command's start-up. Any surprise in the package's layout falls back to the import."""
    import importlib.machinery
    import importlib.util

    try:
        spec = importlib.util.find_spec("crc32c")
        for folder in (spec.submodule_search_locations or []) if spec is not None else []:
            for suffix in importlib.machinery.EXTENSION_SUFFIXES:
                location = os.path.join(folder, "_crc32c" + suffix)
                if os.path.isfile(location):
                    loader = importlib.machinery.ExtensionFileLoader("crc32c._crc32c", location)
                    found = importlib.util.spec_from_file_location(loader.name, location, loader=loader)
                    if found is not None:
                        module = importlib.util.module_from_spec(found)
                        loader.exec_module(module)
                        return module.crc32c
    except (ImportError, AttributeError, OSError):
        pass
    import crc32c as package

    return package.crc32c


_pool: ThreadPoolExecutor | None = None  # started with the first large tensor (concurrent.futures loads then)
_pool_lock = threading.Lock()
#: Threads that copy and checksum large tensors side by side (two copies in parallel move ~1.4x
#: the bytes of one on a 2-core machine; crc32c and the kernel's copies release the GIL).
WORKERS = max(2, min(4, os.cpu_count() or 1))


_this_thread = threading.local()  # .inline: True inside ``one_thread()``


def _workers() -> Executor:
    global _pool
    if getattr(_this_thread, "inline", False):
        return _inline_executor()
    with _pool_lock:
        if _pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="ckpt-io")
        return _pool


@contextmanager
def one_thread() -> Iterator[None]:
    """Inside the block, work this thread would hand to the I/O worker threads (checksums,
    parallel pieces) runs in this thread instead: a background save keeps to one core and
    leaves the others to the training loop.

    Example:
        >>> with one_thread():
        ...     checksum_async(memoryview(bytes(BIG)))() == crc32c(bytes(BIG))
        True
    """
    before = getattr(_this_thread, "inline", False)
    _this_thread.inline = True
    try:
        yield
    finally:
        _this_thread.inline = before


_inline: Executor | None = None


def _inline_executor() -> Executor:
    """An Executor whose ``submit`` runs the call at once in the calling thread."""
    global _inline
    if _inline is None:
        from concurrent.futures import Executor, Future

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
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()  # a forked child has no such threads


os.register_at_fork(after_in_child=_forget_workers)


#: Large tensors are read in pieces of this size, several at once, and their crc32c values
#: combined (a tensor of one piece could only use one core).
PIECE = 4 << 20
_CRC32C_POLY = 0x82F63B78  # Castagnoli, reflected
_piece_operator: list[int] = []


def _gf2_times(matrix: list[int], vector: int) -> int:
    """Multiply a 32x32 GF(2) matrix (its columns as ints) by a 32-bit vector."""
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _zeros_operator(nbytes: int) -> list[int]:
    """The matrix that advances a crc32c register over ``nbytes`` zero bytes (by squaring)."""
    op = [_CRC32C_POLY] + [1 << n for n in range(31)]  # one zero bit
    result = [1 << n for n in range(32)]  # identity
    bits = 8 * nbytes
    while bits:
        if bits & 1:
            result = [_gf2_times(op, column) for column in result]
        op = [_gf2_times(op, column) for column in op]
        bits >>= 1
    return result


def crc32c_combine_piece(crc_a: int, crc_b: int) -> int:
    """crc32c(a + b) from crc32c(a) and crc32c(b), for ``b`` exactly PIECE bytes long."""
    if not _piece_operator:
        _piece_operator.extend(_zeros_operator(PIECE))
    return _gf2_times(_piece_operator, crc_a) ^ crc_b


def checksum_async(view: memoryview) -> Callable[[], int]:
    """Start the crc32c of ``view``; return a function that waits for and returns it."""
    if len(view) < BIG:
        value = crc32c(view)
        return lambda: value
    return _workers().submit(crc32c, view).result


def c_contiguous(arr: np.ndarray) -> np.ndarray:
    """``arr`` itself when C-contiguous, else a C-ordered copy (unlike np.ascontiguousarray, keeps 0-d)."""
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def byte_view(arr: np.ndarray) -> memoryview:
    """A flat, writable-if-possible byte view of a C-contiguous array (0-d and empty included)."""
    if not arr.dtype.hasobject:  # an object array's buffer holds pointers: numpy's view refuses it below
        try:
            return arr.data.cast("B")  # the fast path: 3x cheaper than going through numpy views
        except (ValueError, TypeError):  # no buffer (ml_dtypes' bfloat16, float8), or an empty array
            pass
    return arr.reshape(-1).view(np.uint8).data


class LocalFile:
    """A local file opened for positioned reads: the :class:`ckpt.storage.ReadableBlob` of
    every format reading a file on disk.

    ``name`` (default: ``path``) is what error messages call the file.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "f")
        >>> with open(path, "wb") as f:
        ...     _ = f.write(bytes(range(10)))
        >>> with LocalFile(path) as blob:
        ...     pread(blob, 2, 3, "three bytes")
        b'\\x02\\x03\\x04'
    """

    def __init__(self, path: str, name: str | None = None) -> None:
        self._file = open_regular(path)  # a FileIO: closed (and warned about) like any file
        self.fd = self._file.fileno()
        self._name = path if name is None else name

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
        fd, path = self.fd, self._name
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
            check = _crc32c or crc32c
            for i in group:
                crcs[i] = check(spans[i][1])
            group.clear()
            iov.clear()

        jobs = []
        for i in order:
            offset, view = spans[i]
            n = len(view)
            if n >= BIG:  # pieces of PIECE bytes (the odd remainder first), read side by side
                first = n % PIECE or PIECE
                jobs.append((i, [_submit(read_checked, self, view[start:end], offset + start, name(i))
                                 for start, end in zip([0, *range(first, n, PIECE)], range(first, n + 1, PIECE))]))
                continue
            if group:
                if offset < end or offset - end > GAP or len(iov) >= _MAX_IOV - 1 or end - start > _MAX_BATCH:
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
                    _steal(piece)
        finally:
            errors = []
            for i, pieces in jobs:  # wait for every piece: none may write into a buffer after we return
                try:
                    crc = pieces[0].job.result()
                    for piece in pieces[1:]:
                        crc = crc32c_combine_piece(crc, piece.job.result())
                    crcs[i] = crc
                except CorruptCheckpointError as exc:
                    errors.append(exc)
                    for piece in pieces:
                        piece.job.exception()  # wait for the rest of this tensor's pieces too
        if errors:
            raise errors[0]
        return crcs


def read_checked(source: ReadableBlob, view: memoryview, offset: int, what: str) -> int:
    """Fill ``view`` from ``offset`` and return its crc32c, each chunk checksummed while it is
    still in this core's cache."""
    crc = 0
    for start in range(0, len(view), CHUNK):
        chunk = view[start:start + CHUNK]
        source.read_into(chunk, offset + start, what)
        crc = crc32c(chunk, crc)
    return crc


class _Piece:
    """A worker's job that the submitting thread may run itself while the job is still queued."""

    __slots__ = ("args", "fn", "job")

    def __init__(self, job: Future[int], fn: Callable[..., int], args: tuple[Any, ...]) -> None:
        self.job, self.fn, self.args = job, fn, args


def _submit(fn: Callable[..., int], *args: Any) -> _Piece:
    return _Piece(_workers().submit(fn, *args), fn, args)


def _steal(piece: _Piece) -> None:
    """Run a queued piece in this thread instead of waiting idle for a worker to take it (on a
    busy machine the wait for a free core costs more than the copy)."""
    if piece.job.cancel():
        try:
            from concurrent.futures import Future

            piece.job = Future()
            piece.job.set_result(piece.fn(*piece.args))
        except BaseException as exc:
            piece.job.set_exception(exc)


def pread(source: ReadableBlob, offset: int, size: int, what: str) -> bytes:
    """Read exactly ``size`` bytes at ``offset`` (callers bound ``size`` by the blob's size)."""
    buf = bytearray(size)
    source.read_into(memoryview(buf), offset, what)
    return bytes(buf)


def checksum_range(source: ReadableBlob, offset: int, size: int, what: str, value: int = 0,
                   checksum: Callable[[Any, int], int] = crc32c) -> int:
    """The checksum (crc32c unless told) of ``size`` bytes of ``source`` at ``offset``, read in
    bounded chunks."""
    buf = memoryview(bytearray(min(size, CHUNK)))
    done = 0
    while done < size:
        n = min(len(buf), size - done)
        source.read_into(buf[:n], offset + done, what)
        value = checksum(buf[:n], value)
        done += n
    return value


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over ``size`` bytes of ``source`` from ``start``: for parsers
    that want a file object (zipfile, h5py, pickle streams). Closing it leaves ``source`` open."""

    def __init__(self, source: ReadableBlob, start: int, size: int) -> None:
        super().__init__()
        self._source, self._start, self._size, self._pos = source, start, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._size - self._pos))
        self._source.read_into(view[:n], self._start + self._pos, "the file")
        self._pos += n
        return n


def stream(source: ReadableBlob) -> io.BufferedReader:
    """A buffered file object over the whole of ``source`` (small sequential reads are cheap)."""
    return io.BufferedReader(RangeFile(source, 0, source.size))


class LocalSink:
    """A local file being written: the :class:`ckpt.storage.WritableBlob` of ckpt's writers
    for a path on disk (``pwrite``/``pwritev`` of the callers' buffers, no copies). The file is
    created empty, or with ``create=False`` opened as it is (libhdf5 wrote its structure).

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "f")
        >>> with LocalSink(path) as out:
        ...     out.write_pieces([b"ab", b"cd"], 0)
        ...     out.size
        4
    """

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
    for start in range(0, len(pieces), _MAX_IOV):
        batch = pieces[start:start + _MAX_IOV]
        total = sum(map(len, batch))
        done = os.pwritev(fd, batch, offset)
        if done < total:  # a short write (a signal, a full quota): finish piece by piece
            pwrite_all(fd, b"".join(batch)[done:], offset + done)
        offset += total


#: Bounds on the small pieces one ``write_pieces`` call (one pwritev) writes.
RUN_PIECES, RUN_BYTES = 512, 8 << 20


class Runs:
    """Writes a blob front to back for a format: small pieces that follow each other are
    gathered into runs written by one ``write_pieces`` call, big ones (BIG and up) alone.

    A run holds its pieces (and so their arrays) until it is written: call ``flush()`` before
    reading a lazy source, so a conversion holds one tensor at a time, and at the end.

    ``lent=True`` says ``data`` is a view of an array the writer's caller handed in, alive and
    unchanged until the blob is finished: a blob that offers ``lend_pieces`` (an S3 upload sent
    as one PUT) keeps a reference to it instead of a copy. A run goes to ``lend_pieces`` when
    every piece in it was lent or is an immutable ``bytes`` object.
    """

    __slots__ = ("_end", "_lend", "_lendable", "_run", "_start", "blob")

    def __init__(self, blob: WritableBlob) -> None:
        self.blob = blob
        self._lend: Callable[[Sequence[Bytes], int], None] | None = getattr(blob, "lend_pieces", None)
        self._run: list[Bytes] = []
        self._start = self._end = 0
        self._lendable = True  # every piece of the pending run was lent or is bytes

    def write(self, data: Bytes, offset: int, lent: bool = False) -> None:
        """Write ``data`` at ``offset`` now or with its run (empty data writes nothing)."""
        n = len(data)
        run = self._run
        if run and (offset != self._end or len(run) >= RUN_PIECES or self._end - self._start + n > RUN_BYTES
                    or n >= BIG):
            self.flush()
            run = self._run
        if n >= BIG:
            if lent and self._lend is not None:
                self._lend([data], offset)
            else:
                self.blob.write_at(data, offset)
        elif n:
            if not run:
                self._start = offset
            run.append(data)
            self._end = offset + n
            if not lent and type(data) is not bytes:
                self._lendable = False

    def flush(self) -> None:
        """Write the pending run."""
        if self._run:
            run, self._run = self._run, []
            lendable, self._lendable = self._lendable, True
            if lendable and self._lend is not None:
                self._lend(run, self._start)
            else:
                self.blob.write_pieces(run, self._start)


def expected_nbytes(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of a numeric tensor, computed with Python ints so hostile shapes cannot overflow."""
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n
