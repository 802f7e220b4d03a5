"""Issue 18's cases: many small tensors against their targets, one tensor from a big file, and
the command line (whole processes and in-process calls) against the I/O limit.

Run through ``python -m benchmarks --cases b,one,cli`` (see benchmarks/run.py). Every figure is
printed next to the ratio its target names, measured in the same run, systems interleaved:

* **(b) targets**: from case (b)'s medians: HDF5 save + restore against safetensors' (≤ 1.5x),
  restores of both formats and msgpack's save against safetensors (speed ≥ 1.0x).
* **one**: one 8 MiB tensor of a 256 MiB checkpoint, opened and read by
  ``Saver({key: var}).restore``, against plain h5py (open, ``read_direct``) for HDF5 and a raw
  open-seek-readinto for msgpack (time ≤ 1.2x).
* **cli** (**stats**: its ``inspect --stats`` row alone): a checkpoint of 8 float32 tensors
  (``--cli-gib``, 1 GiB by default) on tmpfs:
  ``ckpt convert`` h5 → msgpack, msgpack → h5 and msgpack → safetensors against ``cp`` of the same
  file (as processes, speed ≥ 0.7x: issue 29), ``ckpt diff`` against a raw read of both files (≥ 0.5x),
  ``ckpt inspect --stats`` against a raw read (≥ 0.35x as a process: issue 29), each as a new process, as an
  in-process call of the command and as the library call doing the same work
  (``ckpt.convert``, ``ckpt.compare``, ``ckpt.tensor_stats``), with the process's peak memory and CPU seconds
  next to the reference's (CPU holds still on a shared machine); ``ckpt --version`` and
  ``--help`` against Python's start (no numpy), and ``ckpt inspect`` of a small file against
  Python's start plus ``import numpy`` plus 0.1 s. Processes run without PYTHONDONTWRITEBYTECODE, as a
  user's install has its .pyc files.
"""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import ckpt

from .run import Timings, fmt_row, make_model, timed

MiB = 1 << 20
_RAW_CHUNK = 4 * MiB


def _median(fn: Callable[[], Any], reps: int) -> float:
    return statistics.median(timed(fn) for _ in range(reps))


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def small_targets(res: dict[str, Timings]) -> str:
    """Case (b) against issue 18's targets (speed ratios: above 1 is faster than safetensors)."""
    if "safetensors" not in res:
        return "(b) targets: safetensors is not installed (pip install '.[bench]')"
    st = res["safetensors"]
    lines = ["**(b) targets (10,000 x 1 KiB, against safetensors in the same run)**", "",
             fmt_row(["measure", "ratio", "target", ""]), fmt_row(["---"] * 4)]

    def add(label: str, value: float, target: str, ok: bool) -> None:
        lines.append(fmt_row([label, f"{value:.2f}x", target, _verdict(ok)]))

    if "ckpt hdf5" in res:
        h5 = res["ckpt hdf5"]
        both = (h5.median("save") + h5.median("restore")) / (st.median("save") + st.median("restore"))
        add("HDF5 save + restore time / safetensors'", both, "≤ 1.5x", both <= 1.5)
        speed = st.median("restore") / h5.median("restore")
        add("HDF5 restore speed / safetensors'", speed, "≥ 1.0x", speed >= 1.0)
    if "ckpt msgpack" in res:
        mp = res["ckpt msgpack"]
        speed = st.median("restore") / mp.median("restore")
        add("msgpack restore speed / safetensors'", speed, "≥ 1.0x", speed >= 1.0)
        speed = st.median("save") / mp.median("save")
        add("msgpack save speed / safetensors'", speed, "≥ 1.0x", speed >= 1.0)
    return "\n".join(lines)


def one_tensor_case(label: str, directory: str, reps: int) -> str:
    """One 8 MiB tensor of a 256 MiB checkpoint: ckpt against plain h5py and a raw read."""
    import h5py

    model, variables = make_model(32, 8 * MiB, seed=3)
    key = list(model)[len(model) // 2]
    out = np.empty_like(model[key])
    paths = {fmt: os.path.join(directory, f"one.{ext}") for fmt, ext in (("hdf5", "h5"), ("msgpack", "msgpack"))}
    for fmt, path in paths.items():
        ckpt.Saver(variables, max_to_keep=None, format=fmt).save(path)
    plain = os.path.join(directory, "one-plain.h5")
    with h5py.File(plain, "w") as f:
        for k, arr in model.items():
            f.create_dataset(k, data=arr)
    with ckpt.load_checkpoint(paths["msgpack"]) as reader:
        (offset, _), = reader.tensors[key].extra[0]  # the tensor's one extent in the msgpack file

    def h5py_read() -> None:
        with h5py.File(plain, "r") as f:
            f[key].read_direct(out)

    def raw_read() -> None:
        with open(paths["msgpack"], "rb", buffering=0) as f:
            f.seek(offset)
            f.readinto(memoryview(out).cast("B"))

    single = {key: variables[key]}
    runs: dict[str, Callable[[], Any]] = {
        "h5py read_direct": h5py_read, "ckpt hdf5": lambda: ckpt.Saver(single).restore(paths["hdf5"]),
        "raw open-seek-read": raw_read, "ckpt msgpack": lambda: ckpt.Saver(single).restore(paths["msgpack"])}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(max(reps, 5) * 4):  # milliseconds each: more repetitions, interleaved
        for name, fn in runs.items():
            times[name].append(timed(fn))
    med = {name: statistics.median(t) for name, t in times.items()}
    for path in (*paths.values(), plain):
        os.remove(path)
    h5 = med["ckpt hdf5"] / med["h5py read_direct"]
    mp = med["ckpt msgpack"] / med["raw open-seek-read"]
    return "\n".join([
        f"**one {label}: one 8 MiB tensor of a 256 MiB checkpoint (open and read), median of "
        f"{len(times['ckpt hdf5'])}**", "",
        fmt_row(["system", "ms"]), fmt_row(["---"] * 2),
        *(fmt_row([name, f"{1000 * t:.2f}"]) for name, t in med.items()), "",
        fmt_row(["measure", "ratio", "target", ""]), fmt_row(["---"] * 4),
        fmt_row(["ckpt hdf5 / h5py read_direct (time)", f"{h5:.2f}x", "≤ 1.2x", _verdict(h5 <= 1.2)]),
        fmt_row(["ckpt msgpack / raw read (time)", f"{mp:.2f}x", "≤ 1.2x", _verdict(mp <= 1.2)])])


def _raw_read(*paths: str) -> None:
    buf = bytearray(_RAW_CHUNK)
    view = memoryview(buf)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass


def _cp(src: str, dst: str) -> None:
    """``cp`` as people run it: the reference of a conversion run as a process (issue 29)."""
    subprocess.run(["cp", src, dst], check=True)


#: Runs the ckpt command as its console script does, then reports the process's peak memory and CPU time.
_WRAPPER = ("import sys\nfrom ckpt.cli.main import run\nsys.argv[0] = 'ckpt'\ntry:\n    run()\n"
            "finally:\n    import os\n    hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')]\n"
            "    t = os.times()\n"
            "    sys.stderr.write('\\nVmHWM ' + hwm[0].split()[1] + '\\nCPU ' + str(t.user + t.system) + '\\n')\n")


#: Rows whose target is the whole process's speed (issue 29: the command line as people run it).
_BY_PROCESS = ("diff (every value differs)", "convert h5 -> msgpack", "convert msgpack -> h5",
               "convert msgpack -> safetensors", "inspect --stats")

#: A user's install has its .pyc files: without them (PYTHONDONTWRITEBYTECODE, as some sandboxes set)
#: every process would compile ckpt and click again (~40 ms), which no user pays.
_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _process(args: list[str]) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (user + system, all threads) and peak resident bytes of one
    ``ckpt`` process (exit status 0 or 1). CPU seconds hold still on a shared machine, wall
    seconds do not."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", _WRAPPER, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=_ENV)
    _, stderr = proc.communicate()
    seconds = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"ckpt {' '.join(args)} failed: {stderr}")
    fields = dict(line.split(" ", 1) for line in stderr.splitlines() if line.startswith(("VmHWM ", "CPU ")))
    return seconds, float(fields["CPU"]), int(fields["VmHWM"].split()[0]) * 1024


def _cpu_seconds(fn: Callable[[], Any]) -> float:
    """CPU seconds (user + system) ``fn`` used in this process's threads and its child processes."""
    before, children = time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    fn()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (time.process_time() - before + after.ru_utime - children.ru_utime
            + after.ru_stime - children.ru_stime)


def _in_process(args: list[str]) -> None:
    from ckpt.cli import main

    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        try:
            main.main(args, prog_name="ckpt", standalone_mode=False)
        except SystemExit:
            pass


def cli_case(label: str, directory: str, gib: float, reps: int, only: tuple[str, ...] = ()) -> str:
    """The command line on a big checkpoint, and its start-up (``only``: just these commands, no start-up)."""
    model, variables = make_model(8, int(gib * (1 << 30)) // 8, seed=4)
    total = sum(a.nbytes for a in model.values())
    h5, mp = os.path.join(directory, "cli.h5"), os.path.join(directory, "cli.msgpack")
    ckpt.Saver(variables, max_to_keep=None, format="hdf5").save(h5)
    ckpt.Saver(variables, max_to_keep=None, format="msgpack").save(mp)
    step = os.path.join(directory, "cli-step.h5")  # the next training step: every value differs
    if not only or "diff (every value differs)" in only:
        for var in variables.values():
            var._value += np.float32(1e-3)
        ckpt.Saver(variables, max_to_keep=None, format="hdf5").save(step)
    del model, variables
    out_mp, out_h5, out_st, copy = (os.path.join(directory, n)
                                    for n in ("out.msgpack", "out.h5", "out.safetensors", "copy.bin"))

    def clean() -> None:
        for path in (out_mp, out_h5, out_st, copy):
            if os.path.exists(path):
                os.remove(path)

    commands = {  # the command, the library call doing the same, the reference, the target
        "convert h5 -> msgpack": (["convert", h5, out_mp], lambda: ckpt.convert(h5, out_mp),
                                  lambda: _cp(h5, copy), "cp", 0.7),
        "convert msgpack -> h5": (["convert", mp, out_h5], lambda: ckpt.convert(mp, out_h5),
                                  lambda: _cp(mp, copy), "cp", 0.7),
        "convert msgpack -> safetensors": (["convert", mp, out_st], lambda: ckpt.convert(mp, out_st),
                                           lambda: _cp(mp, copy), "cp", 0.7),
        "diff": (["diff", h5, mp], lambda: ckpt.compare(h5, mp), lambda: _raw_read(h5, mp), "raw read of both", 0.5),
        "diff (every value differs)": (["diff", h5, step], lambda: ckpt.compare(h5, step),
                                       lambda: _raw_read(h5, step), "raw read of both", 0.35),
        "inspect --stats": (["inspect", h5, "--stats"], lambda: ckpt.tensor_stats(h5), lambda: _raw_read(h5),
                            "raw read", 0.35),
    }
    commands = {name: command for name, command in commands.items() if not only or name in only}
    rows = [f"**cli {label}: {total / (1 << 30):.2f} GiB in 8 float32 tensors, median of {reps}**", "",
            fmt_row(["command", "process s", "in-process s", "library call s", "reference s",
                     "speed vs reference (process)", "(in-process)", "(library)", "target", "", "peak RSS MiB",
                     "CPU s: process / reference"]),
            fmt_row(["---"] * 12)]
    for name, (args, call, reference, ref_label, target) in commands.items():
        proc, inproc, lib, ref, peak, cpu, ref_cpu = [], [], [], [], 0, [], []
        for _ in range(reps):
            clean()
            ref_cpu.append(_cpu_seconds(lambda: ref.append(timed(reference))))
            clean()
            seconds, used, rss = _process(args)
            proc.append(seconds)
            cpu.append(used)
            peak = max(peak, rss)
            clean()
            inproc.append(timed(lambda: _in_process(args)))
            clean()
            lib.append(timed(call))
        clean()
        r, p, i, c = (statistics.median(x) for x in (ref, proc, inproc, lib))
        judged = r / p if name in _BY_PROCESS else r / i
        rows.append(fmt_row([name, f"{p:.3f}", f"{i:.3f}", f"{c:.3f}", f"{r:.3f} ({ref_label})", f"{r / p:.2f}x",
                             f"{r / i:.2f}x", f"{r / c:.2f}x", f"≥ {target}x" + (" (process)" if name in _BY_PROCESS
                                                                               else ""),
                             _verdict(judged >= target), f"{peak / MiB:.0f}",
                             f"{statistics.median(cpu):.3f} / {statistics.median(ref_cpu):.3f}"]))
    rows += ["", "(the verdict uses the in-process speed, or the process's where the target says so: a process "
             "adds Python's start and imports, reported below; the library call is ckpt.convert / compare / "
             "tensor_stats doing the same work)", ""]
    if only:
        for path in (h5, mp, step):
            if os.path.exists(path):
                os.remove(path)
        return "\n".join(rows)
    small = os.path.join(directory, "small.h5")
    ckpt.Saver({"w": ckpt.Variable(np.arange(10.0))}, max_to_keep=None).save(small)
    python = _median(lambda: subprocess.run([sys.executable, "-c", "pass"], check=True, env=_ENV), reps)
    numpy = _median(lambda: subprocess.run([sys.executable, "-c", "import numpy"], check=True, env=_ENV), reps)
    start = {what: statistics.median(_process(args)[0] for _ in range(reps))
             for what, args in (("ckpt --version", ["--version"]), ("ckpt --help", ["--help"]),
                                ("ckpt inspect (small file)", ["inspect", small]))}
    rows += [fmt_row(["start-up", "s", "target", ""]), fmt_row(["---"] * 4),
             fmt_row(["python -c pass", f"{python:.3f}", "", ""]),
             fmt_row(["python -c 'import numpy'", f"{numpy:.3f}", "", ""])]
    for what, seconds in start.items():
        if what.startswith("ckpt inspect"):
            bound, text = numpy + 0.1, f"≤ import numpy + 0.1 s = {numpy + 0.1:.3f}"
        else:
            bound, text = numpy, f"< import numpy ({numpy:.3f}): numpy is not imported"
        rows.append(fmt_row([what, f"{seconds:.3f}", text, _verdict(seconds <= bound)]))
    for path in (h5, mp, step, small):
        os.remove(path)
    return "\n".join(rows)
