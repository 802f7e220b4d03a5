"""Asynchronous saves: how long ``save(blocking=False)`` blocks, a simulated training loop, memory.

Run through ``python -m benchmarks --cases async`` (see benchmarks/run.py), or alone:

    python -m benchmarks.async_save peak DIRECTORY COUNT NBYTES STAGING   # one memory figure (JSON)

* **blocking time**: the time ``save(blocking=False)`` takes to return (the arena already
  allocated by a first save), against ``np.copyto`` of every tensor into preallocated arrays
  (the floor) and against a blocking save; the background write is waited for, untimed, before
  the next repetition.
* **training loop**: steps of fixed element-wise numpy work on one core (plus an in-place update of
  one model tensor), a save every K steps; steps per second with no saves, a copy only (at each
  save point the staging copy of the model an async save makes, in the same parallel pieces,
  into preallocated memory: the pause no snapshotting save avoids), blocking saves
  and async saves, and how long each background write took while training ran (does it fit between
  two saves?). K is chosen so that the time between two saves is about twice an async save's
  background write. On tmpfs an A/B row runs the background write as before issue 14's third
  round (checksums on the I/O worker threads beside the write) in the same process.
* **peak memory**: in a fresh process, the peak resident memory beyond the loaded model during
  two async saves (first and steady state), with the default staging bound and smaller ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

import ckpt
from ckpt import staging
from ckpt.formats import _io

from .memory import _reset_peak, _status
from .run import fmt_row, make_model, timed

MiB = 1 << 20


def blocking_times(variables: dict[str, ckpt.Variable], directory: str, reps: int) -> dict[str, float]:
    """Median seconds: np.copyto floor, save(blocking=False) returning, blocking save."""
    arrays = [v._value for v in variables.values()]
    copies = [np.empty_like(a) for a in arrays]
    for dst, src in zip(copies, arrays):
        np.copyto(dst, src)  # touch the pages once, as the arena is after its first save
    out: dict[str, list[float]] = {"np.copyto": [], "async": [], "blocking": [], "async total": []}
    for ext in ("msgpack", "h5"):
        out[f"async {ext}"], out[f"blocking {ext}"] = [], []
    savers = {ext: ckpt.Saver(variables, max_to_keep=1) for ext in ("msgpack", "h5")}
    for ext, saver in savers.items():
        saver.save(os.path.join(directory, f"warm.{ext}"), blocking=False).result()  # allocates the arena
        os.remove(os.path.join(directory, f"warm.{ext}"))
    for rep in range(reps):
        out["np.copyto"].append(timed(lambda: [np.copyto(d, s) for d, s in zip(copies, arrays)]))
        for ext, saver in savers.items():
            path = os.path.join(directory, f"m.{ext}")
            start = time.perf_counter()
            future = saver.save(path, global_step=rep, blocking=False)
            out[f"async {ext}"].append(time.perf_counter() - start)
            future.result()
            out["async total"].append(time.perf_counter() - start)
            out[f"blocking {ext}"].append(timed(lambda: saver.save(path, global_step=reps + rep)))
    return {k: statistics.median(v) for k, v in out.items() if v}


class Trainer:
    """A fixed amount of numpy work per step, and an in-place update of one model tensor.

    The work is element-wise (one core, as numpy runs it): the training loop leaves the other
    cores to the background write, as the target assumes ("the write fits between two saves").
    """

    def __init__(self, variables: dict[str, ckpt.Variable], rounds: int) -> None:
        rng = np.random.default_rng(7)
        self.a = rng.standard_normal(1 << 18).astype(np.float32)  # 1 MiB: stays in cache
        self.b = np.empty_like(self.a)
        self.rounds = rounds
        self.layers = list(variables.values())
        self.step_count = 0

    def step(self) -> None:
        for _ in range(self.rounds):
            np.multiply(self.a, np.float32(0.5), out=self.b)
            np.add(self.b, np.float32(0.25), out=self.a)
        layer = self.layers[self.step_count % len(self.layers)]
        layer._value *= np.float32(0.999)  # training changes the model while saves are in flight
        self.step_count += 1


@contextlib.contextmanager
def _writer_on_the_pool() -> Iterator[None]:
    """The background write as it was before it kept to one thread: checksums on the I/O worker
    threads beside the write (for the A/B row; ckpt has no switch for it)."""
    real = _io.one_thread
    _io.one_thread = contextlib.nullcontext  # type: ignore[assignment]
    try:
        yield
    finally:
        _io.one_thread = real


def training_loop(variables: dict[str, ckpt.Variable], directory: str, save_seconds: float,
                  target_step: float = 0.05, saves: int = 3, pool_row: bool = False, spacing: float = 2,
                  modes: tuple[str, ...] = ("none", "copy only", "blocking", "async")) -> dict[str, Any]:
    """Steps per second with no saves, a copy only, blocking saves and async saves (a save every K
    steps: ``spacing`` whole async saves' worth of time), and how long the async saves' background
    writes took while training ran."""
    trainer = Trainer(variables, 16)
    for _ in range(3):  # scale the work until a step takes about target_step
        step_s = timed(lambda: [trainer.step() for _ in range(10)]) / 10
        trainer.rounds = max(1, round(trainer.rounds * target_step / step_s))
    step_s = timed(lambda: [trainer.step() for _ in range(20)]) / 20
    every = max(2, int(np.ceil(spacing * save_seconds / step_s)))  # `spacing` writes' worth of time between saves
    steps = every * saves
    saver = ckpt.Saver(variables, max_to_keep=1)
    path = os.path.join(directory, "train.msgpack")
    saver.save(path, blocking=False).result()  # the arena exists, as after a run's first save
    arrays = [v._value for v in variables.values()]
    copies = [np.empty_like(a) for a in arrays]
    for dst, src in zip(copies, arrays):
        np.copyto(dst, src)  # touched once, as the arena is
    pairs = [(d.reshape(-1).view(np.uint8), s.reshape(-1).view(np.uint8)) for d, s in zip(copies, arrays)]
    background: dict[str, list[float]] = {}

    def run(mode: str) -> float:
        written = background.setdefault(mode, [])
        with _writer_on_the_pool() if mode == "async, writer on the I/O pool" else contextlib.nullcontext():
            start = time.perf_counter()
            for i in range(steps):
                trainer.step()
                if mode == "none" or i % every != every // 2:  # mid-interval: the last write overlaps too
                    continue
                if mode == "copy only":  # the pause an async save cannot avoid: its staging copy of the model
                    staging._copy_all(pairs)
                    continue
                called = time.perf_counter()
                future = saver.save(path, global_step=i, blocking=mode == "blocking")
                if not isinstance(future, str):
                    future.add_done_callback(lambda _, called=called: written.append(time.perf_counter() - called))
            saver.wait()
            return steps / (time.perf_counter() - start)

    order = [*modes, *(["async, writer on the I/O pool"] if pool_row else [])]
    rates: dict[str, list[float]] = {mode: [] for mode in order}
    for mode in order + order[::-1]:  # ABC..CBA: drift cancels
        rates[mode].append(run(mode))
    return {"step s": step_s, "every": every, "steps": steps,
            "rates": {m: statistics.mean(r) for m, r in rates.items()},
            "background": {m: w for m, w in background.items() if w}}


def peak(directory: str, count: int, nbytes: int, staging: int | None) -> dict[str, int]:
    """In this (fresh) process: peak RSS beyond the model during a first and a second async save."""
    _, variables = make_model(count, nbytes)
    saver = ckpt.Saver(variables, max_to_keep=1, staging_bytes=staging)
    out = {}
    for what in ("first", "steady"):
        base = _status("VmRSS")
        _reset_peak()
        saver.save(os.path.join(directory, f"peak-{what}.msgpack"), blocking=False).result()
        out[what] = _status("VmHWM") - base
        out[f"{what} arena"] = saver._background.arena.nbytes
    shutil.rmtree(directory, ignore_errors=True)
    return out


def peak_in_process(directory: str, count: int, nbytes: int, staging: int | None) -> dict[str, int]:
    folder = os.path.join(directory, f"peak-{staging}")
    os.makedirs(folder, exist_ok=True)
    out = subprocess.run([sys.executable, "-m", "benchmarks.async_save", "peak", folder, str(count), str(nbytes),
                          "none" if staging is None else str(staging)], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def print_loop(label: str, loop: dict[str, Any]) -> None:
    """Print one simulated-training table and whether each background write fit between saves."""
    interval = loop["every"] * loop["step s"]
    rates = loop["rates"]
    print(f"**async {label}: simulated training, {loop['step s'] * 1000:.0f} ms of numpy work a step, "
          f"a save every {loop['every']} steps ({interval:.2f} s), {loop['steps']} steps, runs in the order "
          f"ABC..CBA, mean of 2**\n")
    print(fmt_row(["saves", "steps/s", "vs no saves", "vs copy only", "target"]))
    print(fmt_row(["---"] * 5))
    for mode in rates:
        print(fmt_row([mode, f"{rates[mode]:.2f}", f"{rates[mode] / rates['none']:.3f}",
                       f"{rates[mode] / rates['copy only']:.3f}", ">= 0.95 vs no saves" if mode == "async" else ""]))
    print()
    for mode, written in loop["background"].items():
        fits = "fits between two saves" if max(written) < interval else "does NOT fit between two saves"
        print(f"- {mode}: background write while training ran: median {statistics.median(written):.2f} s, "
              f"longest {max(written):.2f} s, against {interval:.2f} s between saves ({fits})")
    print()


def report(label: str, variables: dict[str, ckpt.Variable], count: int, nbytes: int, directory: str,
           reps: int) -> None:
    """Print the three async tables for one directory."""
    total = count * nbytes
    folder = os.path.join(directory, "async")
    os.makedirs(folder, exist_ok=True)
    times = blocking_times(variables, folder, reps)
    floor = times["np.copyto"]
    print(f"**async {label}: time save() blocks, {total / (1 << 30):.2f} GiB in {count} tensors, "
          f"median of {reps}**\n")
    print(fmt_row(["what", "s", "vs np.copyto", "target"]))
    print(fmt_row(["---"] * 4))
    print(fmt_row(["np.copyto into preallocated arrays", f"{floor:.3f}", "1.00", ""]))
    for ext in ("msgpack", "h5"):
        a, b = times[f"async {ext}"], times[f"blocking {ext}"]
        print(fmt_row([f"save(blocking=False) {ext}", f"{a:.3f}", f"{a / floor:.2f}", "<= 1.2"]))
        print(fmt_row([f"save() blocking {ext}", f"{b:.3f}", f"{b / floor:.2f}", ""]))
    print(fmt_row(["async save until committed (both formats)", f"{times['async total']:.3f}",
                   f"{times['async total'] / floor:.2f}", ""]))
    print()
    print_loop(label, training_loop(variables, folder, times["async total"], pool_row=label == "tmpfs"))
    # Saves further apart (a run saving every few minutes): the copy pause's share shrinks with the interval.
    print_loop(label, training_loop(variables, folder, times["async total"], saves=2, spacing=6,
                                    modes=("none", "copy only", "async")))
    print(f"**async {label}: peak resident memory beyond the model ({total / MiB:.0f} MiB), fresh process**\n")
    print(fmt_row(["staging_bytes", "first save MiB", "arena MiB", "later saves MiB"]))
    print(fmt_row(["---"] * 4))
    for staging in (None, total // 4, 0):
        p = peak_in_process(folder, count, nbytes, staging)
        name = "None (a model)" if staging is None else f"{staging / MiB:.0f} MiB"
        print(fmt_row([name, f"{p['first'] / MiB:.0f}", f"{p['first arena'] / MiB:.0f}",
                       f"{p['steady'] / MiB:.0f}"]))
    print()
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1] == "peak":
        directory, count, nbytes, staging = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        print(json.dumps(peak(directory, count, nbytes, None if staging == "none" else int(staging))))
    else:
        raise SystemExit("usage: python -m benchmarks.async_save peak DIRECTORY COUNT NBYTES STAGING|none")
