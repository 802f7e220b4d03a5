"""One rank of the torch.distributed.checkpoint peer row, started by benchmarks/distributed.py
(only when torch is installed; torch is never a ckpt dependency).

    python dcp_worker.py RANK SIZE PORT DIR TOTAL_BYTES REPS DISK

Each rank holds its row blocks of the same 64-tensor model as mpi_worker.py, as plain torch
tensors under rank-specific keys, and saves and loads them with DCP's default file-system
writer (which fsyncs, like ckpt). Rank 0 prints one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time

import numpy as np


def main() -> None:
    rank, size, port, directory, total, reps, disk = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                                      int(sys.argv[5]), int(sys.argv[6]), sys.argv[7] == "1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from .mpi_worker import COLS, TENSORS, evict

    dist.init_process_group("gloo", rank=rank, world_size=size)
    rows = np.array_split(np.arange(total // TENSORS // 4 // COLS), size)[rank]
    state = {f"layer{i:02d}/w.rank{rank}": torch.randn(len(rows), COLS) for i in range(TENSORS)}
    saves, loads = [], []
    for rep in range(reps):
        path = os.path.join(directory, f"dcp{rep}")
        dist.barrier()
        start = time.perf_counter()
        dcp.save(state, checkpoint_id=path)
        dist.barrier()
        saves.append(time.perf_counter() - start)
        if disk and rank == 0:
            evict(path)
        dist.barrier()
        start = time.perf_counter()
        dcp.load(state, checkpoint_id=path)
        dist.barrier()
        loads.append(time.perf_counter() - start)
        if rank == 0:
            shutil.rmtree(path)
    if rank == 0:
        print(json.dumps({"save": statistics.median(saves), "restore": statistics.median(loads)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
