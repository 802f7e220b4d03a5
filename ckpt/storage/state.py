"""The directory's state file ("checkpoint"): which checkpoints exist, which is the latest.

The state file is JSON, written atomically, with paths relative to its directory (plain
file names), so a moved or copied directory still works:

    {"format": "ckpt-state", "version": 1, "latest": "model-2000.h5",
     "checkpoints": [{"path": "model-1000.h5", "time": 1763740000.5, "step": 1000,
                      "metrics": {"val_loss": 0.31}}, ...],
     "preserved": [...], "last_preserved_time": 1763740000.5, "deleting": ["model-500.h5"],
     "pending": [{"path": "model-3000.h5", "time": 1763740100.5, "step": 3000}]}

``checkpoints`` are managed by ``max_to_keep`` and ``keep_best`` (oldest first, the last one is
the latest); an entry's optional ``metrics`` (finite JSON numbers by name) are the ones its save
was given (``save(..., metrics=)``), absent in files written before metrics existed;
``preserved`` ones were kept by ``keep_checkpoint_every_n_hours`` and are never deleted.
``deleting`` names checkpoints dropped by ``max_to_keep`` whose files are deleted after the
state file is written: a save killed in between leaves them to the next save to delete.
``pending`` is a save's intent, written before its commit (the rename, or the commit record):
a reader counts a pending entry as the newest checkpoint only if it is complete in the store
(``settle``), so a save killed between its commit and the state file's final write never hides
its checkpoint; an entry's optional ``commit`` names the store's proof of *this* save's commit
(a replaced file's inode, an object store's data object), so an older file of the same name is
not taken for it. The next save turns pending entries into ordinary ones, or drops them.
Read-modify-write cycles hold an ``flock`` on ".checkpoint.lock", so Savers in several
threads or processes never lose each other's entries.

Example:
    >>> import ckpt, tempfile
    >>> ckpt.latest_checkpoint(tempfile.mkdtemp()) is None
    True
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ckpt.storage.regular import open_regular
from ckpt.storage.atomic import replace_atomically
from ckpt.errors import CheckpointWriteError, CorruptCheckpointError, UnsupportedCheckpointError

__all__ = ["STATE_FILE", "CheckpointEntry", "CheckpointState", "read_state", "write_state",
           "state_lock", "parse_state", "dump_state", "settle", "with_pending"]

STATE_FILE = "checkpoint"
LOCK_FILE = ".checkpoint.lock"
_FORMAT, _VERSION = "ckpt-state", 1


@dataclass
class CheckpointEntry:
    """One checkpoint in a state file."""

    path: str  # a file name in the state file's directory
    time: float  # seconds since the epoch when it was saved
    step: int | None = None
    #: For a pending entry: what proves that this save committed (store-specific), or None
    #: when the name existing is proof enough.
    commit: str | None = None
    #: The metrics its save was given (finite numbers by name), or None.
    metrics: dict[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"path": self.path, "time": self.time, "step": self.step}
        if self.commit is not None:
            doc["commit"] = self.commit
        if self.metrics is not None:
            doc["metrics"] = self.metrics
        return doc


@dataclass
class CheckpointState:
    """The parsed state file."""

    checkpoints: list[CheckpointEntry] = field(default_factory=list)
    preserved: list[CheckpointEntry] = field(default_factory=list)
    last_preserved_time: float | None = None
    #: Files dropped from the lists whose deletion may not have happened yet (a killed save).
    deleting: list[str] = field(default_factory=list)
    #: Saves that were about to commit when the file was written (see ``settle``).
    pending: list[CheckpointEntry] = field(default_factory=list)
    #: "tensorflow" for TensorFlow's text state file: readable, never rewritten by ckpt.
    written_by: str = "ckpt"

    @property
    def latest(self) -> CheckpointEntry | None:
        return self.checkpoints[-1] if self.checkpoints else None

    def all_entries(self) -> list[CheckpointEntry]:
        """Managed and preserved entries, oldest first."""
        return sorted(self.checkpoints + self.preserved, key=lambda e: e.time)


def _parse_entry(item: Any, path: str) -> CheckpointEntry:
    if not isinstance(item, dict) or not isinstance(item.get("path"), str) or \
            not isinstance(item.get("time"), (int, float)) or \
            not (item.get("step") is None or isinstance(item.get("step"), int)) or \
            not (item.get("commit") is None or isinstance(item.get("commit"), str)) or \
            not (item.get("metrics") is None or _valid_metrics(item["metrics"])):
        raise CorruptCheckpointError(f"{path}: malformed checkpoint entry {item!r}")
    metrics = item.get("metrics")
    return CheckpointEntry(_check_name(item["path"], path), float(item["time"]), item.get("step"),
                           item.get("commit"), None if metrics is None else {k: float(v) for k, v in metrics.items()})


def _valid_metrics(metrics: Any) -> bool:
    # bool is an int to Python, not a metric; NaN/inf never get written (json would write NaN)
    return isinstance(metrics, dict) and all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        for k, v in metrics.items())


def _check_name(name: Any, path: str) -> str:
    # a plain file name: a hostile state file must not point retention at other directories
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or "\x00" in name:
        raise CorruptCheckpointError(f"{path}: checkpoint entry {name!r} is not a file name in "
                                     "this directory")
    return name


def read_state(directory: str) -> CheckpointState | None:
    """Return the directory's state, or None when it has no state file.

    Raises:
        CorruptCheckpointError: the state file is not valid.
        UnsupportedCheckpointError: it was written by something else (e.g. TensorFlow).
    """
    path = os.path.join(directory, STATE_FILE)
    try:
        with open_regular(path) as f:  # a FIFO named "checkpoint" must not block every reader
            raw = f.read(min(os.fstat(f.fileno()).st_size, 16 << 20))  # read(N) mallocs N bytes first
    except (FileNotFoundError, NotADirectoryError):
        return None
    state = parse_state(raw, path)
    if state.written_by == "tensorflow":  # local files only: parse_state also reads object stores' state
        state.checkpoints = [CheckpointEntry(_found_beside(e.path, directory), e.time, e.step)
                             for e in state.checkpoints]
    return state


def parse_state(raw: bytes, path: str) -> CheckpointState:
    """Parse a state file's bytes (``path`` names it in errors)."""
    if raw.lstrip().startswith((b"model_checkpoint_path", b"all_model_checkpoint_paths")):
        return _read_tensorflow_state(raw, path)
    try:
        doc = json.loads(raw)
    except ValueError:
        raise CorruptCheckpointError(f"{path}: the state file is not valid JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        raise CorruptCheckpointError(f"{path}: not a ckpt state file")
    if not isinstance(doc.get("version"), int) or doc["version"] > _VERSION:
        raise UnsupportedCheckpointError(f"{path}: state file version {doc.get('version')!r} is newer "
                                         f"than this ckpt reads ({_VERSION})")
    checkpoints, preserved = doc.get("checkpoints"), doc.get("preserved", [])
    last, deleting = doc.get("last_preserved_time"), doc.get("deleting", [])
    pending = doc.get("pending", [])  # absent in files written before it existed
    if not isinstance(checkpoints, list) or not isinstance(preserved, list) or \
            not (last is None or isinstance(last, (int, float))) or not isinstance(deleting, list) or \
            not isinstance(pending, list):
        raise CorruptCheckpointError(f"{path}: malformed state file")
    return CheckpointState([_parse_entry(x, path) for x in checkpoints],
                           [_parse_entry(x, path) for x in preserved],
                           None if last is None else float(last),
                           [_check_name(x, path) for x in deleting],
                           [_parse_entry(x, path) for x in pending])


def _read_tensorflow_state(raw: bytes, path: str) -> CheckpointState:
    """Parse TensorFlow's text-format CheckpointState (model_checkpoint_path: "...")."""
    fields: dict[str, list[str]] = {}
    for line in raw.decode("utf-8", "replace").splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip():
            fields.setdefault(name.strip(), []).append(value.strip())

    def unquote(value: str) -> str:
        if len(value) < 2 or value[0] != '"' or value[-1] != '"':
            raise CorruptCheckpointError(f"{path}: malformed TensorFlow state file line {value!r}")
        return value[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape")

    paths = [unquote(v) for v in fields.get("all_model_checkpoint_paths", [])]
    latest = [unquote(v) for v in fields.get("model_checkpoint_path", [])]
    if latest and (not paths or paths[-1] != latest[-1]):
        paths = [p for p in paths if p != latest[-1]] + latest[-1:]
    try:
        times = [float(v) for v in fields.get("all_model_checkpoint_timestamps", [])]
    except ValueError:
        raise CorruptCheckpointError(f"{path}: malformed TensorFlow checkpoint timestamps") from None
    times = times if len(times) == len(paths) else [0.0] * len(paths)
    return CheckpointState([CheckpointEntry(p, t) for p, t in zip(paths, times)], written_by="tensorflow")


def _found_beside(prefix: str, directory: str) -> str:
    """``prefix`` when its checkpoint exists, else its file name when that exists in ``directory``.

    TensorFlow records absolute paths, and directories get copied between machines: a copy's
    state file names the old machine's paths, while the same files sit beside it. When neither
    exists the path stays as recorded, so errors name what is missing.
    """
    if _tensorflow_exists(os.path.join(directory, prefix)):  # an absolute prefix: join keeps it
        return prefix
    name = re.split(r"[\\/]", prefix)[-1]  # a Windows machine's paths too
    if name not in ("", ".", "..") and _tensorflow_exists(os.path.join(directory, name)):
        return name
    return prefix


def _tensorflow_exists(prefix: str) -> bool:
    """True when a TensorFlow prefix (model.ckpt-7 -> model.ckpt-7.index) or a file exists there."""
    return os.path.isfile(prefix + ".index") or os.path.exists(prefix)


def write_state(directory: str, state: CheckpointState) -> None:
    """Write the state file atomically."""
    # the checkpoint's own write just cleaned the directory: no second listing under the lock
    with replace_atomically(os.path.join(directory, STATE_FILE), clean=False) as tmp:
        with open(tmp, "wb") as f:
            f.write(dump_state(state))


def dump_state(state: CheckpointState) -> bytes:
    """The state file's bytes for ``state``."""
    latest = state.latest
    doc = {"format": _FORMAT, "version": _VERSION, "latest": latest.path if latest else None,
           "checkpoints": [e.to_json() for e in state.checkpoints],
           "preserved": [e.to_json() for e in state.preserved],
           "last_preserved_time": state.last_preserved_time, "deleting": state.deleting,
           "pending": [e.to_json() for e in state.pending]}
    return (json.dumps(doc, indent=1) + "\n").encode("utf-8")


def settle(state: CheckpointState, committed: Callable[[CheckpointEntry], bool],
           recording: str | None = None) -> CheckpointState:
    """Resolve ``state``'s pending entries in place and return it: one that ``committed`` (the
    store's check that this save's commit happened) is a checkpoint like any other, the newest,
    replacing an older entry of its name; the others are dropped (their save never committed).
    The pending entry of ``recording`` is dropped unasked: the save recording it adds it itself."""
    for entry in state.pending:
        if entry.path != recording and committed(entry):
            state.checkpoints = [e for e in state.checkpoints if e.path != entry.path]
            state.preserved = [e for e in state.preserved if e.path != entry.path]
            state.deleting = [n for n in state.deleting if n != entry.path]
            state.checkpoints.append(CheckpointEntry(entry.path, entry.time, entry.step, metrics=entry.metrics))
    state.pending = []
    return state


def with_pending(state: CheckpointState, entry: CheckpointEntry) -> CheckpointState:
    """``state`` (settled) with ``entry`` added as pending: the intent a save writes before its commit.
    Retention is not applied yet: nothing is dropped before the new checkpoint exists."""
    state.pending = [e for e in state.pending if e.path != entry.path] + [entry]
    return state


@contextmanager
def state_lock(directory: str) -> Iterator[None]:
    """Hold the directory's state lock (threads and processes) for a read-modify-write."""
    path = os.path.join(directory, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as exc:
        raise CheckpointWriteError(f"{path}: cannot open the state file's lock: "
                                   f"{exc.strerror or exc}") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            raise CheckpointWriteError(f"{path}: cannot lock the state file: {exc.strerror or exc}") from exc
        yield
    finally:
        try:
            os.close(fd)  # releases the lock, even when close reports an error
        except OSError:
            pass  # nothing was written through this descriptor: nothing can be lost
