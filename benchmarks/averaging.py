"""Case ``average``: ``ckpt.average_checkpoints`` of 3 checkpoints against a sequential raw read of them.

The inputs are 3 checkpoints of 8 float32 tensors (msgpack, h5, msgpack: two formats' streams
aligned); each round times a raw read of the three files, the average (written to a fourth file,
removed untimed), and the raw read again, interleaved. The ratio is the raw read's time (the mean
of the reads around each average) over the average's: 1.0 would cost no more than reading.
"""

from __future__ import annotations

import os
import statistics
import time

import ckpt

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
    finally:
        for path in (*paths, out):
            if os.path.exists(path):
                os.remove(path)
    ratios = [r / a for r, a in zip(raw, avg)]
    total = 3 * mib_each * MiB
    return "\n".join([
        f"**average {label}: `ckpt.average_checkpoints` of 3 checkpoints of {mib_each} MiB (8 float32 tensors), "
        f"median of {reps}**\n",
        fmt_row(["what", "s", "GiB/s of input", "raw read / average"]),
        fmt_row(["---"] * 4),
        fmt_row(["raw read of the inputs", f"{statistics.median(raw):.3f}",
                 f"{total / statistics.median(raw) / (1 << 30):.2f}", ""]),
        fmt_row(["average_checkpoints", f"{statistics.median(avg):.3f}",
                 f"{total / statistics.median(avg) / (1 << 30):.2f}", f"{statistics.median(ratios):.2f}x"]),
    ])
