"""One rank of a multi-process test, started by test_mpi.py under ``mpiexec -n N``.

    python mpi_child.py MODE OUT_DIR ARGS...

Each rank writes what it saw to OUT_DIR/result-<rank>.json; the test asserts on those files.
Modes: save ROOT STEP N:KIND:EXT... (one launch of max N processes: the first N of them save into
ROOT/n<N> through a sub-communicator, for each N) | restore M:KIND... -- DIR... (likewise: the
first M ranks restore every DIR) | incremental DIR | kill DIR PHASE | scenarios ROOT (async saves, async saves
beside training's collectives on COMM_WORLD, ranks that disagree, a blocking save failing on one
rank: see SCENARIOS) | preempt DIR | timeout DIR.
DIR and ROOT may be object-store URLs (s3://...; the store's settings come from the environment).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ckpt
from ckpt import distributed
from ckpt.formats import ckpt_sharded as sharded
from distributed_support import global_tensors, layout, make_variables

MODE, OUT = sys.argv[1], sys.argv[2]
ARGS = sys.argv[3:]
BIG = np.arange(2000 * 300, dtype=np.float32).reshape(2000, 300)  # 2.4 MB: several checksum blocks


def tensors() -> dict[str, np.ndarray]:
    out = global_tensors()
    out["big"] = BIG
    return out


def report(comm: distributed.Communicator, result: dict) -> None:
    """Write this rank's result atomically: mpiexec may kill the rank at any moment."""
    path = os.path.join(OUT, f"result-{comm.rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def first_ranks(world: distributed.Communicator, n: int) -> distributed.Communicator | None:
    """A communicator of world's first ``n`` ranks (None on the others); collective over world."""
    from mpi4py import MPI

    sub = MPI.COMM_WORLD.Split(0 if world.rank < n else MPI.UNDEFINED, world.rank)
    return None if sub == MPI.COMM_NULL else distributed.mpi(sub)


def restore_all(comm: distributed.Communicator, kind: str, directories: list[str], read: list[int]) -> list[dict]:
    """Restore each checkpoint directory into ``kind`` blocks; what was wrong and what was read."""
    results = []
    for directory in directories:
        variables = make_variables(tensors(), kind, comm.rank, comm.size, zero=True)
        del read[:]
        ckpt.Saver(variables, comm=comm, timeout=30).restore(directory)
        wrong = []
        for key, value in tensors().items():
            offset, block = layout(kind, value.shape, comm.rank, comm.size)
            want = value[tuple(slice(o, o + b) for o, b in zip(offset, block))]
            got = np.asarray(variables[key].numpy()).reshape(block)
            if want.dtype != got.dtype or (want.tobytes() if want.dtype.kind != "O" else want.tolist()) != \
                    (got.tobytes() if got.dtype.kind != "O" else got.tolist()):
                wrong.append(key)
        offset, block = layout(kind, BIG.shape, comm.rank, comm.size)
        results.append({"wrong": wrong, "step": int(variables["step"].numpy()), "bytes_read": sum(read),
                        "big_needed": int(np.prod(block)) * 4})
    return results


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillAt:
    """A communicator that SIGKILLs this process before its ``at``-th collective."""

    def __init__(self, comm: distributed.Communicator, at: int) -> None:
        self.comm, self.at, self.calls = comm, at, 0
        self.rank, self.size = comm.rank, comm.size

    def _tick(self) -> None:
        if self.calls == self.at:
            die()
        self.calls += 1

    def barrier(self, timeout: float) -> None:
        self._tick()
        self.comm.barrier(timeout)

    def allgather(self, data: bytes, timeout: float) -> list[bytes]:
        self._tick()
        return self.comm.allgather(data, timeout)

    def broadcast(self, data: bytes | None, root: int, timeout: float) -> bytes:
        self._tick()
        return self.comm.broadcast(data, root, timeout)

    def dup(self) -> KillAt:
        return self


def async_saves(comm: distributed.Communicator, directory: str) -> dict:
    """A first save(blocking=False) that fails on rank 1 only, then one that succeeds while
    training changes the variables and runs a collective on its own communicator."""
    variables = make_variables(tensors(), "cols", comm.rank, comm.size)
    saver = ckpt.Saver(variables, comm=comm, timeout=30)
    # issue 14's bug: a first asynchronous save failing on one rank before the communicator's Dup
    # (metadata only rank 1 cannot store) left the others in Dup for ever; now every rank raises
    try:
        saver.save(os.path.join(directory, "model.h5"), global_step=4, blocking=False,
                   metadata={"bad": object()} if comm.rank == 1 else None).result(timeout=60)
        first = None
    except Exception as exc:
        first = {"type": type(exc).__name__, "error": str(exc)}
    future = saver.save(os.path.join(directory, "model.h5"), global_step=5, blocking=False)
    for var in variables.values():  # training goes on while the background thread saves
        if var.dtype.kind != "O":
            var.assign(np.zeros(var.shape, var.dtype))
    comm.barrier(30)  # the training communicator keeps working beside the save's own duplicate
    path = future.result(timeout=60)
    # a later save failing on rank 1 alone: the others' futures raise its error at once, not
    # after the 30 s timeout (the error would then say "did not complete within 30 s")
    try:
        saver.save(os.path.join(directory, "model.h5"), global_step=6, blocking=False,
                   metadata={"bad": object()} if comm.rank == 1 else None).result(timeout=60)
        later = None
    except Exception as exc:
        later = {"type": type(exc).__name__, "error": str(exc)}
    return {"path": path, "first": first, "later": later}


def async_world(comm: distributed.Communicator, directory: str) -> dict:
    """save(blocking=False), then training's own collectives on COMM_WORLD during the save."""
    from mpi4py import MPI

    variables = make_variables(tensors(), "rows", comm.rank, comm.size)
    saver = ckpt.Saver(variables, comm=comm, timeout=30)
    future = saver.save(os.path.join(directory, "model.h5"), global_step=3, blocking=False)
    for var in variables.values():
        var.assign(np.full(var.shape, b"x", dtype=object) if var.dtype.kind == "O" else np.ones(var.shape, var.dtype))
    sums = [MPI.COMM_WORLD.allreduce(i + comm.rank) for i in range(50)]  # training's own collectives
    return {"path": future.result(), "sums_ok": sums[-1] == 49 * comm.size + sum(range(comm.size))}


def disagree(comm: distributed.Communicator, directory: str) -> dict:
    """Rank 2 holds a float64 block of a float32 tensor, then (a second save) a replicated value
    of its own: every rank raises before writing, both times."""
    v = ckpt.Variable(np.zeros(2, np.float64 if comm.rank == 2 else np.float32), name="w",
                      shard=ckpt.Shard((2 * comm.size,), (2 * comm.rank,)))
    bias = ckpt.Variable(np.arange(3.0) + (comm.rank == 2), name="bias")
    out: dict = {}
    for name, variables in (("dtypes", [v]), ("replicated", [bias])):
        try:
            ckpt.Saver(variables, comm=comm, timeout=30).save(os.path.join(directory, "model.h5"))
            out[name] = {"error": None}
        except ckpt.CheckpointError as exc:
            out[name] = {"error": str(exc), "type": type(exc).__name__}
    return out


def blocking_failure(comm: distributed.Communicator, directory: str) -> dict:
    """A blocking save failing on rank 1 before it starts (metadata it cannot store), then one that
    works: the others raise rank 1's error at once, not "did not complete within 30 s"."""
    saver = ckpt.Saver(make_variables(tensors(), "rows", comm.rank, comm.size), comm=comm, timeout=30)
    try:
        saver.save(os.path.join(directory, "model.msgpack"), global_step=1,
                   metadata={"bad": object()} if comm.rank == 1 else None)
        failed = None
    except Exception as exc:
        failed = {"type": type(exc).__name__, "error": str(exc)}
    return {"failed": failed, "path": saver.save(os.path.join(directory, "model.msgpack"), global_step=2)}


#: Scenarios the "scenarios" mode runs one after another in one launch, each in ROOT/<name>.
SCENARIOS = {"async": async_saves, "async-world": async_world, "disagree": disagree,
             "blocking-failure": blocking_failure}


def main() -> None:
    comm = distributed.mpi()
    if MODE == "save":
        root, step, *specs = ARGS
        paths = {}
        for spec in specs:
            n, kind, ext = spec.split(":")
            sub = first_ranks(comm, int(n))
            if sub is not None:
                saver = ckpt.Saver(make_variables(tensors(), kind, sub.rank, sub.size), comm=sub, timeout=30)
                paths[n] = saver.save(os.path.join(root, f"n{n}", "model" + ext), global_step=int(step))
        report(comm, {"paths": paths})
    elif MODE == "restore":
        split = ARGS.index("--")
        specs, directories = ARGS[:split], ARGS[split + 1:]
        from ckpt.formats import hdf5, msgpack

        read: list[int] = []
        for cls in (sharded.ShardedReader, msgpack.MsgpackReader, hdf5.Hdf5Reader):  # single-file sources too
            def counting_close(self: object, close: object = cls.close) -> None:
                read.append(self.bytes_read)  # (a shard file's own reader reads nothing itself: 0)
                close(self)

            cls.close = counting_close  # type: ignore[method-assign]
        by_m = {}
        for spec in specs:
            m, kind = spec.split(":")
            sub = first_ranks(comm, int(m))
            if sub is not None:
                by_m[m] = restore_all(sub, kind, directories, read)
        report(comm, {"by_m": by_m})
    elif MODE == "kill":
        directory, phase = ARGS
        variables = make_variables(tensors(), "rows", comm.rank, comm.size)
        ckpt.Saver(variables, comm=comm, timeout=30).save(os.path.join(directory, "model.msgpack"), global_step=1)
        report(comm, {"saved": 1})
        variables["step"].assign(43)
        victim = KillAt(comm, {"plan": 0, "verdict": 1, "report": 2, "outcome": 3}.get(phase, -1))
        if phase == "write" and comm.rank == 1:
            from ckpt.formats import msgpack

            count = [0]
            real = msgpack.materialize

            def materialize(source: object) -> np.ndarray:
                count[0] += 1
                if count[0] == 3:  # part of the file written
                    die()
                return real(source)

            msgpack.materialize = materialize  # type: ignore[assignment]
        if phase in ("before-commit", "after-commit") and comm.rank == 0:
            real_commit = sharded.write_commit

            def write_commit(*args: object) -> None:
                if phase == "before-commit":
                    die()
                real_commit(*args)  # type: ignore[arg-type]
                die()

            sharded.write_commit = write_commit  # type: ignore[assignment]
        if phase == "before-record" and comm.rank == 0:  # an object store: the sharded COMMIT is up,
            from ckpt.storage import remote as _remote  # the commit record naming it is not

            def publish(*args: object) -> None:
                die()

            _remote.RemoteDirectory.publish = publish  # type: ignore[assignment, method-assign]
        comm_used = victim if (comm.rank == 1 and phase in ("plan", "verdict", "report", "outcome")) else comm
        # the survivors of a killed rank 0 wait out the timeout (mpiexec does not stop them): keep it short;
        # a save that times out before its kill still leaves model-1 the latest, as the test expects
        ckpt.Saver(variables, comm=comm_used, timeout=5).save(os.path.join(directory, "model.msgpack"),
                                                              global_step=2)
        report(comm, {"saved": 2})
    elif MODE == "incremental":  # three incremental saves (compressed), 'emb' changed only for the first
        directory, = ARGS
        variables = make_variables(tensors(), "rows", comm.rank, comm.size)
        original = variables["emb"].numpy().copy()
        saver = ckpt.Saver(variables, comm=comm, timeout=30, incremental=True, chunk_bytes=4096, max_to_keep=2,
                           compression="zstd")
        stats = []
        for step in (1, 2, 3):
            variables["emb"].assign(original + (1 if step == 1 else 0))
            path = saver.save(os.path.join(directory, "model.msgpack"), global_step=step)
            last = saver.last_incremental
            stats.append([last.chunks_written, last.bytes_written, last.chunks_reused, last.chunks_collected])
        report(comm, {"path": path, "stats": stats})
    elif MODE == "scenarios":
        root, = ARGS
        results = {}
        for name, scenario in SCENARIOS.items():
            directory = os.path.join(root, name)
            if comm.rank == 0:
                os.makedirs(directory)
            comm.barrier(30)
            results[name] = scenario(comm, directory)
        report(comm, results)
    elif MODE == "preempt":  # rank 1 alone is signalled at step 3; every rank must save step 3
        directory, = ARGS
        w = ckpt.Variable(np.zeros((4, 3), np.float32), name="w", shard=ckpt.Shard((4 * comm.size, 3), (4 * comm.rank, 0)))
        saver = ckpt.Saver([w], comm=comm, timeout=30)
        with ckpt.PreemptionGuard(comm=comm, timeout=30) as guard:
            for step in range(1, 100):
                w.assign_add(np.ones((4, 3), np.float32))
                if comm.rank == 1 and step == 3:
                    os.kill(os.getpid(), signal.SIGUSR1)
                if guard.requested:
                    saver.save(os.path.join(directory, "model.msgpack"), global_step=step, blocking=False)
                    break
        report(comm, {"step": step, "signal": guard.signal})
    elif MODE == "timeout":
        directory, = ARGS
        spare = distributed.mpi()  # (every rank) for the dup the last rank never joins
        if comm.rank == comm.size - 1:
            time.sleep(3)  # never calls save, nor dup
            report(comm, {"absent": True})
        else:
            v = ckpt.Variable(np.zeros(2), name="w")
            try:
                ckpt.Saver([v], comm=comm, timeout=1).save(os.path.join(directory, "model.h5"))
                result = {"error": None}
            except ckpt.CheckpointError as exc:
                result = {"error": str(exc), "type": type(exc).__name__}
            try:  # MPI's Idup polled against the timeout, where Dup would wait for ever
                spare.dup(timeout=1)
                result["dup"] = None
            except ckpt.CheckpointError as exc:
                result["dup"] = {"error": str(exc), "type": type(exc).__name__}
            report(comm, result)
        deadline = time.monotonic() + 20  # exit only once every rank has reported: mpiexec kills the
        while time.monotonic() < deadline and not all(  # others when the first process leaves without
                os.path.exists(os.path.join(OUT, f"result-{r}.json")) for r in range(comm.size)):  # finalizing
            time.sleep(0.05)
        sys.stdout.flush()
        os._exit(0)  # MPI_Finalize would wait for the collective the absent rank never joined
    else:
        raise SystemExit(f"unknown mode {MODE}")


if __name__ == "__main__":
    main()
