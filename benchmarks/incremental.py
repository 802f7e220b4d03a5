"""Case ``incremental-chunks`` of ``python -m benchmarks``: ``Saver(incremental=True)`` by chunk size (issue 28).

Two models, each saved ``reps + 1`` times per chunk size (the first save fills the chunk store and
is not counted):

- **frozen backbone**: 12 float32 tensors of 16 MiB that never change (192 MiB) and one 16 MiB
  head that changes entirely before every save;
- **sparse rows**: one float32 embedding table of 2**20 rows x 64 (256 MiB) of which 1% of the
  rows (random, seeded) change before every save.

For each chunk size: the bytes a save writes (new chunks + the index file) as a fraction of a
plain msgpack save's file, the save's wall time against a plain msgpack save of the same values
(interleaved, median of ``reps``), and the chunk store's file count after the last save
(``max_to_keep=2``: what a directory holds in steady state). For the sparse model also an estimate
of XOR delta encoding: the zstd size (level 1) of each new chunk XOR its previous version, as a
fraction of the table (what writing deltas instead of whole chunks would write; ckpt does not do
this).
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import zstandard

import ckpt

from .run import fmt_row

KiB, MiB = 1 << 10, 1 << 20
CHUNK_SIZES = (16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB)
ROWS, DIM, ROW_SHARE = 1 << 20, 64, 0.01


@dataclass
class Model:
    """Variables and the change made to them before every save."""

    name: str
    variables: dict[str, ckpt.Variable]
    change: Callable[[np.random.Generator], None]
    sparse: bool = False  # rows of one table change: estimate XOR deltas too


def _variable(key: str, shape: tuple[int, ...], rng: np.random.Generator) -> ckpt.Variable:
    var = ckpt.Variable(ckpt.initializers.Zeros(), shape=shape, name=key)
    rng.standard_normal(out=var._value, dtype=np.float32)  # fill in place: no second copy
    return var


def frozen_backbone(seed: int = 0) -> Model:
    """192 MiB that never changes and a 16 MiB head rewritten before every save."""
    rng = np.random.default_rng(seed)
    n = 16 * MiB // 4
    variables = {f"backbone/{i:02d}/w": _variable(f"backbone/{i:02d}/w", (n,), rng) for i in range(12)}
    head = variables["head/w"] = _variable("head/w", (n,), rng)
    return Model("frozen backbone 192 MiB + head 16 MiB", variables,
                 lambda r: r.standard_normal(out=head._writable_buffer(), dtype=np.float32))  # a counted write


def sparse_rows(seed: int = 0) -> Model:
    """A 256 MiB table whose rows change 1% at a time (random rows)."""
    rng = np.random.default_rng(seed)
    table = _variable("embedding/table", (ROWS, DIM), rng)

    def change(r: np.random.Generator) -> None:
        rows = r.choice(ROWS, size=int(ROWS * ROW_SHARE), replace=False)
        table._writable_buffer()[rows] += r.standard_normal((len(rows), DIM), dtype=np.float32) * 0.01  # counted

    return Model("embedding 2^20 x 64, 1% rows", {"embedding/table": table}, change, sparse=True)


@dataclass
class Figures:
    written: list[float] = field(default_factory=list)  # share of a plain save's file
    xor: list[float] = field(default_factory=list)  # share of the table, XOR + zstd estimate
    incremental: list[float] = field(default_factory=list)
    plain: list[float] = field(default_factory=list)
    files: int = 0


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _xor_share(before: np.ndarray, after: np.ndarray, chunk_bytes: int) -> float:
    """zstd bytes of every changed chunk's XOR with its previous version, over the tensor's bytes."""
    old, new = before.reshape(-1).view(np.uint8), after.reshape(-1).view(np.uint8)
    cctx = zstandard.ZstdCompressor(level=1)
    total = 0
    for pos in range(0, len(new), chunk_bytes):
        a, b = old[pos:pos + chunk_bytes], new[pos:pos + chunk_bytes]
        if not np.array_equal(a, b):
            total += len(cctx.compress(np.bitwise_xor(a, b).tobytes()))
    return total / len(new)


def measure(model: Model, chunk_bytes: int, directory: str, reps: int) -> Figures:
    """One model at one chunk size; ``directory`` is emptied afterwards."""
    rng = np.random.default_rng(1)
    inc_dir, plain = os.path.join(directory, "inc"), os.path.join(directory, "plain.msgpack")
    os.makedirs(inc_dir)
    saver = ckpt.Saver(model.variables, max_to_keep=2, incremental=True, chunk_bytes=chunk_bytes)
    plain_saver = ckpt.Saver(model.variables, max_to_keep=None, format="msgpack")
    out = Figures()
    try:
        saver.save(os.path.join(inc_dir, "model.msgpack"), global_step=0)  # fills the chunk store
        for step in range(1, reps + 1):
            before = [v._value.copy() for v in model.variables.values()] if model.sparse else []
            model.change(rng)
            saved: list[str] = []
            out.incremental.append(_timed(lambda: saved.append(saver.save(os.path.join(inc_dir, "model.msgpack"),
                                                                          global_step=step))))
            out.plain.append(_timed(lambda: plain_saver.save(plain)))
            stats = saver.last_incremental
            assert stats is not None
            out.written.append((stats.bytes_written + os.path.getsize(saved[0])) / os.path.getsize(plain))
            if model.sparse:
                out.xor.append(sum(_xor_share(b, v._value, chunk_bytes)
                                   for b, v in zip(before, model.variables.values())))
            os.remove(plain)
        out.files = len(os.listdir(os.path.join(inc_dir, ".ckpt-chunks")))
    finally:
        shutil.rmtree(inc_dir, ignore_errors=True)
        if os.path.exists(plain):
            os.remove(plain)
    return out


def incremental_case(label: str, directory: str, reps: int) -> str:
    """The markdown table of the case on ``directory``."""
    rows = [f"**incremental {label}: bytes written per save (new chunks + index) / a plain msgpack save's file, "
            f"save time / a plain msgpack save's (interleaved), chunk files kept (max_to_keep=2), median of "
            f"{reps} saves after the first**\n",
            fmt_row(["model", "chunk", "written / full", "XOR+zstd / full (estimate)", "save s",
                     "plain save s", "incremental / plain", "chunk files"]),
            fmt_row(["---"] * 8)]
    for make in (frozen_backbone, sparse_rows):
        model = make()
        for chunk_bytes in CHUNK_SIZES:
            f = measure(model, chunk_bytes, directory, reps)
            inc, plain = statistics.median(f.incremental), statistics.median(f.plain)
            rows.append(fmt_row([model.name, f"{chunk_bytes // KiB} KiB", f"{statistics.median(f.written):.1%}",
                                 f"{statistics.median(f.xor):.1%}" if f.xor else "—", f"{inc:.3f}",
                                 f"{plain:.3f}", f"{inc / plain:.2f}x", f"{f.files:,}"]))
        del model
    return "\n".join(rows)
