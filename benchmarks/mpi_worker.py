"""One rank of the sharded benchmarks (started by benchmarks/distributed.py under mpiexec).

    throughput DIR TOTAL_BYTES REPS DISK plain|sharded
    reshard DIR TOTAL_BYTES M DISK sharded|single   (the source: saved by every rank, or one file)

Rank 0 prints one JSON line with the results.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from typing import Any

import numpy as np

import ckpt
from ckpt import distributed
from ckpt.formats import ckpt_sharded as sharded
from ckpt.formats import hdf5, msgpack

TENSORS, COLS = 64, 1024


def variables(total: int, rank: int, size: int, zero: bool = False, plain: bool = False) -> dict[str, ckpt.Variable]:
    rows = total // TENSORS // 4 // COLS
    out = {}
    rng = np.random.default_rng(rank)
    for i in range(TENSORS):
        part = np.array_split(np.arange(rows), size)[rank]
        value = np.zeros((len(part), COLS), np.float32) if zero else rng.standard_normal((len(part), COLS),
                                                                                          dtype=np.float32)
        shard = None if plain else ckpt.Shard((rows, COLS), (int(part[0]), 0))
        out[f"layer{i:02d}/w"] = ckpt.Variable(value, name=f"w{i}", shard=shard)
    return out


def evict(path: str) -> None:
    """Drop a checkpoint's files from the page cache, so restores read the disk."""
    files = [os.path.join(path, n) for n in os.listdir(path)] if os.path.isdir(path) else [path]
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    mode, directory, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
    world = distributed.mpi()
    if mode == "throughput":
        reps, disk, kind = int(sys.argv[4]), sys.argv[5] == "1", sys.argv[6]
        plain = kind == "plain"
        model = variables(total, world.rank, world.size, plain=plain)
        saver = ckpt.Saver(model, max_to_keep=None) if plain else ckpt.Saver(model, comm=world, max_to_keep=None)
        saves, restores = [], []
        for rep in range(reps):
            target = os.path.join(directory, f"rep{rep}", "model.msgpack")
            if world.rank == 0:
                os.makedirs(os.path.dirname(target))
            world.barrier(60)
            start = time.perf_counter()
            path = saver.save(target)
            world.barrier(600)
            saves.append(time.perf_counter() - start)
            if disk and world.rank == 0:
                evict(path)
            world.barrier(600)
            start = time.perf_counter()
            saver.restore(path)
            world.barrier(600)
            restores.append(time.perf_counter() - start)
            if world.rank == 0:
                shutil.rmtree(os.path.dirname(target))
        if world.rank == 0:
            print(json.dumps({"save": statistics.median(saves), "restore": statistics.median(restores)}))
    elif mode == "reshard":
        m, disk, source = int(sys.argv[4]), sys.argv[5] == "1", sys.argv[6]
        path = os.path.join(directory, "reshard.msgpack")
        if source == "sharded":
            ckpt.Saver(variables(total, world.rank, world.size), comm=world, max_to_keep=None).save(path)
        elif world.rank == 0:  # one ordinary single-file checkpoint of the whole model
            ckpt.Saver(variables(total, 0, 1, plain=True), max_to_keep=None).save(path)
        world.barrier(600)
        if disk and world.rank == 0:
            evict(path)
        from mpi4py import MPI

        sub = MPI.COMM_WORLD.Split(0 if world.rank < m else MPI.UNDEFINED, world.rank)
        ratios = []
        if sub != MPI.COMM_NULL:
            comm = distributed.mpi(sub)
            read: list[int] = []
            for cls in (sharded.ShardedReader, msgpack.MsgpackReader, hdf5.Hdf5Reader):
                def counting_close(self: Any, close: Any = cls.close) -> None:
                    read.append(self.bytes_read)  # (a shard file's own reader counts nothing: 0)
                    close(self)

                cls.close = counting_close  # type: ignore[method-assign]
            model = variables(total, comm.rank, comm.size, zero=True)
            comm.barrier(60)
            start = time.perf_counter()
            ckpt.Saver(model, comm=comm).restore(path)
            comm.barrier(600)
            seconds = time.perf_counter() - start
            needed = sum(v.numpy().nbytes for v in model.values())
            got = comm.allgather(json.dumps([sum(read), needed]).encode(), 60)
            ratios = [json.loads(g) for g in got]
            if comm.rank == 0:
                print(json.dumps({"seconds": seconds, "ratios": ratios}))
        world.barrier(600)
        if world.rank == 0:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
