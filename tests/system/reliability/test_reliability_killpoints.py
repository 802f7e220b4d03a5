"""Crash safety at every file event: no kill ever hides the newest complete checkpoint.

A child (forked by tests/reliability_child.py's zygote) makes three saves in a row and ends
itself at its k-th file event (an audit hook: opens for writing, renames, removals, mkdir; for
S3, whose network calls the audit hook does not see, the k-th store call that changes objects),
for k = 1, 2, ... until the three saves complete. After each kill: ``latest_checkpoint``,
``Saver.restore(directory)`` and ``last_checkpoints`` give the newest checkpoint complete in the
directory, and the next save keeps it and counts it for ``max_to_keep`` (nothing unlisted stays).
"""

from __future__ import annotations

import os
import shutil
import uuid

import numpy as np
import pytest
from reliability_child import KILLED_CODE
from reliability_support import frozen_tensors, step_of, step_tensors
from test_reliability_kill import Zygote

import ckpt
from ckpt.formats.base import open_reader
from ckpt.formats.incremental import CHUNK_DIR, IncrementalReader
from ckpt.saving.stores import open_store

SAVES = 3
MAX_TO_KEEP = 2
NEXT_STEP = 9  # the parent's save after each kill: newer than any the child makes
PATHS = [  # (kind, ext, blocking)
    ("file", ".h5", True), ("file", ".msgpack", True), ("file", ".h5", False), ("file", ".msgpack", False),
    ("sharded", ".h5", True), ("s3", ".msgpack", True),
]


def _variables() -> dict[str, ckpt.Variable]:
    return {key: ckpt.Variable(value) for key, value in step_tensors(0).items()}


def _saver(kind: str, variables: dict[str, ckpt.Variable]) -> ckpt.Saver:
    if kind == "sharded":
        from ckpt import distributed

        return ckpt.Saver(variables, max_to_keep=MAX_TO_KEEP, comm=distributed.local())
    return ckpt.Saver(variables, max_to_keep=MAX_TO_KEEP)


def _join(directory: str, name: str) -> str:
    return f"{directory}/{name}" if "://" in directory else os.path.join(directory, name)


def _newest_complete(directory: str, ext: str) -> int:
    """The highest step whose checkpoint is complete in the directory (found by name, verified)."""
    for step in range(SAVES, -1, -1):
        try:
            with ckpt.load_checkpoint(_join(directory, f"model-{step}{ext}")) as reader:
                if reader.verify() == [] and step_of({k: reader.get_tensor(k) for k in reader.tensors}) == step:
                    return step
        except ckpt.CheckpointError:
            continue
    raise AssertionError(f"{directory}: not even the first checkpoint is complete")


def _problems(kind: str, directory: str, ext: str, blocking: bool) -> list[str]:
    """What a resumed run would get wrong in ``directory`` after a kill (empty: nothing)."""
    newest = _newest_complete(directory, ext)
    expected = _join(directory, f"model-{newest}{ext}")
    found = ckpt.latest_checkpoint(directory)
    if found != expected:
        return [f"latest_checkpoint is {found}, the newest complete checkpoint is {expected}"]
    problems = []
    variables = _variables()
    saver = _saver(kind, variables)
    saver.restore(directory)
    restored = step_of({k: np.asarray(v.value()) for k, v in variables.items()})
    if restored != newest:
        problems.append(f"restore(directory) gave step {restored}, not {newest}")
    if kind == "file" and saver.last_checkpoints[-1:] != [expected]:  # a restore from a URL or by comm lists none
        problems.append(f"last_checkpoints {saver.last_checkpoints} does not end in {expected}")
    for key, value in step_tensors(NEXT_STEP).items():
        variables[key].assign(value)
    result = saver.save(_join(directory, "model" + ext), global_step=NEXT_STEP, blocking=blocking)
    if not blocking:
        result.result()
    kept = [os.path.basename(p) for p in saver.last_checkpoints]
    if kept != [f"model-{newest}{ext}", f"model-{NEXT_STEP}{ext}"]:
        problems.append(f"the next save kept {kept}")
    on_disk = {n for n in open_store(directory).list_names() if n.startswith("model-")}
    if on_disk != set(kept):
        problems.append(f"after the next save the directory holds {sorted(on_disk)}, the state file lists {kept}")
    return problems


def _start(kind: str, directory: str, ext: str) -> None:
    """A directory whose latest checkpoint is step 0, saved as a run would."""
    _saver(kind, _variables()).save(_join(directory, "model" + ext), global_step=0)


@pytest.mark.parametrize("kind, ext, blocking", PATHS,
                         ids=[f"{k}{e}-{'blocking' if b else 'async'}" for k, e, b in PATHS])
def test_a_kill_at_any_file_event_never_hides_the_newest_checkpoint(request, tmp_path, kind, ext, blocking):
    bucket = request.getfixturevalue("s3_bucket") if kind == "s3" else None
    template = str(tmp_path / "template")
    if kind != "s3":
        _start(kind, template, ext)
    zygote = Zygote(str(tmp_path / "zygote.stderr"))
    bad: list[str] = []
    points = 0
    try:
        for k in range(1, 500):
            if bucket is not None:
                directory = f"{bucket}/run-{k}-{uuid.uuid4().hex[:6]}"
                _start(kind, directory, ext)
            else:
                directory = str(tmp_path / f"run-{k}")
                shutil.copytree(template, directory)
            pid = zygote.spawn(dir=directory, ext=ext, start=1, max_to_keep=MAX_TO_KEEP, blocking=blocking,
                               kill_at=k, saves=SAVES, kind=kind)
            code = zygote.reap(pid)
            if code == 0:
                break  # the three saves completed before a k-th event
            assert code == KILLED_CODE, f"the child failed (code {code}): {(tmp_path / 'zygote.stderr').read_text()}"
            points += 1
            bad += [f"kill at event {k}: {p}" for p in _problems(kind, directory, ext, blocking)]
            if bucket is None:
                shutil.rmtree(directory)
    finally:
        zygote.close()
    print(f"\n{kind} {ext} {'blocking' if blocking else 'async'}: {points} kill points, {len(bad)} wrong")
    assert points >= 3 * SAVES, "the kills did not reach the saves' commits"
    assert not bad, f"{len(bad)} of {points} kill points went wrong:\n" + "\n".join(bad)


@pytest.mark.parametrize("ext, blocking", [(".h5", True), (".msgpack", False)])
def test_a_kill_at_any_file_event_never_deletes_the_best_checkpoint(tmp_path, ext, blocking):
    """Keep-best retention (max_to_keep=1, keep_best=1, loss = step): step 0 is the best of the
    run; no kill of the saves of steps 1-3 loses it, and the next save keeps it beside its own."""
    template = str(tmp_path / "template")
    ckpt.Saver(_variables(), max_to_keep=1, keep_best=1, best_metric="loss").save(
        _join(template, "model" + ext), global_step=0, metrics={"loss": 0.0})
    zygote = Zygote(str(tmp_path / "zygote.stderr"))
    bad: list[str] = []
    points = 0
    try:
        for k in range(1, 500):
            directory = str(tmp_path / f"run-{k}")
            shutil.copytree(template, directory)
            pid = zygote.spawn(dir=directory, ext=ext, start=1, max_to_keep=1, keep_best=1, blocking=blocking,
                               kill_at=k, saves=SAVES, kind="file")
            code = zygote.reap(pid)
            if code == 0:
                break
            assert code == KILLED_CODE, f"the child failed (code {code}): {(tmp_path / 'zygote.stderr').read_text()}"
            points += 1
            best = os.path.join(directory, f"model-0{ext}")
            if ckpt.best_checkpoint(directory, metric="loss") != best:
                bad.append(f"kill at event {k}: best_checkpoint is {ckpt.best_checkpoint(directory, metric='loss')}")
            saver = ckpt.Saver(_variables(), max_to_keep=1, keep_best=1, best_metric="loss")
            saver.save(_join(directory, "model" + ext), global_step=NEXT_STEP, metrics={"loss": 5.0})
            kept = [os.path.basename(p) for p in saver.last_checkpoints]
            on_disk = sorted(n for n in os.listdir(directory) if n.startswith("model-"))
            if kept != [f"model-0{ext}", f"model-{NEXT_STEP}{ext}"] or on_disk != sorted(kept):
                bad.append(f"kill at event {k}: the next save kept {kept}, the directory holds {on_disk}")
            shutil.rmtree(directory)
    finally:
        zygote.close()
    assert points >= 3 * SAVES, "the kills did not reach the saves' commits"
    assert not bad, f"{len(bad)} of {points} kill points went wrong:\n" + "\n".join(bad)


INCREMENTAL_CHUNK = 4096  # small chunks: every tensor has several, the frozen table's are shared


def _incremental_saver(kind: str = "file") -> tuple[ckpt.Saver, dict[str, ckpt.Variable]]:
    variables = _variables()
    variables.update({key: ckpt.Variable(value) for key, value in frozen_tensors().items()})
    comm = None
    if kind == "sharded":
        from ckpt import distributed

        comm = distributed.local()
    return ckpt.Saver(variables, max_to_keep=MAX_TO_KEEP, incremental=True, chunk_bytes=INCREMENTAL_CHUNK,
                      comm=comm), variables


def _referenced_names(path: str) -> set[bytes]:
    """The chunk files ``path`` reads (64-byte names: deltas, each with its base)."""
    if os.path.isdir(path):  # a sharded checkpoint: its shard files are the indexes
        with open_reader(path) as sharded:
            files = [os.path.join(path, name) for name, _ in sharded.files]  # type: ignore[attr-defined]
        return set().union(*(_referenced_names(f) for f in files))
    with open_reader(path) as reader:
        assert isinstance(reader, IncrementalReader)
        return {c for key in reader.tensors for c in reader.chunks_of(key)}


def _referenced_chunks(path: str) -> set[str]:
    """The files of the chunk store ``path`` reads (packs and chunk files), by name."""
    if os.path.isdir(path):
        with open_reader(path) as sharded:
            files = [os.path.join(path, name) for name, _ in sharded.files]  # type: ignore[attr-defined]
        return set().union(*(_referenced_chunks(f) for f in files))
    with open_reader(path) as reader:
        assert isinstance(reader, IncrementalReader)
        return {f.hex() for key in reader.tensors for f in reader.files_of(key)}


def _incremental_problems(directory: str, kind: str = "file") -> list[str]:
    """What a resumed incremental run would get wrong in ``directory`` after a kill."""
    problems = []
    for row in ckpt.list_checkpoints(directory):  # every kept checkpoint: all its chunks there and intact
        if row.note == "missing":
            problems.append(f"the state file lists {row.path}, which is gone")
        elif row.note in ("", "latest", "preserved"):
            problems += [f"kept {row.path}: {p}" for p in ckpt.verify(os.path.join(directory, row.path)).problems]
    newest = _newest_complete(directory, ".msgpack")
    expected = os.path.join(directory, f"model-{newest}.msgpack")
    if ckpt.latest_checkpoint(directory) != expected:
        return problems + [f"latest_checkpoint is {ckpt.latest_checkpoint(directory)}, not {expected}"]
    saver, variables = _incremental_saver(kind)
    saver.restore(directory)
    if step_of({k: np.asarray(v.value()) for k, v in variables.items() if k in step_tensors(0)}) != newest:
        problems.append(f"restore(directory) did not give step {newest}")
    for key, value in step_tensors(NEXT_STEP).items():
        variables[key].assign(value)
    saver.save(os.path.join(directory, "model.msgpack"), global_step=NEXT_STEP)
    kept = [os.path.basename(p) for p in saver.last_checkpoints]
    if kept != [f"model-{newest}.msgpack", f"model-{NEXT_STEP}.msgpack"]:
        problems.append(f"the next save kept {kept}")
    on_disk = {n for n in os.listdir(directory) if n.startswith("model-")}
    if on_disk != set(kept):
        problems.append(f"after the next save the directory holds {sorted(on_disk)}, the state file lists {kept}")
    wanted = set().union(*(_referenced_chunks(os.path.join(directory, n)) for n in kept))
    stored = set(os.listdir(os.path.join(directory, CHUNK_DIR)))
    if stored != wanted:  # leftovers of the killed save are collected by the next one
        problems.append(f"after the next save the chunk store holds {len(stored - wanted)} unreferenced "
                        f"files and lacks {len(wanted - stored)} referenced chunks")
    return problems


@pytest.mark.parametrize("kind,blocking", [("file", True), ("file", False), ("sharded", True)])
def test_a_kill_at_any_file_event_of_incremental_saves_never_loses_a_kept_chunk(tmp_path, kind, blocking):
    """Three incremental saves with max_to_keep (so retention and chunk collection run), killed at
    every file event: no kept checkpoint references a deleted or missing chunk, latest_checkpoint
    is the newest complete one, and the next save collects what the killed one left. With
    ``blocking=False`` the child assigns the next step while each save runs in the background. Kind
    "sharded": Saver(comm=distributed.local(), incremental=True), its shard files indexing the store."""
    template = str(tmp_path / "template")
    _incremental_saver(kind)[0].save(os.path.join(template, "model.msgpack"), global_step=0)
    zygote = Zygote(str(tmp_path / "zygote.stderr"))
    bad: list[str] = []
    points = 0
    try:
        for k in range(1, 1000):
            directory = str(tmp_path / f"run-{k}")
            shutil.copytree(template, directory)
            pid = zygote.spawn(dir=directory, ext=".msgpack", start=1, max_to_keep=MAX_TO_KEEP, kill_at=k,
                               saves=SAVES, kind=kind, incremental=INCREMENTAL_CHUNK, blocking=blocking)
            code = zygote.reap(pid)
            if code == 0:
                break
            assert code == KILLED_CODE, f"the child failed (code {code}): {(tmp_path / 'zygote.stderr').read_text()}"
            points += 1
            bad += [f"kill at event {k}: {p}" for p in _incremental_problems(directory, kind)]
            shutil.rmtree(directory)
    finally:
        zygote.close()
    print(f"\nincremental {kind} .msgpack blocking={blocking}: {points} kill points, {len(bad)} wrong")
    assert points >= 3 * SAVES, "the kills did not reach the saves' commits"
    complete = ckpt.latest_checkpoint(directory)  # the run no kill reached: its saves wrote deltas
    assert complete is not None
    assert any(len(name) == 64 for name in _referenced_names(complete)), \
        "no save wrote a delta chunk: the kills did not cover delta-writing saves"
    assert not bad, f"{len(bad)} of {points} kill points went wrong:\n" + "\n".join(bad)
