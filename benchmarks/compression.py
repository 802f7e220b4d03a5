"""Case ``compress`` of ``python -m benchmarks``: msgpack's compression="zstd" (issue 28).

For float32 and bfloat16 weights drawn from N(0, 0.02), and for the Adam moments (m and v) of a
short real training run of a numpy MLP: the size ratio (plain bytes / compressed file), the CPU
seconds per GiB of the compression itself (byte planes + zstd, every chunk, one thread), the
restore's decompression speed (GB/s of tensor bytes read into existing arrays, as
``Saver.restore`` does, wall time), and a compressed save_file and restore against plain ones in the
same directory (ratio of wall times; bit-exact checked). Figures are medians of ``reps``.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from typing import Any

import ml_dtypes
import numpy as np

import ckpt
from ckpt.formats import _blocks
from ckpt.formats._planes import encode_chunk


def adam_moments(seed: int = 0, steps: int = 30) -> dict[str, np.ndarray]:
    """Adam's m and v after ``steps`` steps of a 1024-2048-1024 ReLU MLP regressing random targets."""
    rng = np.random.default_rng(seed)
    sizes = [1024, 2048, 1024]
    params = [(rng.standard_normal((a, b)) * np.sqrt(2 / a)).astype(np.float32) for a, b in itertools.pairwise(sizes)]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    x = rng.standard_normal((256, sizes[0])).astype(np.float32)
    y = rng.standard_normal((256, sizes[-1])).astype(np.float32)
    for t in range(1, steps + 1):
        h = np.maximum(x @ params[0], 0)
        err = (h @ params[1] - y) / len(x)
        grads = [x.T @ ((err @ params[1].T) * (h > 0)), h.T @ err]
        for i, g in enumerate(grads):
            m[i] = 0.9 * m[i] + 0.1 * g
            v[i] = 0.999 * v[i] + 0.001 * g * g
            params[i] -= 1e-3 * (m[i] / (1 - 0.9 ** t)) / (np.sqrt(v[i] / (1 - 0.999 ** t)) + 1e-8)
    return {f"m/{i}": a for i, a in enumerate(m)} | {f"v/{i}": a for i, a in enumerate(v)}


def _compress_cpu(arrays: dict[str, np.ndarray]) -> float:
    """CPU seconds of encoding every chunk of ``arrays`` (one thread)."""
    start = time.process_time()
    for arr in arrays.values():
        view = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
        for pos in range(0, len(view), _blocks.BLOCK_BYTES):
            encode_chunk(view[pos:pos + _blocks.BLOCK_BYTES], arr.dtype.itemsize)
    return time.process_time() - start


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(name: str, arrays: dict[str, np.ndarray], directory: str, reps: int) -> dict[str, float]:
    """The figures of one set of tensors."""
    nbytes = sum(a.nbytes for a in arrays.values())
    plain, packed = os.path.join(directory, "plain.msgpack"), os.path.join(directory, "packed.msgpack")
    save_plain = [_timed(lambda: ckpt.save_file(arrays, plain)) for _ in range(reps)]
    save_packed = [_timed(lambda: ckpt.save_file(arrays, packed, compression="zstd")) for _ in range(reps)]
    outs = {k: np.empty_like(a) for k, a in arrays.items()}  # restored into, as Saver.restore does

    def restore(path: str) -> None:
        with ckpt.load_checkpoint(path) as reader:
            for key, out in outs.items():
                reader._reader.read_into(key, out)

    restore(packed)  # (the buffers' pages faulted in once, outside the timings)
    load_plain = [_timed(lambda: restore(plain)) for _ in range(reps)]
    load_packed = [_timed(lambda: restore(packed)) for _ in range(reps)]
    loaded = ckpt.load_file(packed)
    assert all(loaded[k].tobytes() == a.tobytes() for k, a in arrays.items()), f"{name}: not bit-exact"
    cpu = statistics.median(_compress_cpu(arrays) for _ in range(reps))
    out = {"GiB": nbytes / 2 ** 30, "ratio": os.path.getsize(plain) / os.path.getsize(packed),
           "compress CPU s/GiB": cpu / (nbytes / 2 ** 30),
           "decompress GB/s (restore)": nbytes / statistics.median(load_packed) / 1e9,
           "save compressed / plain (wall)": statistics.median(save_packed) / statistics.median(save_plain),
           "restore compressed / plain (wall)": statistics.median(load_packed) / statistics.median(load_plain)}
    for path in (plain, packed):
        os.unlink(path)
    return out


def run(directory: str, reps: int, mib: int = 256) -> str:
    """The case's table, for ``mib`` MiB of each weight dtype (plus the Adam moments)."""
    n32 = mib * 2 ** 20 // 4
    sets = {"float32 N(0, 0.02)": {"w": (np.random.default_rng(0).standard_normal(n32) * 0.02).astype(np.float32)},
            "bfloat16 N(0, 0.02)": {"w": (np.random.default_rng(1).standard_normal(2 * n32) * 0.02)
                                    .astype(ml_dtypes.bfloat16)},
            "Adam m, v (float32)": adam_moments()}
    rows = [f"case compress ({directory}, median of {reps}):"]
    for name, arrays in sets.items():
        figures = measure(name, arrays, directory, reps)
        rows.append(f"  {name:22s} " + "  ".join(f"{k} {v:.2f}" for k, v in figures.items()))
    return "\n".join(rows)
