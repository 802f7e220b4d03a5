"""Crash and fault safety of incremental saves to S3 at every store call (moto).

A child (tests/reliability_child.py's zygote) makes three incremental saves with
``max_to_keep=2`` into an ``s3://`` directory whose latest checkpoint is step 0, and at its k-th
store call that changes objects (chunk PUTs, lease compare-and-swaps, the commit's uploads,
retention's and collection's deletes) either ends itself (a kill) or gets the StorageError a
failed request becomes and goes on with its other saves (a fault), for k = 1, 2, ... until the
saves complete first. The child stamps its chunk leases ``CLOCK_BEHIND`` seconds in the past, as
if the parent resumed that long after the crash: the holds and collect leases the child left are
older than the parent's ``ckpt_grace`` (``GRACE``, passed through storage_options), so no test
waits for one to expire. After each: every kept checkpoint verifies (no missing or damaged
chunk), ``latest_checkpoint`` is the newest complete one and a restore gives it, and a following
save keeps it, collects every chunk no kept checkpoint references and leaves no lease behind.
"""

from __future__ import annotations

import json
import uuid

import fsspec
import numpy as np
import pytest
from reliability_child import FAULTED_CODE, KILLED_CODE
from reliability_support import frozen_tensors, step_of, step_tensors
from test_reliability_kill import Zygote
from test_reliability_killpoints import INCREMENTAL_CHUNK, MAX_TO_KEEP, NEXT_STEP, SAVES, _newest_complete

import ckpt
from ckpt.formats.base import open_reader
from ckpt.formats.incremental import CHUNK_DIR, IncrementalReader
from ckpt.saving.stores import open_store
from ckpt.storage.leases import LEASE_FILE

GRACE = 60.0  # the parent's ckpt_grace: its own save has half of it to commit
CLOCK_BEHIND = 2 * GRACE  # how much older the child's leases look to the parent


def _saver(grace: float | None) -> tuple[ckpt.Saver, dict[str, ckpt.Variable]]:
    variables = {key: ckpt.Variable(value) for key, value in {**step_tensors(0), **frozen_tensors()}.items()}
    options = None if grace is None else {"ckpt_grace": grace}
    return ckpt.Saver(variables, max_to_keep=MAX_TO_KEEP, incremental=True, chunk_bytes=INCREMENTAL_CHUNK,
                      storage_options=options), variables


def _references(url: str) -> set[str]:
    with open_reader(url) as reader:
        assert isinstance(reader, IncrementalReader)
        return {c.hex() for key in reader.tensors for c in reader.chunks_of(key)}


def _chunk_store(directory: str) -> set[str]:
    """The names of the objects in the directory's chunk folder, the lease object aside."""
    fs = fsspec.filesystem("s3")
    found = fs.find(f"{directory}/{CHUNK_DIR}")
    return {path.rsplit("/", 1)[1] for path in found} - {LEASE_FILE}


def _problems(directory: str, grace: float | None) -> list[str]:
    """What a run resumed after the kill or fault would get wrong in ``directory``."""
    problems = []
    for row in ckpt.list_checkpoints(directory):  # every kept checkpoint: all its chunks there and intact
        if row.note == "missing":
            problems.append(f"the state file lists {row.path}, which is gone")
        elif row.note in ("", "latest", "preserved"):
            problems += [f"kept {row.path}: {p}" for p in ckpt.verify(f"{directory}/{row.path}").problems]
    newest = _newest_complete(directory, ".msgpack")
    expected = f"{directory}/model-{newest}.msgpack"
    if ckpt.latest_checkpoint(directory) != expected:
        return problems + [f"latest_checkpoint is {ckpt.latest_checkpoint(directory)}, not {expected}"]
    saver, variables = _saver(grace)
    saver.restore(directory)
    if step_of({k: np.asarray(v.value()) for k, v in variables.items() if k in step_tensors(0)}) != newest:
        problems.append(f"restore(directory) did not give step {newest}")
    for key, value in step_tensors(NEXT_STEP).items():
        variables[key].assign(value)
    saver.save(f"{directory}/model.msgpack", global_step=NEXT_STEP)
    kept = [p.rsplit("/", 1)[1] for p in saver.last_checkpoints]
    if kept != [f"model-{newest}.msgpack", f"model-{NEXT_STEP}.msgpack"]:
        problems.append(f"the next save kept {kept}")
    stored_names = {n for n in open_store(directory).list_names() if n.startswith("model-")}
    if stored_names != set(kept):
        problems.append(f"after the next save the directory holds {sorted(stored_names)}, the state file lists {kept}")
    wanted = set().union(*(_references(f"{directory}/{n}") for n in kept))
    stored = _chunk_store(directory)
    if stored != wanted:  # leftovers of the killed save are collected by the next one
        problems.append(f"after the next save the chunk store holds {len(stored - wanted)} unreferenced "
                        f"files and lacks {len(wanted - stored)} referenced chunks")
    leases = json.loads(fsspec.filesystem("s3").cat_file(f"{directory}/{CHUNK_DIR}/{LEASE_FILE}"))
    if leases != {"holds": {}, "collect": None}:
        problems.append(f"after the next save the chunk store's leases are {leases}")
    return problems


def _run(bucket: str, stderr: str, grace: float | None, until_wrong: bool = False,
         **command: object) -> tuple[int, list[str], str]:
    """Every kill (or fault) point of three saves, or up to the first that goes wrong: (points, what
    went wrong, the last run's directory)."""
    zygote = Zygote(stderr)
    bad: list[str] = []
    points = 0
    try:
        for k in range(1, 1000):
            directory = f"{bucket}/run-{k}-{uuid.uuid4().hex[:6]}"
            _saver(None)[0].save(f"{directory}/model.msgpack", global_step=0)
            pid = zygote.spawn(dir=directory, ext=".msgpack", start=1, max_to_keep=MAX_TO_KEEP, kill_at=k,
                               saves=SAVES, kind="s3", incremental=INCREMENTAL_CHUNK, lease_clock_behind=CLOCK_BEHIND,
                               **command)
            code = zygote.reap(pid)
            if code == 0:
                break  # the three saves completed before a k-th store call
            assert code in (KILLED_CODE, FAULTED_CODE), f"the child failed (code {code}): {open(stderr).read()}"
            points += 1
            bad += [f"{'fault' if command.get('fault') else 'kill'} at store call {k}: {p}"
                    for p in _problems(directory, grace)]
            if bad and until_wrong:
                break
    finally:
        zygote.close()
    return points, bad, directory


@pytest.mark.parametrize("fault", [False, True], ids=["kill", "fault"])
def test_a_kill_or_fault_at_any_store_call_of_incremental_s3_saves_never_loses_a_kept_chunk(
        s3_bucket, tmp_path, fault):
    points, bad, last = _run(s3_bucket, str(tmp_path / "zygote.stderr"), GRACE, fault=fault)
    print(f"\nincremental s3 {'faults' if fault else 'kills'}: {points} store-call points, {len(bad)} wrong")
    assert points >= 3 * SAVES, "the kills did not reach the saves' commits"
    assert ckpt.latest_checkpoint(last) == f"{last}/model-{SAVES}.msgpack", "the run no point reached did not finish"
    assert any(len(name) == 128 for name in _references(f"{last}/model-{SAVES}.msgpack")), \
        "no save wrote a delta chunk: the points did not cover delta-writing saves"
    assert not bad, f"{len(bad)} of {points} points went wrong:\n" + "\n".join(bad)


def test_the_s3_kill_loop_can_fail(s3_bucket, tmp_path):
    """A negative control: chunks uploaded only after the index is committed (an ordering bug)
    leave kept checkpoints referencing missing chunks, which the same checks report."""
    points, bad, _ = _run(s3_bucket, str(tmp_path / "zygote.stderr"), GRACE, until_wrong=True, late_chunks=True)
    print(f"\nincremental s3 kills, chunks uploaded late: {points} store-call points, {len(bad)} wrong")
    assert any("is missing" in p for p in bad), bad
