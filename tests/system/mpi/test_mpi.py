"""Sharded checkpoints across real processes: mpiexec (from the mpich wheel) runs mpi_child.py.

Every run is bounded by a timeout; each rank reports in a JSON file the test reads back.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

import ckpt
from ckpt import distributed
from ckpt.formats import ckpt_sharded as sharded
from ckpt.saving.incremental import chunked_format, references_at
from conftest import assert_bit_exact, TESTS
from distributed_support import global_tensors

pytest.importorskip("mpi4py", reason="the mpi extra (mpi4py, mpich) is not installed")

CHILD = os.path.join(TESTS, "mpi_child.py")
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
BLOCK = sharded.BLOCK_BYTES


SHM_SEGMENTS = "/dev/shm/mpich_shm_*"


def _remove_leaked_segments(before: set[str]) -> None:
    """Unlink the shared-memory segments mpich made since ``before`` that no live process maps: a
    rank killed on purpose never unlinks its node's segment (3 MiB in /dev/shm, each, for good)."""
    new = set(glob.glob(SHM_SEGMENTS)) - before
    for maps in glob.glob("/proc/[0-9]*/maps") if new else ():
        try:
            with open(maps) as f:
                text = f.read()
        except OSError:  # the process ended meanwhile
            continue
        new = {path for path in new if path not in text}  # still mapped: another job's, in use
    for path in new:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def mpirun(n: int, mode: str, out: str, *args: str, expect_ok: bool = True) -> list[dict]:
    """Run mpi_child.py on ``n`` processes; return each rank's report (None where it wrote none)."""
    assert MPIEXEC, "mpiexec not found (pip install mpich)"
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):
        if name.startswith("result-"):  # (and a .tmp a killed rank left)
            os.unlink(os.path.join(out, name))
    segments = set(glob.glob(SHM_SEGMENTS))
    try:
        proc = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, CHILD, mode, out, *args],
                              capture_output=True, text=True, timeout=90)
    finally:
        _remove_leaked_segments(segments)
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = []
    for rank in range(n):
        path = os.path.join(out, f"result-{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
        else:
            results.append(None)
    return results


LAYOUTS = {1: ("rows", ".msgpack"), 2: ("cols", ".h5"), 3: ("uneven", ".msgpack"), 4: ("rows", ".h5")}


BIG = np.arange(2000 * 300, dtype=np.float32).reshape(2000, 300)  # mpi_child.BIG: several checksum blocks


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{N: directory}: checkpoints written by 1, 2, 3 and 4 processes (rows, columns, uneven with an empty block):
    one mpiexec of 4 processes, whose first N save through a sub-communicator, for each N; and
    (N = 0) an ordinary single-file checkpoint of the same tensors, written by this process."""
    root = tmp_path_factory.mktemp("mpi")
    out = {0: str(root / "n0")}
    whole = {**global_tensors(), "big": BIG}
    plain = {key: ckpt.Variable(value, name=f"v{i}", dtype=value.dtype) for i, (key, value) in enumerate(whole.items())}
    ckpt.Saver({**plain, "step": ckpt.Variable(np.int64(42), name="step")}).save(out[0] + "/model.h5", global_step=7)
    for n in LAYOUTS:
        os.makedirs(root / f"n{n}")
        out[n] = str(root / f"n{n}")
    results = mpirun(4, "save", str(root / "out"), str(root), "7",
                     *(f"{n}:{kind}:{ext}" for n, (kind, ext) in LAYOUTS.items()))
    for n in LAYOUTS:
        paths = {r["paths"][str(n)] for r in results[:n]}
        assert len(paths) == 1, results  # every rank returns the checkpoint's one name
        assert all(str(n) not in r["paths"] for r in results[n:])
    return root, out


RESTORES = [(1, "rows"), (2, "rows"), (3, "rows"), (4, "cols")]


@pytest.fixture(scope="module")
def restored(saved):
    """Every checkpoint of ``saved`` restored on M = 1..4 processes: one mpiexec of 4."""
    root, directories = saved
    return mpirun(4, "restore", str(root / "out"), *(f"{m}:{kind}" for m, kind in RESTORES), "--",
                  *directories.values())


@pytest.mark.parametrize("m,kind", RESTORES)
def test_restore_any_n_on_m_processes(saved, restored, m, kind):
    _, directories = saved
    assert all(str(m) not in report["by_m"] for report in restored[m:])
    for rank, report in enumerate(restored[:m]):
        for n, result in zip(directories, report["by_m"][str(m)]):
            assert result["wrong"] == [], (n, m, rank, result)
            assert result["step"] == 42
            if kind == "rows":  # bytes read for the big tensor: what the rank needs plus checksum-block edges
                pieces = n if n > 1 else 1
                slack = 2 * BLOCK * pieces + 64 * 1024  # + the small tensors
                assert result["bytes_read"] <= result["big_needed"] * 1.05 + slack, (n, m, rank, result)
                if n == 0 and m > 1:  # the single file (n = 0): its block checksums spare reading BIG whole
                    assert 0 < result["bytes_read"] < BIG.nbytes, (m, rank, result)


def test_sharded_checkpoints_read_in_one_plain_process(saved):
    _, directories = saved
    tensors = global_tensors()
    for directory in directories.values():
        path = ckpt.latest_checkpoint(directory)
        with ckpt.load_checkpoint(path) as reader:
            for key, value in tensors.items():
                assert_bit_exact(value, reader.get_tensor(key))
            assert reader.verify() == []


@pytest.mark.parametrize("phase,steps", [
    ("plan", {1}), ("verdict", {1}), ("write", {1}), ("report", {1}), ("before-commit", {1}),
    ("after-commit", {2}),  # committed: the state file names it pending, so it is the latest
    ("outcome", {1, 2})])  # rank 0 commits while mpiexec tears the job down: either is whole
def test_a_rank_killed_at_each_phase_of_a_save(tmp_path, phase, steps):
    directory = str(tmp_path / "ckpts")
    os.makedirs(directory)
    results = mpirun(3, "kill", str(tmp_path / "out"), directory, phase, expect_ok=False)
    assert results[0] is not None and results[0]["saved"] >= 1
    latest = ckpt.latest_checkpoint(directory)
    assert latest is not None and latest.endswith(tuple(f"model-{s}.msgpack" for s in steps)), latest
    latest_step = int(latest.rsplit("-", 1)[1].split(".")[0])
    tensors = global_tensors()
    with ckpt.load_checkpoint(directory) as reader:
        for key, value in tensors.items():
            assert_bit_exact(value, reader.get_tensor(key))
        assert int(reader.get_tensor("step")) == (42 if latest_step == 1 else 43)
    # the next save removes what the killed one left behind
    saver = ckpt.Saver({"v": ckpt.Variable(1.0, name="v")}, comm=distributed.local())
    saver.save(os.path.join(directory, "model.msgpack"), global_step=3)
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isdir(path):
            assert sharded.is_sharded(path), (phase, name, os.listdir(path))
            with sharded.ShardedReader(path) as reader:
                listed = {f for f, _ in reader.files}
            assert set(os.listdir(path)) == listed | {"COMMIT"}, (phase, os.listdir(path))


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    """One mpiexec of 3 running mpi_child.SCENARIOS one after another; (root, each rank's results)."""
    root = tmp_path_factory.mktemp("scenarios")
    return root, mpirun(3, "scenarios", str(root / "out"), str(root))


def test_a_first_async_save_failing_on_one_rank_fails_on_every_rank(scenarios):
    """The failure comes before the communicator's (untimed) Dup: no rank waits in it for ever."""
    root, results = scenarios[0] / "async", [r["async"] for r in scenarios[1]]
    assert results[1]["first"]["type"] == "InvalidMetadataError"  # rank 1's own error, as a blocking save raises it
    for report in (results[0], results[2]):
        assert report["first"]["type"] == "CheckpointWriteError"
        assert "did not start, it failed on rank 1: InvalidMetadataError" in report["first"]["error"]
    assert not os.path.exists(root / "model-4.h5")


def test_a_later_async_save_failing_on_one_rank_fails_on_every_rank_at_once(scenarios):
    root, results = scenarios[0] / "async", [r["async"] for r in scenarios[1]]
    assert results[1]["later"]["type"] == "InvalidMetadataError"  # rank 1's own error, raised by its save call
    for report in (results[0], results[2]):
        assert report["later"]["type"] == "CheckpointWriteError"
        assert "the sharded save failed on rank 1: InvalidMetadataError" in report["later"]["error"]
    assert not os.path.exists(root / "model-6.h5")
    assert ckpt.latest_checkpoint(str(root)) == str(root / "model-5.h5")


def test_asynchronous_save_on_a_duplicated_communicator(scenarios):
    results = [r["async"] for r in scenarios[1]]
    assert len({r["path"] for r in results}) == 1
    with ckpt.load_checkpoint(results[0]["path"]) as reader:  # the values of the save call, not the zeros
        for key, value in global_tensors().items():
            assert_bit_exact(value, reader.get_tensor(key))
        assert int(reader.get_tensor("step")) == 42


def test_ranks_that_disagree_all_raise(scenarios):
    root, results = scenarios[0] / "disagree", [r["disagree"] for r in scenarios[1]]
    for report in results:
        assert report["dtypes"]["type"] == "MismatchError"
        assert "float32 on ranks 0, 1; float64 on rank 2" in report["dtypes"]["error"]
        assert report["replicated"]["type"] == "MismatchError"
        assert "bias: replicated (no Shard), but the ranks hold different values" in report["replicated"]["error"]
        assert "on ranks 0, 1; " in report["replicated"]["error"]
    assert os.listdir(root) == []


def test_a_blocking_save_failing_on_one_rank_before_it_starts_fails_on_every_rank_at_once(scenarios):
    """Rank 1 takes part in the save's first exchange with its error: the others raise it at once
    (with a 30 s timeout they would say "did not complete within 30 s"), and the next save works."""
    root, results = scenarios[0] / "blocking-failure", [r["blocking-failure"] for r in scenarios[1]]
    assert results[1]["failed"]["type"] == "InvalidMetadataError" and "metadata key 'bad'" in results[1]["failed"]["error"]
    for report in (results[0], results[2]):
        assert report["failed"]["type"] == "CheckpointWriteError"
        assert "the sharded save failed on rank 1: InvalidMetadataError" in report["failed"]["error"]
        assert "nothing was written" in report["failed"]["error"]
    assert {r["path"] for r in results} == {str(root / "model-2.msgpack")}
    assert not os.path.exists(root / "model-1.msgpack")
    assert ckpt.latest_checkpoint(str(root)) == str(root / "model-2.msgpack")


def test_a_missing_rank_times_out(tmp_path):
    results = mpirun(3, "timeout", str(tmp_path / "out"), str(tmp_path), expect_ok=False)
    for report in results[:2]:
        assert report["type"] == "CheckpointWriteError"
        assert "did not complete within 1 s" in report["error"]
        assert report["dup"]["type"] == "CollectiveTimeoutError"  # dup(timeout=) does not hang
        assert "duplicating the communicator (Idup) did not complete within 1 s" in report["dup"]["error"]
    assert results[2] == {"absent": True}
    assert ckpt.latest_checkpoint(str(tmp_path)) is None


def test_a_preemption_signal_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """PreemptionGuard(comm=): rank 1 alone gets SIGUSR1 at step 3; every rank sees it at step 3's
    check and takes part in the asynchronous save, committed before the guard lets go."""
    results = mpirun(3, "preempt", str(tmp_path / "out"), str(tmp_path))
    assert [r["step"] for r in results] == [3, 3, 3]
    assert [r["signal"] for r in results] == [None, int(signal.SIGUSR1), None]
    latest = ckpt.latest_checkpoint(str(tmp_path))
    assert latest is not None and latest.endswith("model-3.msgpack")
    np.testing.assert_array_equal(ckpt.load_variable(latest, "w"), np.full((12, 3), 3, np.float32))



def test_async_save_runs_its_collectives_beside_the_training_loops(scenarios):
    """save(blocking=False) with comm=: every rank changes its variables and runs MPI collectives on
    COMM_WORLD while the save's collectives run in a thread on a duplicated communicator."""
    directory, results = scenarios[0] / "async-world", [r["async-world"] for r in scenarios[1]]
    assert {r["path"] for r in results} == {str(directory / "model-3.h5")}
    assert all(r["sums_ok"] for r in results)
    expected = {**global_tensors(), "big": BIG}
    with ckpt.load_checkpoint(str(directory / "model-3.h5")) as reader:
        for key, value in expected.items():
            assert_bit_exact(value, reader.get_tensor(key))
        assert int(reader.get_tensor("step")) == 42


def test_incremental_saves_on_three_processes_restore_on_two(tmp_path):
    """mpiexec -n 3: Saver(comm=, incremental=True, compression="zstd") saves three steps (max_to_keep=2); the third
    writes no chunk (nothing changed since the second) and rank 0's collection leaves exactly the files
    the kept steps reference; 2 processes restore the latest bit-exactly."""
    directory = str(tmp_path / "run")
    os.makedirs(directory)
    results = mpirun(3, "incremental", str(tmp_path / "out"), directory)
    assert len({r["path"] for r in results}) == 1, results
    first, second, third = ([r["stats"][i] for r in results] for i in range(3))
    assert sum(s[0] for s in first) > 0 and sum(s[0] for s in second) > 0  # 'emb' changed back
    assert sum(s[1] for s in third) == 0  # nothing changed: every chunk reused
    kept = sorted(n for n in os.listdir(directory) if n.startswith("model-"))
    assert kept == ["model-2.msgpack", "model-3.msgpack"]
    fmt = chunked_format()  # step 1's packs hold chunks step 2 still reads: kept, nothing else
    wanted = set().union(*(references_at(fmt, os.path.join(directory, n)) or set() for n in kept))
    assert set(os.listdir(os.path.join(directory, ".ckpt-chunks"))) == {f.hex() for f in wanted}
    with ckpt.load_checkpoint(os.path.join(directory, kept[-1])) as reader:
        assert reader.verify() == []
    restored = mpirun(2, "restore", str(tmp_path / "out"), "2:cols", "--", directory)
    for rank in range(2):
        (result,) = restored[rank]["by_m"]["2"]
        assert result["wrong"] == [] and result["step"] == 42, result
