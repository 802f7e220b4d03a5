"""Case ``average``: ``ckpt.average_checkpoints`` of 3 checkpoints against a sequential raw read of them.

The inputs are 3 checkpoints of 8 float32 tensors (msgpack, h5, msgpack: two formats' streams
aligned); each round times a raw read of the three files, the average (written to a fourth file,
removed untimed), and the raw read again, interleaved. The ratio is the raw read's time (the mean
of the reads around each average) over the average's: 1.0 would cost no more than reading.

The same rounds time the floors of what an average must do besides reading, each alone and on
one core: writing the output (a new file of its size, fsynced), the crc32c of every input and of the
output, and the float64 arithmetic (numpy's passes per block, as ckpt.tools.averaging runs them).
Half their sum (with the read) is the best an average doing this work could reach on two free cores.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

import ckpt
from ckpt import checksums

from .round2 import _raw_read
from .run import fmt_row, make_model

MiB = 1 << 20


def average_case(label: str, directory: str, mib_each: int, reps: int) -> str:
    """The markdown table of the case, for checkpoints of ``mib_each`` MiB on ``directory``."""
    paths = []
    for i, ext in enumerate(("msgpack", "h5", "msgpack")):
        _model, variables = make_model(8, mib_each * MiB // 8, seed=10 + i)
        paths.append(ckpt.Saver(variables, max_to_keep=None).save(os.path.join(directory, f"avg-in{i}.{ext}")))
        del _model, variables
    out = os.path.join(directory, "avg-out.msgpack")
    total = 3 * mib_each * MiB
    floors: dict[str, list[float]] = {"write": [], "crc32c": [], "arithmetic": []}
    raw, avg = [], []
    try:
        _raw_read(*paths)  # warm the page cache (tmpfs: already there)
        for _ in range(reps):
            start = time.perf_counter()
            _raw_read(*paths)
            before = time.perf_counter() - start
            start = time.perf_counter()
            ckpt.average_checkpoints(paths, out)
            avg.append(time.perf_counter() - start)
            os.remove(out)
            start = time.perf_counter()
            _raw_read(*paths)
            raw.append((before + time.perf_counter() - start) / 2)
            for name, floor in (("write", _write_floor), ("crc32c", _crc_floor), ("arithmetic", _sum_floor)):
                floors[name].append(floor(out, total // 3))
    finally:
        for path in (*paths, out):
            if os.path.exists(path):
                os.remove(path)
    ratios = [r / a for r, a in zip(raw, avg)]
    read = statistics.median(raw)
    rows = [(f"writing the output alone (a new file of {mib_each} MiB, fsynced)", floors["write"]),
            ("crc32c of the inputs and the output alone", floors["crc32c"]),
            ("float64 arithmetic alone (numpy, one core)", floors["arithmetic"])]
    bound = (read + sum(statistics.median(times) for _, times in rows)) / 2
    return "\n".join([
        f"**average {label}: `ckpt.average_checkpoints` of 3 checkpoints of {mib_each} MiB (8 float32 tensors), "
        f"median of {reps}**\n",
        fmt_row(["what", "s", "GiB/s of input", "raw read / this"]),
        fmt_row(["---"] * 4),
        fmt_row(["raw read of the inputs", f"{read:.3f}", f"{total / read / (1 << 30):.2f}", ""]),
        *[fmt_row([name, f"{statistics.median(times):.3f}", "", f"{read / statistics.median(times):.2f}x"])
          for name, times in rows],
        fmt_row(["bound on 2 cores: (read + the floors) / 2", f"{bound:.3f}", "", f"{read / bound:.2f}x"]),
        fmt_row(["average_checkpoints", f"{statistics.median(avg):.3f}",
                 f"{total / statistics.median(avg) / (1 << 30):.2f}", f"{statistics.median(ratios):.2f}x"]),
    ])


_CHUNK = 8 << 20  # the bytes of one input chunk (ckpt.tools.chunks.CHUNK_BYTES)


def _write_floor(path: str, nbytes: int) -> float:
    """Seconds to write ``nbytes`` to a new file at ``path`` (removed untimed) from one reused buffer
    and fsync it, as the average's atomic commit does (on tmpfs the fsync costs nothing)."""
    buffer = memoryview(bytearray(_CHUNK))
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for pos in range(0, nbytes, _CHUNK):
            f.write(buffer[:min(_CHUNK, nbytes - pos)])
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    os.remove(path)
    return seconds


def _crc_floor(_path: str, nbytes: int) -> float:
    """Seconds of the crc32c of 3 inputs and an output of ``nbytes`` each, by 8 MiB chunks."""
    buffer = memoryview(bytearray(_CHUNK))
    start = time.perf_counter()
    for pos in range(0, 4 * nbytes, _CHUNK):
        checksums.crc32c(buffer[:min(_CHUNK, 4 * nbytes - pos)])
    return time.perf_counter() - start


def _sum_floor(_path: str, nbytes: int) -> float:
    """Seconds of the mean of 3 float32 inputs of ``nbytes`` each by the passes the average runs
    per 64 Ki-element block: widen, scale, add in float64, round once (inputs in memory, 8 MiB chunks)."""
    rng = np.random.default_rng(0)
    n = _CHUNK // 4
    chunks = [rng.standard_normal(n, dtype=np.float32) for _ in range(3)]
    shares = (0.2, 0.3, 0.5)
    block = 64 << 10
    acc, tmp, out = np.empty(block), np.empty(block), np.empty(n, np.float32)
    start = time.perf_counter()
    for _ in range(nbytes // _CHUNK):
        for lo in range(0, n, block):
            hi = lo + block
            np.copyto(acc, chunks[0][lo:hi], casting="unsafe")
            np.multiply(acc, shares[0], out=acc)
            for chunk, share in zip(chunks[1:], shares[1:]):
                np.copyto(tmp, chunk[lo:hi], casting="unsafe")
                np.multiply(tmp, share, out=tmp)
                np.add(acc, tmp, out=acc)
            np.copyto(out[lo:hi], acc, casting="unsafe")
    return time.perf_counter() - start
