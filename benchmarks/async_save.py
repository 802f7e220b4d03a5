"""Asynchronous saves: how long ``save(blocking=False)`` blocks, a simulated training loop, memory.

Run through ``python -m benchmarks --cases async`` (see benchmarks/run.py), or alone:

    python -m benchmarks.async_save peak DIRECTORY COUNT NBYTES STAGING   # one memory figure (JSON)
    python -m benchmarks.async_save train DIRECTORY GIB INTERVAL_S ROUNDS MODES   # the training table alone
    python -m benchmarks.async_save interference TMPFS_DIRECTORY   # does a busy second core slow training?

* **blocking time**: the time ``save(blocking=False)`` takes to return (the arena already
  allocated by a first save), against ``np.copyto`` of every tensor into preallocated arrays
  (the floor) and against a blocking save; the background write is waited for, untimed, before
  the next repetition.
* **training loop**: steps of fixed element-wise numpy work on one core (plus an in-place update of
  one model tensor), a save every K steps, K·step = ``interval`` seconds (default 10: real runs
  save every few minutes, and the write, 1.5-4.5 s for 1 GiB here, fits with room). The run is
  cut into segments of one save interval, each starting with its configuration's save: none,
  *copy only* (the staging copy an async save makes, in the same parallel pieces, into
  preallocated memory: the pause no snapshotting save avoids), async, blocking; every
  configuration's segment sits between two no-save segments (N X N Y N Z N, the order reversed
  each round) and its steps per second is divided by the mean of those two neighbours', so the
  machine's drift cancels pair by pair; median and range over the rounds. Each segment also
  splits the training thread's wall time into CPU time, run-queue wait (runnable, no core free)
  and the rest (blocked: the GIL, a page fault on I/O), with its voluntary context switches and
  the VM's steal time, to tell contention from a slower core; each async write's duration and
  its thread's CPU time are recorded (does it fit between two saves?).
* **peak memory**: in a fresh process, the peak resident memory beyond the loaded model during
  two async saves (first and steady state), with the default staging bound and smaller ones.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

import ckpt
from ckpt.saving import staging

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


def _thread_sched() -> tuple[float, float]:
    """(CPU seconds, seconds spent runnable but waiting for a core) of the calling thread, from
    Linux's /proc/thread-self/schedstat (time.thread_time() and 0 elsewhere)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            cpu, waiting = f.read().split()[:2]
        return int(cpu) / 1e9, int(waiting) / 1e9
    except OSError:
        return time.thread_time(), 0.0


def _switches() -> int:
    """Voluntary context switches of the calling thread so far (it blocked: on the GIL, a lock, I/O);
    0 where /proc/thread-self/status is missing."""
    try:
        with open("/proc/thread-self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
    except (OSError, StopIteration):
        return 0


def _steal() -> float:
    """Seconds the hypervisor gave this VM's CPUs to others (all CPUs, /proc/stat; 0 elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


#: The save configurations a training segment can run besides "none" ("async nice N": an async
#: save whose writer thread is moved N nice steps below training once ``save`` returns; "async
#: switch MS": an async save with the interpreter's GIL switch interval at MS ms for the segment).
MODES = ("copy only", "async", "blocking", "async nice N", "async switch MS")


def _renice(tid: int, steps: int) -> None:
    """Lower one thread's CPU priority by ``steps`` (Linux: the nice value is per thread)."""
    os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + steps))


def training_loop(variables: dict[str, ckpt.Variable], directory: str, interval: float, rounds: int = 3,
                  target_step: float = 0.05, modes: tuple[str, ...] = ("copy only", "async", "blocking"),
                  ) -> dict[str, Any]:
    """The simulated training run: segments of one save interval (K steps of ``target_step``
    seconds, K·step ≈ ``interval``), each starting with its configuration's save, interleaved as
    N X N Y N Z N Z N Y N X N ... (``rounds`` rounds of ``modes``, N = no saves): each segment's
    steps per second is compared with the mean of its two no-save neighbours, so drift in the
    machine's speed cancels pair by pair. Per segment, the training thread's wall time is split
    into CPU time, run-queue wait (runnable, no core free) and the rest (waiting for the GIL,
    page faults on I/O); the VM's steal time is summed; each async write's duration and its
    thread's CPU time are recorded."""
    trainer = Trainer(variables, 16)
    for _ in range(3):  # scale the work until a step takes about target_step
        step_s = timed(lambda: [trainer.step() for _ in range(10)]) / 10
        trainer.rounds = max(1, round(trainer.rounds * target_step / step_s))
    step_s = timed(lambda: [trainer.step() for _ in range(20)]) / 20
    every = max(2, int(np.ceil(interval / step_s)))  # steps between two saves
    saver = ckpt.Saver(variables, max_to_keep=1)
    path = os.path.join(directory, "train.msgpack")
    saver.save(path, blocking=False).result()  # the arena exists, as after a run's first save
    arrays = [v._value for v in variables.values()]
    copies = [np.empty_like(a) for a in arrays]
    for dst, src in zip(copies, arrays):
        np.copyto(dst, src)  # touched once, as the arena is
    pairs = [(d.reshape(-1).view(np.uint8), s.reshape(-1).view(np.uint8)) for d, s in zip(copies, arrays)]
    writes: list[dict[str, Any]] = []  # one per async save: its mode, write seconds, writer CPU and wait
    pauses: dict[str, list[float]] = {}

    def segment(mode: str) -> dict[str, Any]:
        switch = sys.getswitchinterval()
        if mode.startswith("async switch "):  # the interpreter's GIL switch interval for this segment, in ms
            sys.setswitchinterval(float(mode.rsplit(" ", 1)[1]) / 1000)
        try:
            return timed_segment(mode)
        finally:
            sys.setswitchinterval(switch)

    def timed_segment(mode: str) -> dict[str, Any]:
        cpu0, wait0 = _thread_sched()
        switches0, steal0, start = _switches(), _steal(), time.perf_counter()
        if mode == "copy only":  # the pause no snapshotting save avoids: its staging copy of the model
            staging._copy_all(pairs)
        elif mode != "none":
            future = saver.save(path, global_step=len(writes), blocking=mode == "blocking")
            if not isinstance(future, str):
                record: dict[str, Any] = {"mode": mode, "called": start}
                writes.append(record)
                thread = saver._background._thread
                if mode.startswith("async nice ") and thread is not None and thread.native_id is not None:
                    _renice(thread.native_id, int(mode.rsplit(" ", 1)[1]))

                def done(_: Any, record: dict[str, Any] = record) -> None:
                    if threading.current_thread() is not threading.main_thread():  # the writer's own counters
                        record["write"] = time.perf_counter() - record["called"]
                        record["cpu"], record["wait"] = _thread_sched()

                future.add_done_callback(done)
        pauses.setdefault(mode, []).append(time.perf_counter() - start)
        for _ in range(every):
            trainer.step()
        saver.wait()  # a write that did not fit in the interval costs its overrun here
        wall = time.perf_counter() - start
        cpu1, wait1 = _thread_sched()
        return {"mode": mode, "rate": every / wall, "wall": wall, "cpu": cpu1 - cpu0, "wait": wait1 - wait0,
                "steal": _steal() - steal0, "switches": _switches() - switches0}

    segments = [segment("none")]
    for r in range(rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:  # X Y Z, then Z Y X: no mode always comes first
            segments += [segment(mode), segment("none")]
    return {"step s": step_s, "every": every, "interval": every * step_s, "segments": segments,
            "writes": [w for w in writes if "write" in w], "pauses": pauses}


def _pairs(loop: dict[str, Any], mode: str, field: str) -> list[float]:
    """``field`` of each ``mode`` segment over the mean of its two no-save neighbours' (every
    segment has the same number of steps)."""
    segs = loop["segments"]
    return [seg[field] / statistics.mean((segs[i - 1][field], segs[i + 1][field]))
            for i, seg in enumerate(segs) if seg["mode"] == mode]


def print_loop(label: str, loop: dict[str, Any], copy_s: float, write_s: float) -> None:
    """Print one simulated-training table: each configuration against its no-save neighbours."""
    segs, interval = loop["segments"], loop["interval"]
    modes = list(dict.fromkeys(s["mode"] for s in segs if s["mode"] != "none"))
    none = [s for s in segs if s["mode"] == "none"]
    rounds = len([s for s in segs if s["mode"] == modes[0]])
    print(f"**async {label}: simulated training, {loop['step s'] * 1000:.0f} ms of numpy work a step, a save every "
          f"{loop['every']} steps = {interval:.1f} s = {interval / write_s:.1f}x the async write alone "
          f"({write_s:.2f} s) = {interval / copy_s:.0f}x the staging copy ({copy_s:.3f} s); {rounds} rounds, each "
          f"configuration's segment (one interval) against the mean of its two no-save neighbours**\n")
    print(fmt_row(["saves", "vs no saves: median", "min-max", "training CPU per step", "run-queue wait s/segment",
                   "other off-CPU s/segment", "voluntary switches/segment", "steal s/segment", "target"]))
    print(fmt_row(["---"] * 9))

    def per_segment(rows: list[dict[str, Any]], what: str) -> float:
        return statistics.median(r[what] for r in rows)

    def off_cpu(r: dict[str, Any]) -> float:
        return r["wall"] - r["cpu"] - r["wait"]

    print(fmt_row([f"none ({statistics.median(s['rate'] for s in none):.2f} steps/s)", "1", "", "1",
                   f"{per_segment(none, 'wait'):.3f}", f"{statistics.median(map(off_cpu, none)):.3f}",
                   f"{per_segment(none, 'switches'):.0f}", f"{per_segment(none, 'steal'):.2f}", ""]))
    medians = {}
    for mode in modes:
        ratios = _pairs(loop, mode, "rate")
        medians[mode] = statistics.median(ratios)
        cpu = statistics.median(_pairs(loop, mode, "cpu"))
        rows = [s for s in segs if s["mode"] == mode]
        print(fmt_row([mode, f"{medians[mode]:.3f}", f"{min(ratios):.3f}-{max(ratios):.3f}", f"{cpu:.3f}",
                       f"{per_segment(rows, 'wait'):.3f}", f"{statistics.median(map(off_cpu, rows)):.3f}",
                       f"{per_segment(rows, 'switches'):.0f}", f"{per_segment(rows, 'steal'):.2f}",
                       ">= 0.95" if mode.startswith("async") else ""]))
    print()
    if "copy only" in medians:
        for mode in (m for m in modes if m.startswith("async")):
            print(f"- {mode} vs copy only (the background write's own cost): "
                  f"{medians[mode] / medians['copy only']:.3f}")
    for mode, pause in loop["pauses"].items():
        if mode != "none":
            print(f"- {mode}: the call paused training for a median {statistics.median(pause):.3f} s")
    for mode in modes:
        written = [w for w in loop["writes"] if w["mode"] == mode]
        if written:
            longest = max(w["write"] for w in written)
            fits = "fits" if longest < interval else "does NOT fit"
            median = statistics.median(w["write"] for w in written)
            print(f"- {mode}: background write while training ran: median {median:.2f} s, "
                  f"longest {longest:.2f} s ({fits} in the {interval:.1f} s interval); writer thread CPU "
                  f"{statistics.median(w['cpu'] for w in written):.2f} s, run-queue wait "
                  f"{statistics.median(w['wait'] for w in written):.2f} s a save")
    print()


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


def report(label: str, variables: dict[str, ckpt.Variable], count: int, nbytes: int, directory: str,
           reps: int, interval: float = 10.0, rounds: int = 3,
           modes: tuple[str, ...] = ("copy only", "async", "blocking")) -> None:
    """Print the three async tables for one directory (training: saves ``interval`` seconds apart,
    ``rounds`` rounds of ``modes``)."""
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
    loop = training_loop(variables, folder, interval, rounds, modes=modes)
    print_loop(label, loop, statistics.median(loop["pauses"].get("copy only", [times["np.copyto"]])),
               times["async total"])
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


#: Work another process runs on the other core while ``core_interference`` times training.
LOADS = {
    "idle": None,
    "a pure-Python spin loop (no memory traffic)": "while True: pass",
    "np.copyto of 256 MiB, repeated (memory traffic)": "import numpy as np\na = np.ones(1 << 26, np.float32)\n"
                                                        "b = np.empty_like(a)\nwhile True: np.copyto(b, a)",
    "write of 256 MiB into a tmpfs file, repeated (a tmpfs save's kernel copy)":
        "import os, sys, numpy as np\na = np.ones(1 << 26, np.float32)\nwhile True:\n"
        "    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC); os.write(fd, a); os.close(fd)",
}


def core_interference(directory: str, rounds: int = 3) -> None:
    """The training thread's CPU time per step while another process keeps the other core busy
    with different work (interleaved ``rounds`` times): does a busy second core slow the first?"""
    trainer = Trainer({"x": ckpt.Variable(np.zeros(1 << 20, np.float32), name="x")}, 100)
    target = os.path.join(directory, "interference")
    took: dict[str, list[float]] = {name: [] for name in LOADS}
    try:
        for r in range(rounds):
            for name, code in LOADS.items() if r % 2 == 0 else reversed(LOADS.items()):
                other = subprocess.Popen([sys.executable, "-c", code, target]) if code else None
                try:
                    time.sleep(0.5)
                    cpu = _thread_sched()[0]
                    for _ in range(60):
                        trainer.step()
                    took[name].append((_thread_sched()[0] - cpu) / 60)
                finally:
                    if other is not None:
                        other.kill()
                        other.wait()
    finally:
        if os.path.exists(target):
            os.unlink(target)
    idle = statistics.median(took["idle"])
    print(fmt_row(["the other core runs", "training CPU per step ms", "vs idle"]))
    print(fmt_row(["---"] * 3))
    for name, values in took.items():
        print(fmt_row([name, f"{statistics.median(values) * 1000:.2f}", f"{statistics.median(values) / idle:.3f}"]))


def train_only(directory: str, gib: float, interval: float, rounds: int, modes: tuple[str, ...]) -> None:
    """The training table alone (no blocking-time or memory tables), for longer or narrower runs."""
    count = 64
    _, variables = make_model(count, int(gib * (1 << 30)) // count)
    folder = os.path.join(directory, "async-train")
    os.makedirs(folder, exist_ok=True)
    try:
        saver = ckpt.Saver(variables, max_to_keep=1)
        saver.save(os.path.join(folder, "w.msgpack"), blocking=False).result()  # the arena, once
        took = []
        for _ in range(3):
            start = time.perf_counter()
            saver.save(os.path.join(folder, "w.msgpack"), blocking=False).result()
            took.append(time.perf_counter() - start)
        write_s = statistics.median(took)
        del saver  # (its arena)
        loop = training_loop(variables, folder, interval, rounds, modes=modes)
        print_loop(os.path.basename(directory.rstrip("/")) or directory, loop,
                   statistics.median(loop["pauses"].get("copy only", [float("nan")])), write_s)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "peak":
        directory, count, nbytes, staging = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        print(json.dumps(peak(directory, count, nbytes, None if staging == "none" else int(staging))))
    elif len(sys.argv) == 7 and sys.argv[1] == "train":
        train_only(sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]),
                   tuple(m.strip() for m in sys.argv[6].split(",")))
    elif len(sys.argv) == 3 and sys.argv[1] == "interference":
        core_interference(sys.argv[2])
    else:
        raise SystemExit("usage: python -m benchmarks.async_save peak DIRECTORY COUNT NBYTES STAGING|none\n"
                         "       python -m benchmarks.async_save train DIRECTORY GIB INTERVAL_S ROUNDS MODES\n"
                         "       python -m benchmarks.async_save interference TMPFS_DIRECTORY\n"
                         f"       (MODES: comma-separated from {', '.join(MODES)})")
