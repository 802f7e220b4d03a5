"""The benchmark runner: cases (a)-(e), systems interleaved, medians, markdown tables.

Every save writes a new file (the previous one is removed, untimed). On disk, each file is
flushed and evicted from the page cache before it is restored, so restores read the disk.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import ckpt
from ckpt import checksums

from . import distributed
from .systems import Model, System, all_systems

GiB = 1 << 30


def make_model(count: int, nbytes: int, seed: int = 0) -> tuple[Model, dict[str, ckpt.Variable]]:
    """``count`` float32 variables of ``nbytes`` each, filled with seeded noise."""
    rng = np.random.default_rng(seed)
    variables = {}
    for i in range(count):
        var = ckpt.Variable(ckpt.initializers.Zeros(), shape=(nbytes // 4,), name=f"layer{i:05d}/w")
        rng.standard_normal(out=var._value, dtype=np.float32)  # fill in place: no second copy
        variables[var.key] = var
    return {k: v._value for k, v in variables.items()}, variables


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def evict(path: str) -> None:
    """Flush a file and drop it from the page cache, so the next read comes from the disk."""
    for name in _files_of(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _files_of(path: str) -> list[str]:
    return [path] if os.path.exists(path) else []


@dataclass
class Timings:
    save: list[float] = field(default_factory=list)
    restore: list[float] = field(default_factory=list)
    one: list[float] = field(default_factory=list)

    def median(self, what: str) -> float:
        values = getattr(self, what)
        return statistics.median(values) if values else float("nan")


def run_case(systems: list[System], model: Model, variables: dict[str, ckpt.Variable], directory: str,
             reps: int, on_disk: bool, one_key: str | None = None) -> dict[str, Timings]:
    """Save and restore ``model`` with every system, interleaved, ``reps`` times each."""
    results = {s.name: Timings() for s in systems}
    paths = {}
    for system in systems:
        system.prepare(model, variables)
        folder = os.path.join(directory, system.name.replace(" ", "_").replace("+", "_"))
        os.makedirs(folder, exist_ok=True)
        paths[system.name] = os.path.join(folder, f"bench.{system.ext}")
    for rep in range(reps):
        for system in systems[rep % len(systems):] + systems[:rep % len(systems)]:
            path = paths[system.name]
            if os.path.exists(path):
                os.remove(path)
            results[system.name].save.append(timed(lambda: system.save(path, model)))
    for rep in range(reps):
        for system in systems[rep % len(systems):] + systems[:rep % len(systems)]:
            path = paths[system.name]
            if on_disk:
                evict(path)
            results[system.name].restore.append(timed(lambda: system.restore(path, model)))
            if one_key is not None:
                if on_disk:
                    evict(path)
                out = np.empty_like(model[one_key])
                results[system.name].one.append(timed(lambda: system.restore_one(path, one_key, out)))
    for system in systems:
        shutil.rmtree(os.path.dirname(paths[system.name]), ignore_errors=True)
    return results


def checksum_share(model: Model, variables: dict[str, ckpt.Variable], directory: str, reps: int) -> dict[str, float]:
    """Fraction of ckpt's save time spent on checksums: saves with and without crc32c, interleaved."""
    out = {}
    for fmt, ext in (("hdf5", "h5"), ("msgpack", "msgpack")):
        saver = ckpt.Saver(variables, max_to_keep=None, format=fmt)
        path = os.path.join(directory, f"crc.{ext}")
        with_crc, without = [], []
        for _ in range(reps):
            for sink, fake in ((with_crc, False), (without, True)):
                if os.path.exists(path):
                    os.remove(path)
                # every crc32c in ckpt goes through checksums._crc32c (None: loaded again on use)
                checksums._crc32c = None if not fake else (lambda data, value=0: 0)
                try:
                    sink.append(timed(lambda: saver.save(path)))
                finally:
                    checksums._crc32c = None
        out[fmt] = 1 - statistics.median(without) / statistics.median(with_crc)
        for name in os.listdir(directory):
            os.remove(os.path.join(directory, name))
    return out


def inspect_seconds(path: str, reps: int) -> float:
    """Wall time of `ckpt inspect --names-only PATH` as a user runs it (a new process)."""
    exe = os.path.join(os.path.dirname(sys.executable), "ckpt")
    command = [exe] if os.path.exists(exe) else [sys.executable, "-c", "from ckpt.cli.main import run; run()"]
    times = []
    for _ in range(reps):
        times.append(timed(lambda: subprocess.run(command + ["inspect", "--names-only", path], check=True,
                                                  stdout=subprocess.DEVNULL)))
    return statistics.median(times)


def import_seconds(reps: int) -> float:
    """Median cost of `import ckpt` in a fresh interpreter (minus the interpreter's own start)."""
    def start(code: str) -> float:
        return timed(lambda: subprocess.run([sys.executable, "-c", code], check=True))

    base = statistics.median(start("pass") for _ in range(reps))
    return statistics.median(start("import ckpt") for _ in range(reps)) - base


def peak_memory(system_name: str, count: int, nbytes: int, directory: str) -> dict[str, int]:
    """Run save and restore in a fresh process; return the peak RSS beyond the model (bytes)."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.memory", system_name, str(count), str(nbytes),
                          directory], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def fmt_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def table(title: str, results: dict[str, Timings], nbytes: int, raw: str, peer: str) -> str:
    """A markdown table of medians, GB/s and speed ratios (>1: faster than the reference)."""
    lines = [f"**{title}**", "", fmt_row(["system"] + [f"{w} {c}" for w in ("save", "restore")
                                                       for c in ("s", "GB/s", "vs raw", "vs safetensors")]),
             fmt_row(["---"] * 9)]
    for name, timings in results.items():
        cells = [name]
        for w in ("save", "restore"):
            t = timings.median(w)
            ref_raw = results[raw].median(w) if raw in results else float("nan")
            ref_peer = results[peer].median(w) if peer in results else float("nan")
            cells += [f"{t:.3f}", f"{nbytes / t / 1e9:.2f}", f"{ref_raw / t:.2f}", f"{ref_peer / t:.2f}"]
        lines.append(fmt_row(cells))
    return "\n".join(lines)


def describe_machine(directories: list[tuple[str, str]]) -> str:
    import platform

    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    dirs = ", ".join(f"{label}: {path}" for label, path in directories)
    return (f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, numpy {np.__version__}, "
            f"{platform.system()} {platform.release()}; {dirs}")


def main(args: Any) -> None:
    from . import round2  # it builds on this module

    cases = set(args.cases.split(","))
    systems = all_systems()
    if args.systems:
        systems = [s for s in systems if any(word in s.name for word in args.systems.split(","))]
    big_count, big_bytes = 64, int(args.size_gib * GiB) // 64
    small_count, small_bytes = args.small_count, 1024
    directories = [(label, path) for label, path in (("tmpfs", args.tmpfs), ("disk", args.disk)) if path]
    print(f"# ckpt benchmarks\n\nmachine: {describe_machine(directories)}\n")
    print(f"command: python -m benchmarks {' '.join(sys.argv[1:])}\n")
    if "plan" in cases:
        with tempfile.TemporaryDirectory(dir=args.tmpfs or None) as directory:
            print(distributed.plan_case(directory, args.reps) + "\n")
    if "sharded" in cases:
        print(distributed.sharded_case(directories, args.size_gib, args.reps) + "\n")
    if "s3" in cases:
        try:
            from . import s3

            print(s3.report(args.s3_model_mib, args.s3_big_mib, args.reps) + "\n")
        except ImportError as exc:  # the test extra (moto[server], s3fs) is not installed
            print(f"**s3**: skipped ({exc}; pip install -e '.[test,bench]')\n")
    if "compress" in cases:  # issue 28: compression="zstd" (benchmarks/compression.py)
        from .compression import run as run_compression

        for directory in (args.tmpfs, args.disk):
            if directory:
                print(run_compression(directory, args.reps))
        try:
            from .compression import object_store

            print(object_store(args.reps))
        except ImportError as exc:  # the test extra (moto[server]) is not installed
            print(f"case compress, S3: skipped ({exc})")
    if "import" in cases:
        print(f"**import ckpt**: {1000 * import_seconds(args.reps):.0f} ms (fresh interpreter, start-up "
              "subtracted)\n")
    if "open" in cases and args.tmpfs:  # CPU cost: on tmpfs
        from .opening import open_case

        directory = os.path.join(args.tmpfs, f"ckpt-bench-open-{os.getpid()}")
        os.makedirs(directory, exist_ok=True)
        try:
            print(open_case("tmpfs", directory, args.open_count, args.reps) + "\n")
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    if "incremental" in cases and args.disk:  # issue 28's targets: frozen backbone, sparse table, on disk
        from .incremental_targets import incremental_targets

        directory = os.path.join(args.disk, f"ckpt-bench-inc-{os.getpid()}")
        os.makedirs(directory, exist_ok=True)
        try:
            chunk_bytes = None if args.inc_chunk_mib is None else args.inc_chunk_mib << 20
            print(incremental_targets("disk", directory, args.inc_model_mib, args.inc_saves, args.inc_rows,
                                      args.inc_table_saves, chunk_bytes, args.inc_restore_reps) + "\n")
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    if "incremental-chunks" in cases and args.tmpfs:  # Saver(incremental=True) by chunk size, on tmpfs
        from .incremental import incremental_case

        directory = os.path.join(args.tmpfs, f"ckpt-bench-inc-{os.getpid()}")
        os.makedirs(directory, exist_ok=True)
        try:
            print(incremental_case("tmpfs", directory, args.reps) + "\n")
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    if "average" in cases:
        from .averaging import average_case

        for label, base in directories:  # tmpfs: the CPU cost; disk: the page cache and writeback too
            directory = os.path.join(base, f"ckpt-bench-avg-{os.getpid()}")
            os.makedirs(directory, exist_ok=True)
            try:
                print(average_case(label, directory, args.average_mib, args.reps) + "\n")
            finally:
                shutil.rmtree(directory, ignore_errors=True)
    if not cases & {"a", "b", "c", "d", "e", "async", "checksum", "one", "cli", "stats"}:
        return
    model, variables = make_model(big_count, big_bytes)
    total = big_count * big_bytes
    one_key = next(iter(model))
    for label, base in directories:
        directory = os.path.join(base, f"ckpt-bench-{os.getpid()}")
        os.makedirs(directory, exist_ok=True)
        try:
            if "a" in cases or "c" in cases:
                res = run_case(systems, model, variables, directory, args.reps, label == "disk", one_key)
                if "a" in cases:
                    print(table(f"({'a'}) {label}: {total / GiB:.2f} GiB in {big_count} float32 tensors, "
                                f"median of {args.reps}", res, total, "raw write+fsync" if label == "disk"
                                else "raw write", "safetensors") + "\n")
                if "c" in cases:
                    print(f"**(c) {label}: restore one {big_bytes / (1 << 20):.0f} MiB tensor of the "
                          f"{total / GiB:.2f} GiB checkpoint**\n")
                    print(fmt_row(["system", "one tensor s", "share of the full restore"]))
                    print(fmt_row(["---"] * 3))
                    for name, t in res.items():
                        print(fmt_row([name, f"{t.median('one'):.4f}",
                                       f"{100 * t.median('one') / t.median('restore'):.2f}%"]))
                    print()
            if "b" in cases:
                small_model, small_vars = make_model(small_count, small_bytes, seed=1)
                res = run_case(systems, small_model, small_vars, directory, args.reps, label == "disk")
                print(table(f"(b) {label}: {small_count} tensors of 1 KiB, median of {args.reps}", res,
                            small_count * small_bytes, "raw write", "safetensors") + "\n")
                print(fmt_row(["system", "save + restore s", "vs safetensors", "vs h5py"]))
                print(fmt_row(["---"] * 4))
                both = {n: t.median("save") + t.median("restore") for n, t in res.items()}
                for name, t in both.items():
                    print(fmt_row([name, f"{t:.3f}", f"{t / both.get('safetensors', float('nan')):.2f}x",
                                   f"{t / both.get('h5py', float('nan')):.2f}x"]))
                print()
                print(round2.small_targets(res) + "\n")
                del small_model, small_vars
            if "d" in cases:
                print(f"**(d) {label}: `ckpt inspect --names-only` (a new process), median of {args.reps}**\n")
                print(fmt_row(["checkpoint", "ckpt hdf5 s", "ckpt msgpack s"]))
                print(fmt_row(["---"] * 3))
                for size_label, per in ((f"{big_count} x {big_bytes >> 20} MiB", big_bytes),
                                        (f"{big_count} x 16 KiB", 16 << 10)):
                    _m, v = (model, variables) if per == big_bytes else make_model(big_count, per)
                    row = [size_label]
                    for fmt, ext in (("hdf5", "h5"), ("msgpack", "msgpack")):
                        path = ckpt.Saver(v, max_to_keep=None, format=fmt).save(os.path.join(directory, f"i.{ext}"))
                        row.append(f"{inspect_seconds(path, args.reps):.3f}")
                        os.remove(path)
                    print(fmt_row(row))
                print()
            if "e" in cases:
                print(f"**(e) {label}: peak memory beyond the model ({total / GiB:.2f} GiB), one process "
                      "per system**\n")
                print(fmt_row(["system", "save MiB", "restore MiB", "budget MiB"]))
                print(fmt_row(["---"] * 4))
                budget = max(64 << 20, total // 20)
                for system in systems:
                    peak = peak_memory(system.name, big_count, big_bytes, directory)
                    print(fmt_row([system.name, f"{peak['save'] / (1 << 20):.0f}",
                                   f"{peak['restore'] / (1 << 20):.0f}", f"{budget / (1 << 20):.0f}"]))
                print()
            if "async" in cases:
                from .async_save import report

                report(label, variables, big_count, big_bytes, directory, args.reps, args.async_interval,
                       args.async_rounds, tuple(m.strip() for m in args.async_modes.split(",")))
            if "hdf5child" in cases and label == "disk":
                from .foreign_hdf5 import report as report_hdf5

                report_hdf5(directory, args.reps)
            if "one" in cases and label == "tmpfs":  # issue 18's targets are set on tmpfs
                print(round2.one_tensor_case(label, directory, args.reps) + "\n")
            if "cli" in cases and label == "tmpfs":
                print(round2.cli_case(label, directory, args.cli_gib, args.reps) + "\n")
            elif "stats" in cases and label == "tmpfs":  # the cli case's inspect --stats row alone
                print(round2.cli_case(label, directory, args.cli_gib, args.reps, only=("inspect --stats",)) + "\n")
            if "checksum" in cases and label == "tmpfs":  # CPU cost: on disk, noise swamps it
                shares = checksum_share(model, variables, directory, args.reps)
                print(f"**checksum share of ckpt's save time ({label}, {total / GiB:.2f} GiB)**: " +
                      ", ".join(f"{fmt} {100 * share:.1f}%" for fmt, share in shares.items()) + "\n")
        finally:
            shutil.rmtree(directory, ignore_errors=True)
