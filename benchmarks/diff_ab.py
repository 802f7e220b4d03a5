"""``ckpt.compare`` before and after a change, in one run: ``python -m benchmarks.diff_ab``.

The "before" is ``ckpt/tools/comparison.py`` as it was at a git revision (``--before``, default
HEAD: the committed code against the working tree's), loaded from ``git show`` as a sibling module
of today's ``ckpt``.
The pair is what users diff between two training steps: A, 8 float32 tensors of seeded noise, and
B = A + 1e-3, so every value differs. Rounds alternate raw read of both files, before, raw read,
after; each ratio is the raw read's time (the mean of the two reads around it) over the call's.
CPU seconds (all threads) are printed too: on a shared machine they move far less than wall times.
Both must report the same counts and maxima for every tensor.

Example:
    python -m benchmarks.diff_ab --gib 0.25 --reps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import numpy as np

import ckpt

from .round2 import _raw_read
from .run import fmt_row, make_model
from .stats_ab import _load_module, _timed


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.diff_ab", description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="HEAD", help="git revision of the 'before' ckpt/tools/comparison.py")
    parser.add_argument("--gib", type=float, default=1.0, help="size of each checkpoint (8 float32 tensors)")
    parser.add_argument("--reps", type=int, default=3, help="rounds (medians reported)")
    parser.add_argument("--tmpfs", default="/dev/shm", help="directory for the checkpoints")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.tmpfs) as directory:
        before = _load_module(args.before, "ckpt/tools/comparison.py", directory)
        model, variables = make_model(8, int(args.gib * (1 << 30)) // 8, seed=4)
        a = ckpt.Saver(variables, max_to_keep=None, format="hdf5").save(os.path.join(directory, "a.h5"))
        for var in variables.values():
            var._value += np.float32(1e-3)  # one training step: every value moves
        b = ckpt.Saver(variables, max_to_keep=None, format="hdf5").save(os.path.join(directory, "b.h5"))
        del model, variables
        rows: dict[str, list[tuple[float, float, float]]] = {"before": [], "after": []}
        same = True
        for _ in range(args.reps):
            results = {}
            for name, call in (("before", before.compare), ("after", ckpt.compare)):
                raw1 = _timed(lambda: _raw_read(a, b))[0]
                wall, cpu, results[name] = _timed(lambda call=call: call(a, b))
                raw2 = _timed(lambda: _raw_read(a, b))[0]
                rows[name].append((wall, cpu, (raw1 + raw2) / 2 / wall))
            same = same and all(
                (x.values.unequal, x.values.outside, x.values.max_abs, x.values.max_rel) ==
                (y.values.unequal, y.values.outside, y.values.max_abs, y.values.max_rel)
                for x, y in zip(results["before"].tensors, results["after"].tensors, strict=True))
        print(f"**ckpt.compare of two checkpoints of {args.gib:.2f} GiB (8 float32 tensors, every value differs) "
              f"on {args.tmpfs}, before = {args.before}, median of {args.reps} interleaved rounds**\n")
        print(fmt_row(["", "wall s", "CPU s (all threads)", "speed vs raw read of both", "ratios per round"]))
        print(fmt_row(["---"] * 5))
        for name, runs in rows.items():
            walls, cpus, ratios = zip(*runs, strict=True)
            print(fmt_row([name, f"{statistics.median(walls):.3f}", f"{statistics.median(cpus):.3f}",
                           f"{statistics.median(ratios):.3f}x", " ".join(f"{r:.3f}" for r in ratios)]))
        print(f"\nsame counts, max abs and max rel diff for every tensor in every round: {'yes' if same else 'no'}")


if __name__ == "__main__":
    main()
