"""``ckpt.tensor_stats`` before and after a change, in one run: ``python -m benchmarks.stats_ab``.

The "before" is ``ckpt/stats.py`` as it was at a git revision (``--before``, default 57ae504: main
before session 3's rework), loaded from ``git show`` as a sibling module of today's ``ckpt`` (it
uses the same helpers: ``ckpt._chunks``, ``ckpt._sources``). Rounds alternate raw read, before,
raw read, after on one checkpoint of 8 float32 tensors on tmpfs; each ratio is the raw read's time
(the mean of the two reads around it) over the call's. CPU seconds (all threads) are printed too:
on a shared machine they move far less than wall times.

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

import ckpt

from .round2 import _raw_read
from .run import fmt_row, make_model


def _load_before(revision: str, directory: str) -> Any:
    source = subprocess.run(["git", "show", f"{revision}:ckpt/stats.py"], check=True, capture_output=True,
                            text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout
    path = os.path.join(directory, "stats_before.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("ckpt._stats_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ckpt._stats_before"] = module  # its relative imports resolve inside today's ckpt
    spec.loader.exec_module(module)
    return module


def _timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stats_ab", description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="57ae504", help="git revision of the 'before' ckpt/stats.py")
    parser.add_argument("--gib", type=float, default=1.0, help="checkpoint size (8 float32 tensors)")
    parser.add_argument("--reps", type=int, default=3, help="rounds (medians reported)")
    parser.add_argument("--tmpfs", default="/dev/shm", help="directory for the checkpoint")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.tmpfs) as directory:
        before = _load_before(args.before, directory)
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
            same = same and all(results["before"][k].histogram == results["after"][k].histogram and
                                results["before"][k].min == results["after"][k].min and
                                results["before"][k].zeros == results["after"][k].zeros for k in results["after"])
        print(f"**ckpt.tensor_stats, {args.gib:.2f} GiB in 8 float32 tensors on {args.tmpfs}, before = "
              f"{args.before}, median of {args.reps} interleaved rounds**\n")
        print(fmt_row(["", "wall s", "CPU s (all threads)", "speed vs raw read", "ratios per round"]))
        print(fmt_row(["---"] * 5))
        for name, runs in rows.items():
            walls, cpus, ratios = zip(*runs, strict=True)
            print(fmt_row([name, f"{statistics.median(walls):.3f}", f"{statistics.median(cpus):.3f}",
                           f"{statistics.median(ratios):.3f}x", " ".join(f"{r:.3f}" for r in ratios)]))
        print(f"\nsame min, max, zeros and histograms in every round: {'yes' if same else 'no'}")


if __name__ == "__main__":
    main()
