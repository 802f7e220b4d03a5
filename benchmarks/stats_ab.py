"""``ckpt.tensor_stats`` before and after a change, in one run: ``python -m benchmarks.stats_ab``.

The "before" is ``ckpt/tools/stats.py`` as it was at a git revision (``--before``, default HEAD: the
committed code against the working tree's), loaded from ``git show`` as a sibling module of today's
``ckpt`` (it uses the same helpers: ``ckpt.tools.chunks``, ``ckpt.tools.sources``). Rounds alternate
raw read, before, raw read, after on one checkpoint of 8 float32 tensors on tmpfs; each ratio is the
raw read's time (the mean of the two reads around it) over the call's. CPU seconds (all threads) are
printed too: on a shared machine they move far less than wall times.

Revisions whose histogram was defined otherwise (``np.histogram(values, 16, range=(min, max))``
before the binary grid) are compared on min, max, zeros, NaN and Inf counts (equal), mean and std
(within 1e-12 relative); today's histogram is checked against ``np.histogram`` of the tensor given
today's edges (once, outside the timings). The revision must hold ``ckpt/tools/stats.py``.

Example:
    python -m benchmarks.stats_ab --reps 5
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import ckpt

from .round2 import _raw_read
from .run import fmt_row, make_model


def _load_module(revision: str, source_path: str, directory: str) -> Any:
    """A module of ckpt as it was at ``revision``, loaded as a sibling of today's (same helpers)."""
    source = subprocess.run(["git", "show", f"{revision}:{source_path}"], check=True, capture_output=True,
                            text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout
    name = os.path.splitext(os.path.basename(source_path))[0] + "_before"
    path = os.path.join(directory, name + ".py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"ckpt._{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"ckpt._{name}"] = module  # its relative imports resolve inside today's ckpt
    spec.loader.exec_module(module)
    return module


def _timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def _agree(before: Any, after: Any) -> bool:
    def close(a: float, b: float) -> bool:
        return abs(a - b) <= 1e-12 * max(abs(a), abs(b), 1e-300)

    return ((before.min, before.max, before.zeros, before.nan, before.inf) ==
            (after.min, after.max, after.zeros, after.nan, after.inf) and
            close(before.mean, after.mean) and close(before.std, after.std))


def _numpy_agrees(path: str, stats: dict[str, Any]) -> bool:
    """Each tensor's histogram against numpy's, given the same edges (one tensor in memory at a time)."""
    with ckpt.load_checkpoint(path) as reader:
        for key, s in stats.items():
            values = reader.get_tensor(key).reshape(-1)
            if list(np.histogram(values, bins=np.array(s.histogram_edges))[0]) != list(s.histogram):
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stats_ab", description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="HEAD", help="git revision of the 'before' ckpt/tools/stats.py")
    parser.add_argument("--gib", type=float, default=1.0, help="checkpoint size (8 float32 tensors)")
    parser.add_argument("--reps", type=int, default=3, help="rounds (medians reported)")
    parser.add_argument("--tmpfs", default="/dev/shm", help="directory for the checkpoint")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.tmpfs) as directory:
        before = _load_module(args.before, "ckpt/tools/stats.py", directory)
        model, variables = make_model(8, int(args.gib * (1 << 30)) // 8, seed=4)
        path = ckpt.Saver(variables, max_to_keep=None, format="hdf5").save(os.path.join(directory, "ab.h5"))
        del model, variables
        rows: dict[str, list[tuple[float, float, float]]] = {"before": [], "after": []}
        same = True
        for _ in range(args.reps):
            results = {}
            for name, call in (("before", before.tensor_stats), ("after", ckpt.tensor_stats)):
                raw1 = _timed(lambda: _raw_read(path))[0]
                wall, cpu, results[name] = _timed(lambda call=call: call(path))
                raw2 = _timed(lambda: _raw_read(path))[0]
                rows[name].append((wall, cpu, (raw1 + raw2) / 2 / wall))
            same = same and all(_agree(results["before"][k], results["after"][k]) for k in results["after"])
        histograms = _numpy_agrees(path, results["after"])
        print(f"**ckpt.tensor_stats, {args.gib:.2f} GiB in 8 float32 tensors on {args.tmpfs}, before = "
              f"{args.before}, median of {args.reps} interleaved rounds**\n")
        print(fmt_row(["", "wall s", "CPU s (all threads)", "speed vs raw read", "ratios per round"]))
        print(fmt_row(["---"] * 5))
        for name, runs in rows.items():
            walls, cpus, ratios = zip(*runs, strict=True)
            print(fmt_row([name, f"{statistics.median(walls):.3f}", f"{statistics.median(cpus):.3f}",
                           f"{statistics.median(ratios):.3f}x", " ".join(f"{r:.3f}" for r in ratios)]))
        print(f"\nsame min, max, zeros, NaN/Inf counts, mean and std (1e-12) in every round: {'yes' if same else 'no'}")
        print(f"histograms equal to np.histogram(tensor, bins=histogram_edges): {'yes' if histograms else 'no'}")


if __name__ == "__main__":
    main()
