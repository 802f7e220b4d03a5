"""Checkpoints that know the training run: metrics in the state file, keep-best retention,
best_checkpoint and restore(best=True), on every save path."""

from __future__ import annotations

import json
import math
import os
import time

import numpy as np
import pytest
from click.testing import CliRunner

import ckpt
from ckpt.cli.main import main as cli
from ckpt.saving.retention import Retention
from ckpt.storage.state import CheckpointEntry, CheckpointState, parse_state, read_state

# (kind, blocking): every save path; "memory" is the object-store path (fsspec's memory filesystem)
PATHS = [("file", True), ("file", False), ("sharded", True), ("sharded", False), ("memory", True)]


def _directory(kind: str, tmp_path) -> str:
    return f"memory://run-{time.time_ns()}" if kind == "memory" else str(tmp_path / "run")


def _saver(kind: str, v: ckpt.Variable, **kwargs) -> ckpt.Saver:
    if kind == "sharded":
        from ckpt import distributed

        return ckpt.Saver([v], comm=distributed.local(), format="msgpack", **kwargs)
    return ckpt.Saver([v], format="msgpack", **kwargs)


def _save(saver: ckpt.Saver, directory: str, step: int, blocking: bool, **metrics: float) -> str:
    found = saver.save(f"{directory}/model", global_step=step, blocking=blocking, metrics=metrics or None)
    return found if isinstance(found, str) else found.result()


def _names(paths: list[str]) -> list[str]:
    return [p.rsplit("/", 1)[-1] for p in paths]


# --- metrics ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,blocking", PATHS)
def test_metrics_are_recorded_and_listed_on_every_save_path(tmp_path, kind, blocking):
    directory = _directory(kind, tmp_path)
    saver = _saver(kind, ckpt.Variable(np.arange(3.0), name="w"))
    _save(saver, directory, 1, blocking, val_loss=0.5, acc=0.75)
    _save(saver, directory, 2, blocking)  # a save without metrics
    rows = ckpt.list_checkpoints(directory)
    assert [(r.path, r.step, r.metrics) for r in rows] == [
        ("model-1.msgpack", 1, {"val_loss": 0.5, "acc": 0.75}), ("model-2.msgpack", 2, None)]
    assert rows[0].to_json()["metrics"] == {"val_loss": 0.5, "acc": 0.75}


@pytest.mark.parametrize("bad,why", [(math.nan, "is nan"), (math.inf, "is inf"), (-math.inf, "is -inf"),
                                     ("0.3", "must be a real number, got str"),
                                     (True, "must be a real number, got bool")])
@pytest.mark.parametrize("kind,blocking", [("file", True), ("file", False), ("sharded", True)])
def test_a_metric_that_is_not_a_finite_number_is_refused_before_writing(tmp_path, kind, blocking, bad, why):
    directory = _directory(kind, tmp_path)
    saver = _saver(kind, ckpt.Variable(1.0, name="w"))
    with pytest.raises(ckpt.InvalidMetricsError, match=f"model-3.msgpack: metric 'val_loss' {why}") as info:
        saver.save(f"{directory}/model", global_step=3, blocking=blocking, metrics={"val_loss": bad})
    assert info.value.key == "val_loss" and info.value.path.endswith("model-3.msgpack")
    assert ckpt.latest_checkpoint(directory) is None and not os.path.exists(f"{directory}/model-3.msgpack")


def test_numpy_scalars_are_metrics(tmp_path):
    saver = ckpt.Saver([ckpt.Variable(1.0, name="w")])
    saver.save(tmp_path / "m.h5", metrics={"loss": np.float32(0.25), "n": np.int64(3)})
    assert read_state(str(tmp_path)).checkpoints[0].metrics == {"loss": 0.25, "n": 3.0}


def test_old_state_files_without_metrics_read_and_damaged_metrics_are_refused(tmp_path):
    old = {"format": "ckpt-state", "version": 1, "latest": "m-1.h5",
           "checkpoints": [{"path": "m-1.h5", "time": 1.0, "step": 1}]}
    assert parse_state(json.dumps(old).encode(), "checkpoint").checkpoints[0].metrics is None
    old["checkpoints"][0]["metrics"] = {"loss": "NaN"}
    with pytest.raises(ckpt.CorruptCheckpointError, match="checkpoint: malformed checkpoint entry"):
        parse_state(json.dumps(old).encode(), "checkpoint")


# --- keep-best retention ----------------------------------------------------------------------
def _apply(retention: Retention, saves: list[tuple[str, dict | None]]) -> tuple[list[str], list[str]]:
    state, gone = CheckpointState(), []

    def exists(name: str) -> bool:
        return name not in gone

    for name, metrics in saves:
        state, doomed = retention.apply(state, name, None, exists, metrics)
        gone += doomed
    return [e.path for e in state.checkpoints], gone


def test_keep_best_keeps_the_newest_and_the_best_in_order():
    losses = [0.9, 0.1, 0.8, 0.2, 0.7, 0.6, 0.5]
    kept, gone = _apply(Retention(max_to_keep=2, keep_best=2, best_metric="loss"),
                        [(f"m-{i}", {"loss": x}) for i, x in enumerate(losses)])
    assert kept == ["m-1", "m-3", "m-5", "m-6"] and sorted(gone) == ["m-0", "m-2", "m-4"]
    kept, _ = _apply(Retention(max_to_keep=1, keep_best=1, best_metric="loss", best_mode="max"),
                     [(f"m-{i}", {"loss": x}) for i, x in enumerate(losses)])
    assert kept == ["m-0", "m-6"]


def test_keep_best_ties_keep_the_newer_and_missing_metrics_never_count():
    saves = [("a", {"loss": 0.1}), ("b", None), ("c", {"acc": 0.0}), ("d", {"loss": 0.1}), ("e", None), ("f", None)]
    kept, gone = _apply(Retention(max_to_keep=2, keep_best=1, best_metric="loss"), saves)
    assert kept == ["d", "e", "f"] and sorted(gone) == ["a", "b", "c"]


def test_a_best_checkpoint_that_falls_out_of_the_best_is_deleted():
    saves = [("a", {"loss": 0.3}), ("b", {"loss": 0.9}), ("c", {"loss": 0.9}), ("d", {"loss": 0.2}),
             ("e", {"loss": 0.9}), ("f", {"loss": 0.9})]
    kept, gone = _apply(Retention(max_to_keep=1, keep_best=1, best_metric="loss"), saves)
    assert kept == ["d", "f"] and "a" in gone


def test_keep_best_and_keep_every_n_hours_together():
    state = CheckpointState(last_preserved_time=0.0)
    state.checkpoints = [CheckpointEntry("old", 7200.0, metrics={"loss": 0.9}),
                         CheckpointEntry("best", 7300.0, metrics={"loss": 0.1})]
    retention = Retention(max_to_keep=1, keep_hours=1.0, keep_best=1, best_metric="loss")
    state, doomed = retention.apply(state, "new", None, lambda n: True, {"loss": 0.5})
    assert [e.path for e in state.checkpoints] == ["best", "new"]
    assert [e.path for e in state.preserved] == ["old"] and doomed == []


@pytest.mark.parametrize("kind,blocking", PATHS)
def test_saver_keep_best_on_every_save_path(tmp_path, kind, blocking):
    directory = _directory(kind, tmp_path)
    v = ckpt.Variable(0.0, name="w")
    saver = _saver(kind, v, max_to_keep=2, keep_best=1, best_metric="val_loss", best_mode="min")
    for step, loss in enumerate([0.9, 0.2, 0.8, 0.7, 0.6]):
        v.assign(float(step))
        _save(saver, directory, step, blocking, val_loss=loss)
    assert _names(saver.last_checkpoints) == ["model-1.msgpack", "model-3.msgpack", "model-4.msgpack"]
    assert [r.path for r in ckpt.list_checkpoints(directory)] == _names(saver.last_checkpoints)
    best = ckpt.best_checkpoint(directory, metric="val_loss", mode="min")
    assert best is not None and _names([best]) == ["model-1.msgpack"]
    assert _names([ckpt.best_checkpoint(directory, metric="val_loss", mode="max")]) == ["model-3.msgpack"]
    assert ckpt.best_checkpoint(directory, metric="acc") is None
    v.assign(-1.0)
    assert saver.restore(directory, best=True).path == best and float(v.numpy()) == 1.0
    if kind == "file":
        assert not os.path.exists(os.path.join(directory, "model-0.msgpack"))


def test_best_checkpoint_skips_a_deleted_file_and_refuses_bad_modes(tmp_path):
    saver = ckpt.Saver([ckpt.Variable(1.0, name="w")], max_to_keep=None)
    for step, loss in enumerate([0.3, 0.1]):
        saver.save(tmp_path / "m.h5", global_step=step, metrics={"loss": loss})
    os.remove(tmp_path / "m-1.h5")
    assert ckpt.best_checkpoint(tmp_path, metric="loss") == str(tmp_path / "m-0.h5")
    with pytest.raises(ValueError, match="mode must be 'min' or 'max', got 'lowest'"):
        ckpt.best_checkpoint(tmp_path, metric="loss", mode="lowest")


def test_restore_best_without_a_metric_or_without_a_match(tmp_path):
    v = ckpt.Variable(1.0, name="w")
    ckpt.Saver([v]).save(tmp_path / "m.h5", global_step=1)
    with pytest.raises(ValueError, match="restore\\(best=True\\) needs a Saver with best_metric"):
        ckpt.Saver([v]).restore(tmp_path, best=True)
    with pytest.raises(ckpt.CheckpointNotFoundError, match="no checkpoint has the metric 'acc'") as info:
        ckpt.Saver([v], best_metric="acc", best_mode="max").restore(tmp_path, best=True)
    assert info.value.path == str(tmp_path) and info.value.key == "acc"


@pytest.mark.parametrize("kwargs,message", [
    ({"keep_best": 2}, "keep_best needs best_metric"),
    ({"keep_best": -1, "best_metric": "loss"}, "keep_best must be a non-negative int"),
    ({"best_metric": "loss", "best_mode": "lowest"}, "best_mode must be 'min' or 'max'"),
])
def test_saver_refuses_bad_keep_best_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ckpt.Saver([ckpt.Variable(1.0, name="w")], **kwargs)


def test_ckpt_ls_shows_metrics(tmp_path):
    saver = ckpt.Saver([ckpt.Variable(1.0, name="w")])
    saver.save(tmp_path / "m.h5", global_step=1, metrics={"val_loss": 0.31, "acc": 0.91})
    saver.save(tmp_path / "m.h5", global_step=2)
    result = CliRunner().invoke(cli, ["ls", str(tmp_path)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["path", "step", "saved", "(UTC)", "size", "metrics"]
    assert "val_loss=0.31 acc=0.91" in lines[1] and lines[2].split()[-2:] == ["-", "latest"]
    result = CliRunner().invoke(cli, ["ls", "--json", str(tmp_path)])
    assert [c["metrics"] for c in json.loads(result.output)["checkpoints"]] == [{"val_loss": 0.31, "acc": 0.91}, None]


# --- when to save ------------------------------------------------------------------------------
def test_should_save_by_steps_and_seconds(tmp_path):
    saver = ckpt.Saver([ckpt.Variable(1.0, name="w")], save_interval_steps=10, save_interval_seconds=60.0)
    assert saver.should_save(0, now=1000.0)  # nothing saved yet
    saver.save(tmp_path / "m.h5", global_step=0)
    t0 = time.time()
    assert not saver.should_save(0, now=t0 + 3600)  # a step already saved
    assert not saver.should_save(9, now=t0 + 59)
    assert saver.should_save(10, now=t0 + 1)  # the step interval
    assert saver.should_save(3, now=t0 + 61)  # the time interval
    steps_only = ckpt.Saver([ckpt.Variable(1.0, name="w")], save_interval_steps=5)
    due = [s for s in range(12) if steps_only.should_save(s) and steps_only.save(tmp_path / "s.h5", global_step=s)]
    assert due == [0, 5, 10]


@pytest.mark.parametrize("kind,blocking", PATHS)
def test_should_save_resumes_from_the_restored_checkpoint(tmp_path, kind, blocking):
    directory = _directory(kind, tmp_path)
    first = _saver(kind, ckpt.Variable(1.0, name="w"), save_interval_steps=100, save_interval_seconds=3600.0)
    _save(first, directory, 250, blocking)
    saved_at = read_state(directory).latest.time if kind == "file" else time.time()
    resumed = _saver(kind, ckpt.Variable(0.0, name="w"), save_interval_steps=100, save_interval_seconds=3600.0)
    resumed.restore(directory)
    assert not resumed.should_save(250, now=saved_at + 7200)  # the step the directory holds
    assert not resumed.should_save(349, now=saved_at + 10)
    assert resumed.should_save(350, now=saved_at + 10)
    assert resumed.should_save(260, now=saved_at + 3601)


def test_should_save_without_intervals_and_bad_intervals(tmp_path):
    saver = ckpt.Saver([ckpt.Variable(1.0, name="w")])
    saver.save(tmp_path / "m.h5", global_step=3)
    assert not saver.should_save(3) and saver.should_save(4)
    with pytest.raises(ValueError, match="save_interval_steps must be a positive int"):
        ckpt.Saver([ckpt.Variable(1.0, name="w")], save_interval_steps=0)
    with pytest.raises(ValueError, match="save_interval_seconds must be positive"):
        ckpt.Saver([ckpt.Variable(1.0, name="w")], save_interval_seconds=-1)
