"""The formats' blob helpers (formats/_io over ckpt.storage): piecewise parallel reads of local
files and the crc32c arithmetic behind them."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
from typing import ClassVar

import crc32c
import numpy as np
import pytest

import ckpt
import ckpt.storage.local
import ckpt.storage.state
import ckpt.saving.files
from ckpt.checksums import crc32c_combine
from ckpt.formats import _io, base
from ckpt.storage import ReadableBlob
from ckpt.storage.localfile import LocalFile

KiB = 1 << 10
PIECE, BIG = 4 * KiB, 8 * KiB  # the local file's piece and big-span sizes, small: the same code on less data


@pytest.mark.parametrize("head", [1, 100, 4096, 4 << 20])
@pytest.mark.parametrize("tail", [1, 4096, 4 << 20])
def test_crc32c_combine_matches_the_checksum_of_the_concatenation(head, tail):
    rng = np.random.default_rng(head + tail)
    a, b = rng.bytes(head), rng.bytes(tail)
    assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), tail) == crc32c.crc32c(a + b)


@pytest.mark.parametrize("size", [BIG, 2 * PIECE + BIG, 3 * PIECE + 1234, BIG + 1])
def test_large_spans_are_read_in_pieces_with_the_whole_checksum(tmp_path, size):
    data = np.random.default_rng(size).bytes(5 * PIECE + 2000)
    path = str(tmp_path / "data")
    pathlib.Path(path).write_bytes(data)
    with LocalFile(path, piece=PIECE, big=BIG) as source:
        small, big = bytearray(10), bytearray(size)
        crcs = source.read_spans([(7, memoryview(big)), (0, memoryview(small))], lambda i: f"span {i}")
    assert bytes(big) == data[7:7 + size] and bytes(small) == data[:10]
    assert crcs == [crc32c.crc32c(data[7:7 + size]), crc32c.crc32c(data[:10])]


def test_a_short_file_fails_every_piece_cleanly(tmp_path):
    path = str(tmp_path / "short")
    pathlib.Path(path).write_bytes(bytes(2 * PIECE + 10))
    with LocalFile(path, piece=PIECE, big=BIG) as source, \
            pytest.raises(ckpt.CorruptCheckpointError, match="short: file ends in the middle of span 0.*truncated"):
        source.read_spans([(0, memoryview(bytearray(5 * PIECE)))], lambda i: f"span {i}")


class _SpanCounting(LocalFile):
    """A local file that records the size of every ``read_spans`` span it is asked for."""

    def __init__(self, path: str) -> None:
        super().__init__(path, piece=PIECE, big=BIG)
        self.spans: list[int] = []

    def read_spans(self, spans, name):
        self.spans += [len(view) for _, view in spans]
        return super().read_spans(spans, name)


@pytest.mark.parametrize("size", [3 * BIG, 3 * BIG + 1234, 5 * PIECE + 1000])
@pytest.mark.parametrize("value", [0, 0x1234567])
def test_a_long_checksum_range_is_read_a_window_at_a_time_side_by_side(tmp_path, size, value):
    """Verification reads a long range through read_spans (pieces on the I/O workers: both cores)
    in windows of bounded size, and continues the checksum it is given."""
    data = np.random.default_rng(size).bytes(size + 100)
    path = str(tmp_path / "data")
    pathlib.Path(path).write_bytes(data)
    with _SpanCounting(path) as source:
        got = _io.checksum_range(source, 50, size, "the range", value, window=BIG)
    assert got == crc32c.crc32c(data[50:50 + size], value)
    assert sum(source.spans) == size and max(source.spans) == BIG  # bounded memory: one window


def test_a_truncated_range_fails_its_windowed_checksum_naming_the_file(tmp_path):
    path = str(tmp_path / "short")
    pathlib.Path(path).write_bytes(bytes(2 * BIG))
    with LocalFile(path, piece=PIECE, big=BIG) as source, \
            pytest.raises(ckpt.CorruptCheckpointError, match="short: file ends in the middle of tensor 'w'"):
        _io.checksum_range(source, 0, 3 * BIG, "tensor 'w'", window=BIG)


class _FailingSink:
    """A writable blob whose writes fail (a full disk)."""

    name = "full.bin"

    def write_at(self, data, offset):
        raise OSError(28, "No space left on device")


class _WaitingSink:
    """A writable blob whose write waits until the chunk's checksum has started elsewhere."""

    name = "waiting.bin"

    def __init__(self, started: threading.Event) -> None:
        self.started, self.written = started, b""

    def write_at(self, data, offset):
        assert self.started.wait(timeout=60), "the checksum did not start while the chunk was written"
        self.written = bytes(data)


def test_a_streamed_chunk_is_checksummed_on_a_worker_while_it_is_written():
    chunk = memoryview(np.random.default_rng(1).bytes(_io.BIG))
    started, threads, crcs = threading.Event(), [], []

    def update(view):
        threads.append(threading.get_ident())
        started.set()
        crcs.append(crc32c.crc32c(view))

    sink = _WaitingSink(started)
    _io.write_checked(sink, chunk, 3, update)
    assert sink.written == bytes(chunk) and crcs == [crc32c.crc32c(chunk)]
    assert threads != [threading.get_ident()]  # the checksum ran beside the write, not after it


def test_a_failed_chunk_write_raises_once_its_checksum_is_done():
    done = []
    with pytest.raises(OSError, match="No space left"):
        _io.write_checked(_FailingSink(), memoryview(bytes(_io.BIG)), 0, lambda view: done.append(len(view)))
    assert done == [_io.BIG]  # the worker finished with the buffer before the error left


def test_local_files_are_readable_blobs_named_in_errors(tmp_path):
    path = str(tmp_path / "blob")
    pathlib.Path(path).write_bytes(b"0123456789")
    with _io.LocalFile(path, name="shown-name") as source:
        assert isinstance(source, ReadableBlob) and source.name == "shown-name" and source.size == 10
        assert _io.pread(source, 3, 4, "four bytes") == b"3456"
        assert _io.checksum_range(source, 0, 10, "all") == crc32c.crc32c(b"0123456789")
        with pytest.raises(ckpt.CorruptCheckpointError, match="^shown-name: file ends in the middle of the tail"):
            _io.pread(source, 8, 4, "the tail")
        with _io.stream(source) as f:  # a buffered file object over the blob, for zipfile and pickles
            f.seek(2)
            assert f.read(3) == b"234" and f.read() == b"56789"


class _Recording(_io.LocalSink):
    """A LocalSink that records each write's (offset, length)."""

    writes: ClassVar[list[tuple[int, int]]] = []

    def write_at(self, data, offset):
        _Recording.writes.append((offset, len(memoryview(data).cast("B"))))
        super().write_at(data, offset)

    def write_pieces(self, pieces, offset):
        _Recording.writes.append((offset, sum(len(memoryview(p).cast("B")) for p in pieces)))
        super().write_pieces(pieces, offset)


@pytest.mark.parametrize("ext", [".h5", ".msgpack", ".safetensors"])
def test_writers_keep_the_writable_blob_order_an_object_store_can_stream(tmp_path, monkeypatch, ext):
    # the head (before the end of the first write) may be filled at any time; past it, writes go front to back
    monkeypatch.setattr(ckpt.storage.local, "LocalSink", _Recording)  # the class the store writes through
    monkeypatch.setattr(_io, "LocalSink", _Recording)
    monkeypatch.setattr(ckpt.saving.files, "LocalSink", _Recording)  # save_file's
    _Recording.writes = []
    rng = np.random.default_rng(1)
    tensors = {f"small/{i}": rng.standard_normal(17).astype(np.float32) for i in range(700)}
    tensors.update(big=rng.standard_normal(_io.BIG // 4 + 3).astype(np.float32), empty=np.zeros((0, 2), np.int8))
    path = str(tmp_path / f"m{ext}")
    source = str(tmp_path / "source.h5")
    ckpt.save_file(tensors, source)
    _Recording.writes = []
    ckpt.convert(source, path)  # streaming sources: chunks of reused buffers, written as they come
    assert_write_order(_Recording.writes, path)
    loaded = ckpt.load_file(path)
    assert all(np.array_equal(loaded[k], v) for k, v in tensors.items())
    _Recording.writes = []
    ckpt.save_file(tensors, path)  # arrays: small ones gathered into runs
    assert_write_order(_Recording.writes, path)
    loaded = ckpt.load_file(path)
    assert all(np.array_equal(loaded[k], v) for k, v in tensors.items())


def assert_write_order(writes, path):
    assert len(writes) >= 3
    head_end = writes[0][0] + writes[0][1]
    end = head_end
    for offset, n in writes[1:]:
        if offset + n <= head_end:
            continue
        assert offset >= end, (offset, end, writes)
        end = offset + n
    assert end == pathlib.Path(path).stat().st_size


class _Lending(_io.LocalSink):
    """A LocalSink that also takes lent pieces (as an S3 upload sent as one PUT does) and records them."""

    lent: ClassVar[list[object]] = []

    def lend_pieces(self, pieces, offset):
        _Lending.lent.extend(pieces)
        super().write_pieces(pieces, offset)


@pytest.mark.parametrize("ext", [".h5", ".msgpack", ".safetensors"])
def test_writers_lend_only_the_callers_own_arrays(tmp_path, monkeypatch, ext):
    # a blob may keep a lent buffer until it is finished: only arrays the caller handed in qualify
    rng = np.random.default_rng(2)
    tensors = {f"small/{i}": rng.standard_normal(17).astype(np.float32) for i in range(50)}
    tensors.update(big=rng.standard_normal(_io.BIG // 4 + 3).astype(np.float32),
                   strided=rng.standard_normal((600, 2000)).astype(np.float32).T)  # not C-contiguous: copied
    plain = str(tmp_path / f"plain{ext}")
    ckpt.save_file(tensors, plain)
    monkeypatch.setattr(ckpt.storage.local, "LocalSink", _Lending)
    monkeypatch.setattr(_io, "LocalSink", _Lending)
    monkeypatch.setattr(ckpt.saving.files, "LocalSink", _Lending)  # save_file's
    _Lending.lent = []
    path = str(tmp_path / f"m{ext}")
    ckpt.save_file(tensors, path)
    assert pathlib.Path(path).read_bytes() == pathlib.Path(plain).read_bytes()
    views = [np.frombuffer(p, np.uint8) for p in _Lending.lent if not isinstance(p, bytes)]
    owners = [next((k for k, v in tensors.items() if np.shares_memory(view, v)), None) for view in views]
    assert None not in owners  # every lent buffer (but immutable bytes) is a caller's array
    assert "big" in owners and "strided" not in owners and len(set(owners)) > 10
    source = str(tmp_path / "source.h5")
    ckpt.save_file(tensors, source)
    _Lending.lent = []
    ckpt.convert(source, path, overwrite=True)  # lazy sources: read into ckpt's own buffers, never lent
    assert all(isinstance(p, bytes) for p in _Lending.lent)
    assert pathlib.Path(path).read_bytes() == pathlib.Path(plain).read_bytes()


class _InMemory(ckpt.storage.WritableBlob):
    """A third-party blob: the protocol's methods over a bytearray, no lend_pieces of its own."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.calls: list[str] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def size(self) -> int:
        return len(self.data)

    def write_at(self, data, offset):
        self.calls.append("write_at")
        data = bytes(memoryview(data).cast("B"))
        self.data[len(self.data):offset] = bytes(max(0, offset - len(self.data)))
        self.data[offset:offset + len(data)] = data

    def write_pieces(self, pieces, offset):
        self.calls.append("write_pieces")
        for piece in pieces:
            self.write_at(piece, offset)
            offset += len(memoryview(piece).cast("B"))

    def close(self):
        pass


@pytest.mark.parametrize("ext", [".h5", ".msgpack", ".safetensors"])
def test_a_blob_inherits_lend_pieces_from_the_protocol_and_writes_what_is_lent(tmp_path, ext):
    # lend_pieces is declared on WritableBlob with a default (write_pieces): writers call it, never probe for it
    blob = _InMemory()
    blob.lend_pieces([b"ab", memoryview(b"cd")], 2)
    assert bytes(blob.data) == b"\0\0abcd" and blob.calls[0] == "write_pieces"
    rng = np.random.default_rng(3)
    tensors = [(f"t/{i}", rng.standard_normal(17).astype(np.float32)) for i in range(20)]
    tensors.append(("big", rng.standard_normal(_io.BIG // 4 + 3).astype(np.float32)))
    fmt = base.format_for_path("x" + ext)
    blob = _InMemory()
    fmt.write_blob(blob, tensors, {})
    fmt.write(str(tmp_path / f"m{ext}"), tensors, {})
    assert bytes(blob.data) == (tmp_path / f"m{ext}").read_bytes()


FIFO_CHILD = """
import json, os, sys
from click.testing import CliRunner
import ckpt
from ckpt.cli import main

path = sys.argv[1]
out = {}
try:
    ckpt.load_checkpoint(path)
except ckpt.CheckpointError as exc:
    out["load_checkpoint"] = [type(exc).__name__, str(exc)]
try:
    ckpt.load_checkpoint(os.path.dirname(path))  # the directory's state file names the FIFO
except ckpt.CheckpointError as exc:
    out["load_directory"] = [type(exc).__name__, str(exc)]
for args in (["inspect", path], ["verify", path], ["convert", path, path + ".msgpack"]):
    result = CliRunner().invoke(main, args, prog_name="ckpt", catch_exceptions=False)
    out[args[0]] = [result.exit_code, result.output]
print(json.dumps(out))
"""


def test_a_fifo_named_like_a_checkpoint_is_refused_without_blocking(tmp_path):
    """open() of a FIFO waits for a writer for ever: a child process, so a hang fails on its timeout."""
    run = tmp_path / "run"
    run.mkdir()
    fifo = run / "m-1.h5"
    os.mkfifo(fifo)
    ckpt.storage.state.write_state(str(run), ckpt.storage.state.CheckpointState([ckpt.storage.state.CheckpointEntry("m-1.h5", 1.0, 1)]))
    child = subprocess.run([sys.executable, "-c", FIFO_CHILD, str(fifo)], capture_output=True, text=True,
                           timeout=30, check=True)
    out = json.loads(child.stdout)
    kind, message = out["load_checkpoint"]
    assert kind == "UnsupportedCheckpointError" and message.startswith(f"{fifo}: a FIFO (named pipe), "), out
    kind, message = out["load_directory"]
    assert kind == "CheckpointNotFoundError" and f"names {fifo}, which is not a checkpoint file" in message, out
    for command in ("inspect", "verify", "convert"):
        code, output = out[command]
        assert code == 1 and f"Error: {fifo}: a FIFO (named pipe), not a checkpoint file" in output, out


def test_a_socket_or_device_is_refused(tmp_path):
    sock = socket.socket(socket.AF_UNIX)
    path = tmp_path / "m.msgpack"
    with sock:
        sock.bind(str(path))
        with pytest.raises(ckpt.UnsupportedCheckpointError, match=f"^{path}: a socket, not a checkpoint file"):
            ckpt.load_checkpoint(path)
    with pytest.raises(ckpt.UnsupportedCheckpointError, match="^/dev/null: a character device, not a checkpoint"):
        ckpt.load_checkpoint("/dev/null")


FIFO_STATE_CHILD = r"""
import sys
import ckpt
from click.testing import CliRunner
from ckpt.cli import main

try:
    ckpt.latest_checkpoint(sys.argv[1])
except ckpt.CheckpointError as exc:
    print(type(exc).__name__, exc)
result = CliRunner().invoke(main, ["ls", sys.argv[1]], prog_name="ckpt", catch_exceptions=False)
print(result.exit_code, result.output.strip())
"""


def test_a_fifo_named_like_the_state_file_is_refused_without_blocking(tmp_path):
    """The directory's state file is read by every latest_checkpoint and `ckpt ls`: a FIFO there
    must be refused, not waited on (a child process, so a hang fails on its timeout)."""
    os.mkfifo(tmp_path / "checkpoint")
    child = subprocess.run([sys.executable, "-c", FIFO_STATE_CHILD, str(tmp_path)], capture_output=True, text=True,
                           timeout=30, check=True)
    first, second = child.stdout.splitlines()
    assert first.startswith(f"UnsupportedCheckpointError {tmp_path / 'checkpoint'}: a FIFO (named pipe)"), first
    assert second.startswith(f"1 Error: {tmp_path / 'checkpoint'}: a FIFO (named pipe)"), second


GAP_FAR = 5000  # past the gap a run of one preadv reads through


def _layout(rng, sizes, gaps):
    """Buffers of ``sizes`` bytes at offsets ``gaps`` apart (the first after gaps[0]) in a file's data."""
    offsets, pos = [], 0
    for size, gap in zip(sizes, gaps):
        offsets.append(pos + gap)
        pos += gap + size
    return offsets, rng.bytes(pos + 100)


@pytest.mark.parametrize("with_big", [False, True])  # True: one big buffer sends them all through read_spans
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint8"])
def test_read_buffers_fills_arrays_near_and_far_in_any_order(tmp_path, dtype, with_big):
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)

    rng = np.random.default_rng(7)
    count = 700  # more than one preadv's worth of iovecs
    itemsize = np.dtype(dtype).itemsize
    elements = [int(n) for n in rng.integers(1, 40, count)]
    if with_big:
        elements[10] = BIG // itemsize + 5  # read in pieces by the workers
    gaps = [int(g) for g in rng.choice([0, 2, 3, 100, GAP_FAR], count)]
    offsets, data = _layout(rng, [n * itemsize for n in elements], gaps)
    path = tmp_path / "data"
    path.write_bytes(data)
    order = rng.permutation(count).tolist()
    buffers = [np.empty(elements[i], dtype) for i in order]
    with LocalFile(str(path), piece=PIECE, big=BIG) as source:
        crcs = source.read_buffers([offsets[i] for i in order], buffers, lambda i: f"buffer {i}", _io.byte_view)
    for buffer, i, crc in zip(buffers, order, crcs):
        expected = data[offsets[i]:offsets[i] + elements[i] * itemsize]
        assert buffer.tobytes() == expected and crc == crc32c.crc32c(expected)


def test_read_buffers_of_a_truncated_file_names_the_buffer_cut(tmp_path):
    path = tmp_path / "data"
    path.write_bytes(bytes(range(256)) * 4)  # 1024 bytes
    buffers = [np.empty(100, np.uint8) for _ in range(12)]
    offsets = [i * 102 for i in range(12)]  # 2-byte gaps; the 11th buffer (1020 + 100) runs past the end
    with LocalFile(str(path)) as source, pytest.raises(
            ckpt.CorruptCheckpointError, match=r"data: file ends in the middle of buffer 10 \(offset 1024\): it is truncated"):
        source.read_buffers(offsets, buffers, lambda i: f"buffer {i}", _io.byte_view)


def test_a_local_folder_reads_a_large_batch_side_by_side_each_answer_in_place(tmp_path):
    from ckpt.storage.localfile import LocalFolder
    from ckpt.storage.workers import BIG as BATCH, side_by_side

    rng = np.random.default_rng(7)
    size = BATCH // 4  # five files: together over the side-by-side threshold
    files = {f"c{i}": rng.integers(0, 256, size, np.uint8).tobytes() for i in range(5)}
    files["short"] = b"xyz"
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    folder = LocalFolder(str(tmp_path))
    names = ["c0", "c1", "missing", "short", "c2", "c3", "c4"]
    bufs = [bytearray(size) for _ in names]
    want = [None, None, "is missing", b"xyz", None, None, None]

    def batch() -> list:
        return folder.read_objects([(n, memoryview(b)) for n, b in zip(names, bufs)])

    assert batch() == want
    assert all(bytes(b) == files[n] for n, b in zip(names, bufs) if n.startswith("c"))
    assert folder.read_whole(["short", "missing", "c1"], len(files["c1"])) == [b"xyz", "is missing", files["c1"]]
    assert folder.read_whole(["c1"], len(files["c1"]) - 1) == [f"holds more than {len(files['c1']) - 1} bytes"]
    # a batch read from one of the pool's own threads runs on that thread (no pool waits on itself)
    got, inner, outer = side_by_side(lambda: (batch(), side_by_side(threading.get_ident, [()] * 3),
                                              threading.get_ident()), [()])[0]
    assert got == want and inner == [outer] * 3


def test_a_local_folder_checked_read_gives_each_filled_chunk_s_crc32c(tmp_path):
    from ckpt.checksums import crc32c
    from ckpt.storage.localfile import LocalFolder
    from ckpt.storage.workers import BIG, WAITERS

    rng = np.random.default_rng(8)
    size = BIG // 8  # 2 * WAITERS + 3 files: runs of several files, over the side-by-side threshold
    names = [f"c{i}" for i in range(2 * WAITERS + 3)]
    files = {n: rng.integers(0, 256, size, np.uint8).tobytes() for n in names}
    files["short"], files["long"] = b"xyz", bytes(size + 1)
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    order = [*names[:5], "missing", "short", *names[5:9], "long", *names[9:]]
    bufs = [bytearray(size) for _ in order]
    folder = LocalFolder(str(tmp_path))
    got = folder.read_checked([(n, memoryview(b)) for n, b in zip(order, bufs)])
    want = {"missing": "is missing", "short": b"xyz", "long": f"holds more than {size} bytes"}
    assert [answer for answer, _ in got] == [want.get(n) for n in order]
    for n, b, (answer, crc) in zip(order, bufs, got):
        if answer is None:
            assert bytes(b) == files[n] and crc == crc32c(files[n])
        else:
            assert crc == 0
    one = bytearray(size)  # a single file: read in this thread, the same answer
    assert folder.read_checked([("c3", memoryview(one))]) == [(None, crc32c(files["c3"]))]


def test_side_by_side_helping_runs_every_job_once_and_raises_the_first_error_in_order():
    from ckpt.storage.workers import side_by_side

    ran: list[int] = []

    def job(i: int) -> int:
        ran.append(i)
        if i in (7, 3):
            raise ValueError(f"job {i}")
        return i * i

    assert side_by_side(job, [(i,) for i in range(20) if i not in (3, 7)], helping=True) == \
        [i * i for i in range(20) if i not in (3, 7)]
    ran.clear()
    with pytest.raises(ValueError, match="job 3"):
        side_by_side(job, [(i,) for i in range(40)], helping=True)
    assert sorted(ran) == list(range(40))  # every job ran, once, before the error came back


def test_a_local_folder_checked_read_of_many_small_files_holds_few_open(tmp_path):
    from ckpt.checksums import crc32c
    from ckpt.storage import localfile
    from ckpt.storage.workers import BIG, WAITERS

    size = 8192
    count = max(BIG // size + 1, 3 * WAITERS * localfile._HINTED)  # runs longer than the files hinted at once
    rng = np.random.default_rng(9)
    files = {f"f{i:04d}": rng.integers(0, 256, size, np.uint8).tobytes() for i in range(count)}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    bufs = {name: bytearray(size) for name in files}
    got = localfile.LocalFolder(str(tmp_path)).read_checked([(n, memoryview(b)) for n, b in bufs.items()])
    assert got == [(None, crc32c(data)) for data in files.values()]
    assert all(bytes(bufs[n]) == data for n, data in files.items())
