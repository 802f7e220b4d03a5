"""Child processes for the reliability tests; run as ``python tests/reliability_child.py MODE ...``.

Modes:
  zygote             import and warm up ckpt once, then fork one saving child per JSON
                     command read from stdin, so a SIGKILL test pays for start-up only once.
                     Protocol (one line each): parent sends {"dir", "ext", "start",
                     "max_to_keep", "blocking" (optional)}; zygote answers "pid <pid>", then "exit <pid> <code>" once
                     the child is gone (code -9: killed by SIGKILL). With "kill_at": k (and "saves", "kind":
                     "file", "sharded" or "s3") the child instead makes that many saves and ends itself
                     with os._exit(KILLED_CODE) at its k-th file event (``kill_at_event``), or exits 0
                     after the last save. Optional keys: "fault" (the k-th event raises a StorageError
                     instead; the child goes on with its other saves and exits FAULTED_CODE),
                     "lease_clock_behind" (seconds: ``shift_lease_clock``), "late_chunks" (``upload_chunks_late``:
                     a negative control).
  saver DIR WRITER EXT STEPS MAX_TO_KEEP
                     save STEPS checkpoints "w<WRITER>-<step><EXT>" into DIR (concurrency tests).
  cases JSON         read damaged files whose bytes may reach libhdf5 (which can crash or
                     hang on them); JSON lists {"path", "pristine"}; print one JSON result per
                     line, each preceded by a "start <i>" line so the parent can name a case
                     that hangs or crashes the process.
  fsize DIR EXT LIMITS_JSON
                     for each byte limit, save with RLIMIT_FSIZE set to it (every write past
                     the limit fails with EFBIG, including libhdf5's own writes) and print
                     what happened as one JSON line.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
import traceback
from typing import Any

import numpy as np
from reliability_support import frozen_tensors, read_outcome, restore_outcome, small_tensors, step_tensors

import ckpt
from ckpt.errors import StorageError
from ckpt.storage.atomic import is_temporary
from ckpt.storage.state import read_state


KILLED_CODE = 77  # a child's exit code when kill_at_event ended it
FAULTED_CODE = 78  # a child's exit code when kill_at_event's fault fired and the saves went on
#: Audit events that change files: a kill between any two of them is a distinct crash state.
FILE_EVENTS = {"os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.link", "shutil.rmtree"}
_WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC


def kill_at_event(k: int, kind: str, fault: list[int] | None = None) -> None:
    """End this process with os._exit(KILLED_CODE) just before its k-th file event: an audit
    event that writes (``open`` for writing, renames, removals, mkdir), or for ``kind`` "s3"
    (the audit hook sees no network calls) a store call that changes objects: put, conditional
    put, delete, finishing an upload. With ``fault`` (s3 only), the k-th store call instead
    raises the StorageError a failed request becomes, once, and appends k to ``fault``."""
    seen = [0]

    def tick() -> None:
        seen[0] += 1
        if seen[0] == k and fault is not None:
            fault.append(k)
            raise StorageError(f"injected fault at store call {k}")
        if seen[0] == k:
            os._exit(KILLED_CODE)

    if kind == "s3":
        from ckpt.storage import objstore as _objstore, s3 as _s3, s3upload as _s3upload, uploads as _uploads

        def wrapped(method: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                tick()
                return method(*args, **kwargs)
            return call

        for cls, names in ((_objstore.ObjectStore, ("put", "delete")), (_s3.S3Store, ("put_if",)),
                           (_s3upload.S3Upload, ("finish",)), (_uploads.StagedUpload, ("finish",))):
            for name in names:
                setattr(cls, name, wrapped(getattr(cls, name)))
        return

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event in FILE_EVENTS:
            tick()
        elif event == "open" and len(args) >= 3:
            mode, flags = args[1], args[2]
            if (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                    (isinstance(flags, int) and flags & _WRITING):
                tick()

    sys.addaudithook(hook)


def shift_lease_clock(seconds: float) -> None:
    """Stamp the object-store chunk leases this process takes ``seconds`` in the past: to the
    parent they look that much older, as if it resumed that long after the kill (no test waits
    for a lease to expire). Only the lease code's clock moves: state entries keep real times."""
    import types

    from ckpt.saving import incremental_remote
    from ckpt.storage import leases

    clock = types.SimpleNamespace(time=lambda: time.time() - seconds, monotonic=time.monotonic, sleep=time.sleep)
    leases.time = clock  # type: ignore[assignment]
    incremental_remote.time = clock  # type: ignore[assignment]


def upload_chunks_late() -> None:
    """A negative control: incremental saves to an object store upload their chunks only after
    the index is committed (the ordering bug a kill between the two exposes)."""
    from ckpt.saving import incremental_remote
    from ckpt.storage.remote import RemoteDirectory

    pending: list[tuple[Any, str, bytes]] = []
    commit, put = RemoteDirectory.commit, incremental_remote._put_chunk

    def put_later(store: Any, url: str, data: Any) -> bool:
        pending.append((store, url, bytes(data)))
        return True

    def commit_then_upload(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = commit(self, *args, **kwargs)
        while pending:
            put(*pending.pop(0))
        return state

    incremental_remote._put_chunk = put_later  # type: ignore[assignment]
    RemoteDirectory.commit = commit_then_upload  # type: ignore[method-assign]


def save_loop(directory: str, ext: str, start: int, max_to_keep: int, writer: int = 0,
              stop: int | None = None, blocking: bool = True, comm: Any = None, keep_best: int | None = None,
              incremental: int | None = None, tolerate: bool = False) -> None:
    """Save consecutive steps forever (or until ``stop``), every tensor encoding the step.

    With ``blocking=False`` each save runs in the background while the loop already assigns
    the next step's values (a torn snapshot would mix two steps). ``comm``: sharded saves.
    ``keep_best``: each save has the metric "loss" = its step, kept by keep-best retention.
    ``incremental``: incremental saves with chunks of this many bytes, of the step's tensors and
    the step-independent ``frozen_tensors`` (whose chunks the checkpoints share).
    ``tolerate``: a save that fails with a CheckpointError is skipped (an injected fault).
    """
    variables = {key: ckpt.Variable(value) for key, value in step_tensors(start, writer).items()}
    best: dict[str, Any] = {} if keep_best is None else {"keep_best": keep_best, "best_metric": "loss"}
    if incremental is not None:
        variables.update({key: ckpt.Variable(value) for key, value in frozen_tensors().items()})
        best.update(incremental=True, chunk_bytes=incremental)
    saver = ckpt.Saver(variables, max_to_keep=max_to_keep, comm=comm, **best)
    prefix = "model" if writer == 0 else f"w{writer}"
    step = start
    while stop is None or step < stop:
        for key, value in step_tensors(step, writer).items():
            variables[key].assign(value)
        try:
            saver.save(os.path.join(directory, prefix + ext), global_step=step, blocking=blocking,
                       metrics=None if keep_best is None else {"loss": float(step)})
        except ckpt.CheckpointError:
            if not tolerate:
                raise
        step += 1
    saver.wait()


def zygote() -> None:
    """Fork a saving child per command; report its pid and how it ended."""
    with tempfile.TemporaryDirectory() as scratch:  # load every lazily imported module now
        save_loop(scratch, ".h5", 0, 1, stop=1)
        save_loop(scratch, ".msgpack", 0, 1, stop=1)
        save_loop(os.path.join(scratch, "incremental"), ".msgpack", 0, 1, stop=1, incremental=4096)
        from ckpt import distributed

        save_loop(os.path.join(scratch, "sharded"), ".h5", 0, 1, stop=1, comm=distributed.local())
        ckpt.Saver({"model/scale": ckpt.Variable(0.0, dtype=np.float64)}).restore(scratch, strict=False)
    for line in sys.stdin:
        command = json.loads(line)
        pid = os.fork()
        if pid == 0 and "kill_at" in command:
            try:
                fault: list[int] | None = [] if command.get("fault") else None
                kill_at_event(command["kill_at"], command["kind"], fault)
                if command.get("lease_clock_behind"):
                    shift_lease_clock(command["lease_clock_behind"])
                if command.get("late_chunks"):
                    upload_chunks_late()
                comm = None
                if command["kind"] == "sharded":
                    from ckpt import distributed

                    comm = distributed.local()
                save_loop(command["dir"], command["ext"], command["start"], command["max_to_keep"],
                          stop=command["start"] + command["saves"], blocking=command.get("blocking", True),
                          comm=comm, keep_best=command.get("keep_best"), incremental=command.get("incremental"),
                          tolerate=fault is not None)
                os._exit(FAULTED_CODE if fault else 0)  # 0: every save completed before the k-th event
            except BaseException:
                traceback.print_exc()
                os._exit(1)
        if pid == 0:
            code = 1
            try:
                save_loop(command["dir"], command["ext"], command["start"], command["max_to_keep"],
                          blocking=command.get("blocking", True))
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)  # never return into the zygote's loop
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(f"exit {pid} {code}", flush=True)


def cases(spec_path: str) -> None:
    """Classify each damaged file, as the in-process corruption tests do."""
    with open(spec_path) as f:
        specs = json.load(f)
    pristine_cache: dict[str, list[tuple[str, np.ndarray]]] = {}
    for i, spec in enumerate(specs):
        print(f"start {i}", flush=True)
        expected = pristine_cache.get(spec["pristine"])
        if expected is None:
            with ckpt.load_checkpoint(spec["pristine"]) as reader:
                expected = [(key, reader.get_tensor(key)) for key in reader.tensors]
            pristine_cache[spec["pristine"]] = expected
        try:
            kind, detail = read_outcome(spec["path"], expected)
            restored, why = restore_outcome(spec["path"], expected)
        except BaseException as exc:  # the parent reports anything that is not a CheckpointError
            kind, detail, restored, why = "EXCEPTION", f"{type(exc).__name__}: {exc}", "", ""
        print(json.dumps({"i": i, "kind": kind, "detail": detail[:300], "restore": restored,
                          "restore_detail": why[:300]}), flush=True)


def fsize(directory: str, ext: str, limits_json: str) -> None:
    """Save under each file-size limit; report the error and what the directory holds after."""
    tensors = small_tensors()
    variables = {key: ckpt.Variable(value) for key, value in tensors}
    saver = ckpt.Saver(variables, max_to_keep=2)
    unlimited = resource.getrlimit(resource.RLIMIT_FSIZE)
    for step, limit in enumerate(json.loads(limits_json), start=1):
        resource.setrlimit(resource.RLIMIT_FSIZE, unlimited if limit is None else (limit, unlimited[1]))
        error: dict[str, Any] | None = None
        try:
            saver.save(os.path.join(directory, "model" + ext), global_step=step)
        except ckpt.CheckpointError as exc:
            error = {"type": type(exc).__name__, "message": str(exc)}
        except BaseException as exc:
            error = {"type": "NOT-A-CHECKPOINT-ERROR " + type(exc).__name__, "message": str(exc)}
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, unlimited)
        state = read_state(directory)
        print(json.dumps({
            "limit": limit, "step": step, "error": error,
            "latest": os.path.basename(ckpt.latest_checkpoint(directory) or ""),
            "listed": [e.path for e in state.checkpoints] if state else [],
            "temporaries": sorted(n for n in os.listdir(directory) if is_temporary(n)),
        }), flush=True)


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode == "zygote":
        zygote()
    elif mode == "saver":
        directory, writer, ext, steps, max_to_keep = argv[1:6]
        keep = None if max_to_keep == "none" else int(max_to_keep)
        save_loop(directory, ext, 1, keep, writer=int(writer), stop=1 + int(steps))
    elif mode == "cases":
        cases(argv[1])
    elif mode == "fsize":
        fsize(argv[1], argv[2], argv[3])
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
