"""Case ``compress`` of ``python -m benchmarks``: msgpack's compression="zstd" (issue 28).

For float32 and bfloat16 weights drawn from N(0, 0.02), and for the Adam moments (m and v) of a
short real training run of a numpy MLP: the size ratio (plain bytes / compressed file), the CPU
seconds per GiB of the compression itself (byte planes + zstd, every chunk, one thread), the
restore's decompression speed (GB/s of tensor bytes read into existing arrays, as
``Saver.restore`` does, wall time) and its CPU seconds per GiB (all threads), each against the
issue's target; then a compressed save_file and restore against plain ones in the same directory
(seconds, median; bit-exact checked). ``save_file`` fsyncs, so on a disk directory the save
waits for the device: compression pays there when the device, not the CPU, is the limit, and
never on tmpfs. Figures are medians of ``reps``; plain and compressed runs alternate.
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
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


#: The issue's targets: (figure, at least / at most, bound); ratios per set (none for Adam).
TARGETS = {"compress CPU s/GiB": ("<=", 1.0), "decompress GB/s": (">=", 1.5)}
RATIO_TARGETS = {"float32 N(0, 0.02)": 1.1, "bfloat16 N(0, 0.02)": 1.25}


def measure(name: str, arrays: dict[str, np.ndarray], directory: str, reps: int) -> dict[str, float]:
    """The figures of one set of tensors."""
    nbytes = sum(a.nbytes for a in arrays.values())
    gib = nbytes / 2 ** 30
    plain, packed = os.path.join(directory, "plain.msgpack"), os.path.join(directory, "packed.msgpack")
    outs = {k: np.empty_like(a) for k, a in arrays.items()}  # restored into, as Saver.restore does

    def restore(path: str) -> None:
        with ckpt.load_checkpoint(path) as reader:
            for key, out in outs.items():
                reader._reader.read_into(key, out)

    save_plain, save_packed, load_plain, load_packed, load_cpu = [], [], [], [], []
    for _ in range(reps):  # alternating, so a change in the machine's load hits both alike
        save_plain.append(_timed(lambda: ckpt.save_file(arrays, plain)))
        save_packed.append(_timed(lambda: ckpt.save_file(arrays, packed, compression="zstd")))
    restore(packed)  # (the buffers' pages faulted in once, outside the timings)
    for _ in range(reps):
        load_plain.append(_timed(lambda: restore(plain)))
        cpu = time.process_time()
        load_packed.append(_timed(lambda: restore(packed)))
        load_cpu.append(time.process_time() - cpu)
    loaded = ckpt.load_file(packed)
    assert all(loaded[k].tobytes() == a.tobytes() for k, a in arrays.items()), f"{name}: not bit-exact"
    out = {"GiB": gib, "ratio": os.path.getsize(plain) / os.path.getsize(packed),
           "compress CPU s/GiB": statistics.median(_compress_cpu(arrays) for _ in range(reps)) / gib,
           "decompress GB/s": nbytes / statistics.median(load_packed) / 1e9,
           "decompress CPU s/GiB": statistics.median(load_cpu) / gib,
           "save plain s": statistics.median(save_plain), "save zstd s": statistics.median(save_packed),
           "restore plain s": statistics.median(load_plain), "restore zstd s": statistics.median(load_packed)}
    for path in (plain, packed):
        os.unlink(path)
    return out


def _verdicts(name: str, figures: dict[str, float]) -> str:
    """Which targets the figures meet (ok) or miss (MISSED)."""
    bounds = dict(TARGETS)
    if name in RATIO_TARGETS:
        bounds["ratio"] = (">=", RATIO_TARGETS[name])
    marks = [f"{k} {op} {bound}: {'ok' if (figures[k] >= bound if op == '>=' else figures[k] <= bound) else 'MISSED'}"
             for k, (op, bound) in bounds.items()]
    return "; ".join(marks)


def run(directory: str, reps: int, mib: int = 256) -> str:
    """The case's table, for ``mib`` MiB of each weight dtype (plus the Adam moments)."""
    n32 = mib * 2 ** 20 // 4
    sets = {"float32 N(0, 0.02)": {"w": (np.random.default_rng(0).standard_normal(n32) * 0.02).astype(np.float32)},
            "bfloat16 N(0, 0.02)": {"w": (np.random.default_rng(1).standard_normal(2 * n32) * 0.02)
                                    .astype(ml_dtypes.bfloat16)},
            "Adam m, v (float32)": adam_moments()}
    load = os.getloadavg()[0]
    rows = [f"case compress ({directory}, median of {reps}, load average {load:.1f} on {os.cpu_count()} cores):"]
    for name, arrays in sets.items():
        figures = measure(name, arrays, directory, reps)
        rows.append(f"  {name:22s} " + "  ".join(f"{k} {v:.3f}" if k.endswith(" s") else f"{k} {v:.2f}"
                                                 for k, v in figures.items()))
        pays = figures["save zstd s"] / figures["save plain s"]
        here = figures["GiB"] / figures["save plain s"]
        # the bytes saved cost this much CPU: a save whose device writes slower than this gets faster
        breakeven = (1 - 1 / figures["ratio"]) / figures["compress CPU s/GiB"]
        rows.append(f"  {'':22s} targets: {_verdicts(name, figures)}; save zstd / plain {pays:.2f}x "
                    f"({'pays' if pays < 1 else 'does not pay'} here: a plain save writes {here:.2f} GiB/s; "
                    f"compressing pays below about {breakeven:.2f} GiB/s)")
    return "\n".join(rows)


def object_store(reps: int, mib: int = 64) -> str:
    """A Saver's save and restore of ``mib`` MiB of bfloat16 and of float32 weights through moto's
    S3 server (127.0.0.1; the test extra), compressed against plain, alternating. moto runs on the
    same cores, so fewer bytes also cost it less CPU: a stand-in for a bandwidth-bound store."""
    import boto3

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from s3server import S3Server

    server = S3Server()
    server.start()
    n = mib * 2 ** 20 // 2
    sets = {"bfloat16": (np.random.default_rng(1).standard_normal(n) * 0.02).astype(ml_dtypes.bfloat16),
            "float32": (np.random.default_rng(0).standard_normal(n // 2) * 0.02).astype(np.float32)}
    rows = [f"case compress (moto S3 on 127.0.0.1, {mib} MiB, median of {reps}, load average "
            f"{os.getloadavg()[0]:.1f}):"]
    try:
        boto3.client("s3").create_bucket(Bucket="bench")
        for name, value in sets.items():
            variables = {"w": ckpt.Variable(value)}
            times: dict[str, list[tuple[float, float]]] = {"plain": [], "zstd": []}
            for rep in range(reps):
                for kind in times:
                    saver = ckpt.Saver(variables, max_to_keep=1, format="msgpack",
                                       compression=None if kind == "plain" else "zstd")
                    url = f"s3://bench/{name}-{kind}"
                    save = _timed(lambda: saver.save(f"{url}/model", global_step=rep + 1))
                    times[kind].append((save, _timed(lambda: saver.restore(url))))
            plain, packed = ([statistics.median(t[i] for t in times[k]) for i in (0, 1)] for k in ("plain", "zstd"))
            rows.append(f"  {name:9s} save plain {plain[0]:.3f} s, zstd {packed[0]:.3f} s "
                        f"({packed[0] / plain[0]:.2f}x); restore plain {plain[1]:.3f} s, zstd {packed[1]:.3f} s "
                        f"({packed[1] / plain[1]:.2f}x)")
    finally:
        server.stop()
    return "\n".join(rows)

