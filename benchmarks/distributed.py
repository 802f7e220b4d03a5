"""Sharded-checkpoint benchmarks (``python -m benchmarks --cases sharded,plan``).

* ``plan``: planning and commit on rank 0 for 1,000 tensors x 64 ranks, with the other 63
  ranks simulated (their messages are made up front and handed back by a replaying
  communicator), and how the commit record grows with the number of blocks.
* ``sharded``: a 1 GiB global model saved and restored by N = 1, 2, 4 processes under
  mpiexec, against the single-process Saver and the raw write/read limit; then a 4 -> 3
  resharding restore with the bytes each rank read against the bytes it needed, from a
  checkpoint saved by 4 ranks and from one single-file checkpoint of the whole model.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np

import ckpt
from ckpt.distributed import plan as planning
from ckpt.distributed.comm import encode
from ckpt.distributed.save import build_record
from ckpt.formats import ckpt_sharded as sharded

from .mpi_worker import TENSORS

GiB = 1 << 30
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_worker.py")


class ReplayComm:
    """Rank 0 of ``size``: each collective returns this rank's data and the peers' prepared answers."""

    rank = 0

    def __init__(self, size: int, peers: list[list[bytes]]) -> None:
        self.size, self._peers, self._calls = size, peers, 0

    def allgather(self, data: bytes, timeout: float) -> list[bytes]:
        out = [data] + self._peers[self._calls]
        self._calls += 1
        return out

    def broadcast(self, data: bytes | None, root: int, timeout: float) -> bytes:
        self._calls += 1
        assert data is not None
        return data

    def barrier(self, timeout: float) -> None:
        self._calls += 1

    def dup(self) -> ReplayComm:
        return self


def _rank_plan(rank: int, size: int, tensors: int, rows: int, cols: int, path: str) -> dict[str, Any]:
    return planning.local_plan(path, 1, None, [(f"layer{i:04d}/w", "float32", (rows * size, cols), (rank * rows, 0),
                                                (rows, cols)) for i in range(tensors)])


def _rank_report(rank: int, size: int, tensors: int, rows: int, cols: int) -> dict[str, Any]:
    return {"error": None, "file": [sharded.shard_file_name("0" * 16, rank, size, ".msgpack"), 1 << 20],
            "blocks": [[f"layer{i:04d}/w", [rank * rows, 0], [rows, cols], rows * cols * 4, [12345]]
                       for i in range(tensors)]}


def plan_commit(tensors: int, size: int, directory: str, reps: int = 3) -> dict[str, float]:
    """Rank 0's planning, commit and record figures for ``tensors`` x ``size`` ranks (1 KiB blocks)."""
    rows, cols = 16, 16
    path = os.path.join(directory, "model-1.msgpack")  # what save("model.msgpack", global_step=1) names
    plans = [_rank_plan(r, size, tensors, rows, cols, path) for r in range(size)]
    reports = [_rank_report(r, size, tensors, rows, cols) for r in range(size)]
    out: dict[str, list[float]] = {"plan": [], "commit": [], "open": [], "save": []}
    for _ in range(reps):
        start = time.perf_counter()
        assert planning.problems(plans) is None
        planning.replicated_writers(planning.layout(plans))
        out["plan"].append(time.perf_counter() - start)
        os.makedirs(path, exist_ok=True)
        start = time.perf_counter()
        record = build_record(planning.layout(plans), reports, 1, {})
        sharded.write_commit(path, record)
        out["commit"].append(time.perf_counter() - start)
        start = time.perf_counter()
        sharded.ShardedReader(path).close()
        out["open"].append(time.perf_counter() - start)
        shutil.rmtree(path)
        # the whole save on rank 0, with the 63 other ranks' messages replayed
        variables = {f"layer{i:04d}/w": ckpt.Variable(np.zeros((rows, cols), np.float32), name=f"l{i}",
                                                       shard=ckpt.Shard((rows * size, cols), (0, 0)))
                     for i in range(tensors)}
        peers = [[encode(p) for p in plans[1:]], [], [encode(r) for r in reports[1:]], []]
        saver = ckpt.Saver(variables, comm=ReplayComm(size, peers), max_to_keep=None)
        start = time.perf_counter()
        saver.save(os.path.join(directory, "model.msgpack"), global_step=1)
        out["save"].append(time.perf_counter() - start)
        out.setdefault("record_bytes", []).append(os.path.getsize(os.path.join(path, sharded.COMMIT)))
        shutil.rmtree(path)
        os.unlink(os.path.join(directory, "checkpoint"))
    return {k: float(np.median(v)) for k, v in out.items()}


def plan_case(directory: str, reps: int) -> str:
    lines = ["**Sharded save, rank 0's coordination work (other ranks simulated), 1 KiB blocks, median of "
             f"{reps}**", "", "| tensors x ranks | blocks | plan s | commit s | open record s | rank-0 save s | "
             "record bytes | bytes/block |", "|---|---|---|---|---|---|---|---|"]
    for tensors, size in ((1000, 16), (1000, 64), (1000, 256)):
        r = plan_commit(tensors, size, directory, reps)
        blocks = tensors * size
        lines.append(f"| {tensors} x {size} | {blocks} | {r['plan']:.3f} | {r['commit']:.3f} | {r['open']:.3f} | "
                     f"{r['save']:.3f} | {int(r['record_bytes'])} | {r['record_bytes'] / blocks:.1f} |")
    return "\n".join(lines)


def _mpiexec() -> str | None:
    return shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")


def _worker(n: int, *args: str) -> dict[str, Any]:
    mpiexec = _mpiexec()
    assert mpiexec, "mpiexec not found: pip install 'ckpt-numpy[mpi]'"
    proc = subprocess.run([mpiexec, "-n", str(n), sys.executable, WORKER, *args], capture_output=True, text=True,
                          timeout=600)
    if proc.returncode:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _dcp(n: int, directory: str, total: int, reps: int, disk: bool) -> dict[str, Any] | None:
    """torch.distributed.checkpoint on ``n`` processes (gloo), or None when torch is not installed."""
    try:
        import torch.distributed.checkpoint  # noqa: F401 - only to know whether the peer can run
    except ImportError:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.dcp_worker", str(r), str(n), str(port), directory,
                               str(total), str(reps), "1" if disk else "0"], cwd=root, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(n)]
    outs = [p.communicate(timeout=900) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("".join(err[-2000:] for _, err in outs))
    return json.loads(outs[0][0].strip().splitlines()[-1])  # type: ignore[no-any-return]


def _raw(directory: str, total: int, disk: bool) -> tuple[float, float]:
    """Seconds to write (and fsync) then read ``total`` bytes with plain os calls."""
    data = np.random.default_rng(0).bytes(64 << 20)
    path = os.path.join(directory, "raw.bin")
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for _ in range(total // len(data)):
        os.write(fd, data)
    os.fsync(fd)
    os.close(fd)
    write = time.perf_counter() - start
    if disk:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    buf = bytearray(len(data))
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    read = time.perf_counter() - start
    os.unlink(path)
    return write, read


def sharded_case(directories: list[tuple[str, str]], size_gib: float, reps: int) -> str:
    total = int(size_gib * GiB)
    lines = []
    for label, base in directories:
        directory = os.path.join(base, f"ckpt-bench-sharded-{os.getpid()}")
        os.makedirs(directory, exist_ok=True)
        disk = label == "disk"
        try:
            raw_w, raw_r = _raw(directory, total, disk)
            lines += [f"**Sharded checkpoints, {label}: {total / GiB:.2f} GiB global model (64 float32 tensors "
                      f"split by rows), median of {reps}**", "",
                      "| writer | save s | save GiB/s | restore s | restore GiB/s |", "|---|---|---|---|---|",
                      f"| raw write{'+fsync' if disk else ''} / read | {raw_w:.2f} | {total / GiB / raw_w:.2f} | "
                      f"{raw_r:.2f} | {total / GiB / raw_r:.2f} |"]
            for n in (0, 1, 2, 4):  # 0: the single-process Saver (no comm)
                r = _worker(max(n, 1), "throughput", directory, str(total), str(reps), "1" if disk else "0",
                            "plain" if n == 0 else "sharded")
                name = "Saver, one process (single file)" if n == 0 else f"Saver(comm=), {n} process{'es' * (n > 1)}"
                lines.append(f"| {name} | {r['save']:.2f} | {total / GiB / r['save']:.2f} | {r['restore']:.2f} | "
                             f"{total / GiB / r['restore']:.2f} |")
            for n in (1, 2, 4):
                peer = _dcp(n, directory, total, reps, disk)
                if peer is None:
                    lines.append("| torch.distributed.checkpoint | (torch not installed) | | | |")
                    break
                lines.append(f"| torch.distributed.checkpoint, {n} process{'es' * (n > 1)} | {peer['save']:.2f} | "
                             f"{total / GiB / peer['save']:.2f} | {peer['restore']:.2f} | "
                             f"{total / GiB / peer['restore']:.2f} |")
            block = sharded.BLOCK_BYTES
            lines.append("")
            for source, what in (("sharded", "written by 4 ranks"), ("single", "one single-file checkpoint")):
                r = _worker(4, "reshard", directory, str(total), "3", "1" if disk else "0", source)
                lines += [f"4 -> 3 resharding restore ({label}; source: {what}): {r['seconds']:.2f} s. Per rank: "
                          "bytes read / bytes needed, and read / target (1.05 x needed + one 1 MiB checksum block "
                          f"per contiguous range: {TENSORS} ranges, one per tensor): " +
                          ", ".join(f"{a / b:.4f} and {a / (1.05 * b + TENSORS * block):.3f} ({a} / {b})"
                                    for a, b in r["ratios"]), ""]
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    return "\n".join(lines)
