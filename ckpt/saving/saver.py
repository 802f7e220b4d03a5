"""ckpt.Saver: tf.train.Saver's semantics for numpy variables, in HDF5 or msgpack files.

Example:
    >>> import ckpt, tempfile, os
    >>> directory = tempfile.mkdtemp()
    >>> v1 = ckpt.Variable([1.0, 2.0], name="v1")
    >>> v2 = ckpt.Variable(3, name="v2")
    >>> saver = ckpt.Saver({"my_v2": v2}, max_to_keep=2)
    >>> path = saver.save(os.path.join(directory, "model.h5"), global_step=10)
    >>> os.path.basename(path)
    'model-10.h5'
    >>> _ = v2.assign(0)
    >>> saver.restore(directory).restored
    ['my_v2']
    >>> int(v2)
    3
"""

from __future__ import annotations

import operator
import os
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any, Literal, overload

from ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    StorageError,
    UninitializedVariableError,
)
from ckpt.formats import base as _formats  # the format registry; importing it registers the built-ins
from ckpt.gcpause import gc_paused
from ckpt.runtime.variables import Variable
from ckpt.saving.arguments import VarList, best_policy, check_global_step, incremental_policy, key_map, where
from ckpt.saving.async_save import BackgroundSaves, SaveFuture
from ckpt.saving.intervals import SaveIntervals
from ckpt.saving.chunkstores import collect, save_chunked
from ckpt.saving.incremental import CHUNK_BYTES, MAX_CHAIN, Encoding, IncrementalStats, refuse_unsupported
from ckpt.saving.locations import best_checkpoint, checkpoint_at_step, latest_checkpoint, listed_beside, save_target
from ckpt.saving.restore import RestoreResult, restore_variables
from ckpt.saving.retention import Retention, check_metrics, kept_paths, read_owner
from ckpt.saving.stores import store_of
from ckpt.saving.unchanged import unchanged_keys, write_counts
from ckpt.storage import Store, WritableBlob
from ckpt.storage import urls as _urls
from ckpt.storage.atomic import require_directory
from ckpt.storage.state import CheckpointState

__all__ = ["Saver"]

class Saver:
    """Saves variables to checkpoint files and restores them.

    Args:
        var_list: what to save. None: every live variable, keyed by name (without ":0").
            A list: those variables, keyed by name. A dict: its keys are the names in the
            file (``Saver({"my_v2": v2})``); a value that is a Module or a dict puts what it
            holds below its key (``Saver({"model": model, "optimizer": {"m": m}})`` writes
            "model/layers/0/kernel", "optimizer/m/..."). A Module: keyed by its attribute
            paths ("layers/0/kernel").
        max_to_keep: keep the newest N checkpoints of the directory, delete older ones
            (None or 0 keeps all, as in TF1).
        keep_checkpoint_every_n_hours: additionally keep one checkpoint per N hours forever.
        keep_best: additionally keep the N best checkpoints by ``best_metric`` (the metrics
            given to ``save(..., metrics=)``); a checkpoint without that metric is never among
            the best; of equal values the newer is kept. None keeps none for being best.
        best_metric: the metric that ranks checkpoints for ``keep_best`` and ``restore(best=True)``.
        best_mode: "min" (lower is better, a loss) or "max" (an accuracy).
        save_interval_steps: ``should_save(step)`` is True once this many steps have passed
            since the last save (None: no step interval).
        save_interval_seconds: ``should_save(step)`` is True once this many seconds have passed
            since the last save (None: no time interval).
        format: the format for paths without a known extension ("hdf5" or "msgpack").
        staging_bytes: for ``save(..., blocking=False)``: the most memory the snapshot of the
            variables may take (None: a model's worth). Below the model's size, ``save``
            writes all but the last ``staging_bytes`` itself and returns with only those left.
        comm: a :class:`ckpt.distributed.Communicator` (``distributed.mpi()``): ``save`` and
            ``restore`` become collective; every rank writes its own blocks (variables with a
            ``ckpt.Shard``) and rank 0 commits a sharded checkpoint. See docs/distributed.md.
        timeout: with ``comm``, seconds a rank waits for the others in each step of a save or
            restore before it raises (a rank that died or never arrived).
        storage_options: for object-store URLs ("s3://bucket/run/model.msgpack"), options for
            the store's fsspec filesystem; credentials and endpoints otherwise come from the
            store's usual configuration (for S3 the AWS_* variables and profiles).
        compression: "zstd" stores the numeric tensors of .msgpack checkpoints as losslessly
            compressed byte planes (docs/formats.md); a save to an .h5 file then raises
            UnsupportedCheckpointError. None (the default) compresses nothing.
        incremental: True saves .msgpack checkpoints as an index over content-hashed chunks kept
            once in the directory's chunk store (``.ckpt-chunks/``): a save writes only the chunks
            the store lacks (docs/incremental.md), locally or to an object-store URL; with
            ``compression="zstd"`` the chunks are stored compressed; with ``comm=`` each rank's shard
            file indexes the same store (local directories only). An .h5 path raises
            UnsupportedCheckpointError.
        full_every: with ``incremental``, every ``full_every``-th save (the first included) writes
            a self-contained checkpoint; None (the default): every save is incremental.
        chunk_bytes: with ``incremental``, the chunk size in bytes (default 1 MiB).
        max_chain: with ``incremental``, how many deltas deep a changed chunk may be stored as
            its XOR with its previous version before it is written whole again (0: never;
            a restore reads up to ``max_chain + 1`` stored chunks per chunk).

    Raises:
        ValueError: two variables under one key, one variable under two keys, an invalid
            key, nothing to save, a negative staging_bytes, keep_best without best_metric, an
            unknown compression, a full_every or chunk_bytes that is not a positive int, or a
            max_chain that is not a non-negative int.
        TypeError: a var_list entry that is not a Variable (nor, in a dict, a Module or a dict).
    """

    def __init__(self, var_list: VarList = None, max_to_keep: int | None = 5,
                 keep_checkpoint_every_n_hours: float | None = None, format: str = "hdf5",
                 staging_bytes: int | None = None, comm: Any = None, timeout: float = 300.0,
                 storage_options: Mapping[str, Any] | None = None, keep_best: int | None = None,
                 best_metric: str | None = None, best_mode: str = "min", save_interval_steps: int | None = None,
                 save_interval_seconds: float | None = None, compression: str | None = None,
                 incremental: bool = False, full_every: int | None = None,
                 chunk_bytes: int = CHUNK_BYTES, max_chain: int = MAX_CHAIN) -> None:
        self._vars = key_map(var_list)
        self._incremental = incremental_policy(incremental, full_every, chunk_bytes, max_chain)
        self._saves = 0  # saves made, for full_every
        self._previous: dict[str, list[Any]] = {}  # the last incremental save's index entries (delta bases)
        self._notes: dict[bytes, Any] = {}  # and the format's notes on its chunks (IncrementalStats.notes)
        self._written: dict[str, int] = {}  # each key's write count when that save snapshotted it
        offered = {c for f in _formats.formats() if isinstance(f, _formats.WritableFormat) for c in f.compressions}
        if compression is not None and compression not in offered:
            raise ValueError(f"compression must be None or one of {sorted(offered)}, got {compression!r}")
        self._compression = compression
        self._storage_options = storage_options
        self._background = BackgroundSaves(staging_bytes)
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self._comm = comm
        self._async_comm: Any = None
        self._timeout = float(timeout)
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 0):
            raise ValueError(f"max_to_keep must be a positive int, or None or 0 (keep all), got {max_to_keep!r}")
        if keep_checkpoint_every_n_hours is not None and not keep_checkpoint_every_n_hours > 0:
            raise ValueError("keep_checkpoint_every_n_hours must be positive or None")
        fmt = _formats.get_format(format)
        if not fmt.can_write:
            raise ValueError(f"format {format!r} can be read but not written")
        self._format = fmt
        self._retention = Retention(max_to_keep or None, keep_checkpoint_every_n_hours,  # TF1: 0 keeps all
                                    *best_policy(keep_best, best_metric, best_mode))
        self._intervals = SaveIntervals(save_interval_steps, save_interval_seconds)
        self._last_checkpoints: list[str] = []
        self._saved = False  # until the first save, a restore's directory gives last_checkpoints
        self._restored_from: str | None = None
        #: what the last incremental save wrote, reused and collected (None before one, while one
        #: runs in the background, and after one failed)
        self.last_incremental: IncrementalStats | None = None

    @property
    def var_list(self) -> dict[str, Variable]:
        """The {checkpoint key: Variable} map this Saver saves and restores."""
        return dict(self._vars)

    @property
    def last_checkpoints(self) -> list[str]:
        """The kept checkpoints of the directory last saved to, oldest first.

        Before its first save, a Saver that restored from a directory's checkpoint lists that
        directory's checkpoints (a Saver is bound to no directory until it saves or restores).
        """
        if not self._saved and self._restored_from is not None:
            return listed_beside(self._restored_from)
        return list(self._last_checkpoints)

    def _target(self, path: str | os.PathLike[str], global_step: Any) -> tuple[str, Any]:
        name, fmt = save_target(path, self._format)
        ext = next(e for e in fmt.extensions if name.lower().endswith(e))
        if global_step is not None:
            check_global_step(global_step)  # here: a sharded save's failing rank still takes part (with its error)
            step = operator.index(global_step)
            name = f"{name[:len(name) - len(ext)]}-{step}{name[len(name) - len(ext):]}"
        _formats.check_compression(fmt, self._compression, name)  # before anything is written
        return name, fmt

    @overload
    def save(self, path: str | os.PathLike[str], global_step: Any = None,
             metadata: Mapping[str, Any] | None = None, *, blocking: Literal[True] = True,
             metrics: Mapping[str, float] | None = None) -> str: ...

    @overload
    def save(self, path: str | os.PathLike[str], global_step: Any = None,
             metadata: Mapping[str, Any] | None = None, *, blocking: bool,
             metrics: Mapping[str, float] | None = None) -> str | SaveFuture: ...

    def save(self, path: str | os.PathLike[str], global_step: Any = None,
             metadata: Mapping[str, Any] | None = None, *, blocking: bool = True,
             metrics: Mapping[str, float] | None = None) -> str | SaveFuture:
        """Write a checkpoint atomically and record it in the directory's state file.

        Every save first waits for this Saver's asynchronous save in flight, if any, and
        raises that save's error if it failed and nobody has seen the error yet.

        Args:
            path: the file; its extension (.h5, .hdf5, .msgpack) picks the format, a path
                without one gets the Saver's format and its extension.
            global_step: an int (or int Variable) appended to the name: "model-1000.h5".
            metadata: a JSON-like dict stored with the tensors.
            blocking: False copies the variables' values into staging memory and writes
                them in a background thread (docs/async.md): the checkpoint holds the values
                of this call, whatever training does to the variables afterwards.
            metrics: finite numbers by name ({"val_loss": 0.31}) recorded with the checkpoint in
                the directory's state file: ``list_checkpoints`` shows them, ``keep_best`` and
                ``best_checkpoint`` rank by them. With ``comm``, rank 0's are recorded.

        Returns:
            The path written; with ``blocking=False`` a :class:`ckpt.SaveFuture` whose
            ``result()`` is that path once the checkpoint is committed.

        Raises:
            CheckpointWriteError: the disk is full or unwritable, or a missing directory
                cannot be created (missing ones are); the previous checkpoint and the state
                file are untouched.
            UninitializedVariableError: a variable has no value yet.
            TypeError: a ``global_step`` that is not an int (nor an int Variable).
            InvalidMetadataError: ``metadata`` that no format stores (a ValueError too);
                nothing is written.
            InvalidMetricsError: a metric that is not a finite number (NaN, inf, a string);
                nothing is written.
        """
        done = self._save(path, global_step, metadata, blocking, metrics)
        # an asynchronous save counts from its snapshot: should_save must not ask for it again
        self._intervals.saved(None if global_step is None else operator.index(global_step))
        return done

    def _save(self, path: str | os.PathLike[str], global_step: Any, metadata: Mapping[str, Any] | None,
              blocking: bool, metrics: Mapping[str, float] | None) -> str | SaveFuture:
        if self._comm is not None and not blocking:
            return self._save_sharded_async(path, global_step, metadata, metrics)
        if self._comm is not None:
            return self._save_sharded(path, global_step, metadata, metrics)
        self._background.wait()
        path, fmt = self._target(path, global_step)
        step = None if global_step is None else operator.index(global_step)
        scores = check_metrics(metrics, path)
        sharded = [v.name for v in self._vars.values() if v.shard is not None]
        if sharded:
            raise ValueError(f"cannot save {path}: {sharded[0]} holds a block of a larger tensor (it has a "
                             "Shard); pass comm= to the Saver (distributed.local() for one process)")
        tensors = []
        for key, var in self._vars.items():
            try:
                tensors.append((key, var._read()))
            except UninitializedVariableError as exc:
                raise UninitializedVariableError(f"cannot save {path}: {exc}") from None
        meta: dict[str, Any] = _formats.normalize_metadata(metadata, path)
        store = store_of(path, self._storage_options)
        read_owner(store, path)  # found now, not later in the background
        if self._incremental is not None:
            return self._save_incremental(store, path, fmt, tensors, meta, step, scores, blocking)
        if not blocking:
            if not _urls.is_url(path):
                require_directory(path)
            return self._background.submit(
                path, tensors, lambda sources: self._commit(store, path, fmt, sources, meta, step, scores,
                                                            background=True))
        return self._commit(store, path, fmt, tensors, meta, step, scores)

    def _save_sharded_async(self, path_arg: Any, global_step: Any, metadata: Any, metrics: Any) -> SaveFuture:
        """Snapshot this rank's variables, then run the collective save in a background thread on a
        duplicate of the communicator (its collectives never meet training's own)."""
        try:
            self._background.wait()  # the save in flight, and its error if nobody has seen it
            path, fmt = self._target(path_arg, global_step)
            step = None if global_step is None else operator.index(global_step)
            metadata = _formats.normalize_metadata(metadata, path)
            scores = check_metrics(metrics, path)
            inc = self._sharded_incremental(path, fmt)
            tensors, missing = [], set()
            for key, var in self._vars.items():
                if var.is_initialized():
                    tensors.append((key, var._read()))
                else:
                    missing.add(key)  # reported to every rank by the save's plan, not raised here alone
        except Exception as exc:
            if self._async_comm is None:
                self._agree_before_dup(where(path_arg), exc)
            else:  # the others' saves (in the background) hear of it now, not at their timeout
                comm, problem = self._async_comm, exc  # (``exc`` is unbound once the except block ends)
                self._background.take_part(where(path_arg), lambda: self._fail_together(comm, path_arg, problem))
            raise
        if self._async_comm is None:
            self._agree_before_dup(path, None)
            from ckpt.distributed.comm import duplicate  # lazy: only a Saver with comm= loads the collectives

            try:  # a collective: every rank's first asynchronous save (bounded where dup takes a timeout)
                self._async_comm = duplicate(self._comm, self._timeout)
            except CheckpointError as exc:
                raise CheckpointWriteError(f"{path}: the asynchronous save did not start on rank {self._comm.rank}: "
                                           f"{exc}; nothing was written") from exc
        comm = self._async_comm

        def write(sources: Any) -> str:
            values: dict[str, Any] = dict.fromkeys(missing)
            values.update(sources)
            return self._saved_sharded(path, self._run_sharded(comm, path, fmt, step, metadata, values,
                                                               metrics=scores, incremental=inc), inc)

        return self._background.submit(path, tensors, write)

    def _save_sharded(self, path_arg: Any, global_step: Any, metadata: Any, metrics: Any) -> str:
        """The blocking collective save on the Saver's communicator. A rank that fails before the
        save's first exchange (a bad path or step, metadata it cannot store, an unseen error of its
        last asynchronous save) still takes part in it with its error, then raises that error: the
        other ranks raise at once, naming it, instead of waiting ``timeout`` seconds for it."""
        try:
            self._background.wait()
            path, fmt = self._target(path_arg, global_step)
            step = None if global_step is None else operator.index(global_step)
            metadata = _formats.normalize_metadata(metadata, path)
            scores = check_metrics(metrics, path)
            inc = self._sharded_incremental(path, fmt)
        except Exception as exc:
            self._fail_together(self._comm, path_arg, exc)
            raise
        return self._saved_sharded(path, self._run_sharded(self._comm, path, fmt, step, metadata, metrics=scores,
                                                           incremental=inc), inc)

    def _run_sharded(self, comm: Any, path: str, fmt: Any, step: int | None, metadata: dict[str, Any],
                     values: Mapping[str, Any] | None = None, failure: str | None = None,
                     metrics: Mapping[str, float] | None = None, incremental: Any = None) -> list[str]:
        """This rank's part of the collective save (``ckpt.distributed.save.save_sharded``)."""
        # lazy: only Savers given a comm load the distributed save (start-up of `import ckpt`)
        from ckpt.distributed.save import Job, save_sharded

        job = Job(self._vars, self._retention, self._storage_options, metrics, self._compression, incremental)
        return save_sharded(job, comm, self._timeout, path, fmt, step, metadata, values, failure)

    def _sharded_incremental(self, path: str, fmt: Any) -> Any:
        """The ``IncrementalJob`` of an incremental Saver's sharded save (None for other Savers),
        counted for full_every; an object-store URL is refused here, on every rank."""
        if self._incremental is None:
            return None
        refuse_unsupported(path, fmt, sharded=True)
        from ckpt.distributed.incremental import IncrementalJob  # lazy: only with comm=

        full_every, chunk_bytes, max_chain = self._incremental
        job = IncrementalJob(chunk_bytes, full=full_every is not None and self._saves % full_every == 0,
                             encoding=Encoding(self._compression, max_chain, self._previous, self._notes,
                                               save=self._saves))
        self._saves += 1
        self.last_incremental = None  # until this save commits
        return job

    def _saved_sharded(self, path: str, kept: list[str], incremental: Any = None) -> str:
        self._last_checkpoints, self._saved = kept, True
        if incremental is not None:
            self.last_incremental = incremental.stats  # this rank's chunks (and rank 0's collection)
            # none after a full save: it cuts every chain
            self._previous, self._notes = incremental.stats.entries, incremental.stats.notes
        return path

    def _fail_together(self, comm: Any, path_arg: Any, problem: Exception) -> None:
        """Take part in a sharded save's collectives on ``comm`` carrying ``problem`` (this rank's
        save failed before it started) in place of a plan, so every rank's save fails at once
        naming this rank and the ranks stay in step; the collective's own outcome is ignored
        (the caller raises ``problem``)."""
        try:
            self._run_sharded(comm, where(path_arg), None, None, {}, failure=f"{type(problem).__name__}: {problem}")
        except Exception:
            pass  # every rank's save failed with this rank's error, which the caller raises

    def _agree_before_dup(self, path: str, problem: Exception | None) -> None:
        """Before the first asynchronous save duplicates the communicator (a collective; a
        Communicator whose dup takes no timeout cannot time out in it), every rank says whether it
        got that far: a rank that failed makes every rank raise (itself its own error), a rank that
        never comes makes the others raise after the timeout, instead of waiting in dup for ever."""
        from ckpt.distributed.comm import decode, encode  # lazy: only with comm=

        mine = None if problem is None else f"{type(problem).__name__}: {problem}"
        try:
            got = [decode(r, path) for r in self._comm.allgather(encode(mine), self._timeout)]
        except CheckpointError as exc:
            if problem is not None:
                raise problem from exc
            raise CheckpointWriteError(f"{path}: the asynchronous save did not start on rank {self._comm.rank}: "
                                       f"{exc}; nothing was written") from exc
        failed = [f"rank {rank}: {error}" for rank, error in enumerate(got) if error is not None]
        if failed and problem is None:
            raise CheckpointWriteError(f"{path}: the asynchronous save did not start, it failed on " +
                                       "; ".join(failed) + "; nothing was written")

    def _save_incremental(self, store: Store, path: str, fmt: Any, tensors: list[tuple[str, Any]],
                          metadata: dict[str, Any], step: int | None, metrics: dict[str, float] | None,
                          blocking: bool) -> str | SaveFuture:
        """An incremental save (every full_every-th a self-contained one), then chunk collection."""
        assert self._incremental is not None
        full_every, chunk_bytes, max_chain = self._incremental
        refuse_unsupported(path, fmt)
        full = full_every is not None and self._saves % full_every == 0
        self._saves += 1
        counts = write_counts(self._vars)  # before any byte is read (hashed, or staged by blocking=False)
        encoding = Encoding(self._compression, max_chain, self._previous, self._notes,
                            unchanged=unchanged_keys(self._written, counts), save=self._saves)

        def write(sources: Any, background: bool = True) -> str:
            if not full:
                try:
                    done = save_chunked(store, os.path.basename(path), sources, metadata, chunk_bytes,
                                        self._retention.change(store, path, step, metrics), step, metrics,
                                        encoding)
                except StorageError as exc:
                    raise CheckpointWriteError(f"{path}: cannot save: {exc}; nothing was committed") from exc
                if done is not None:
                    state, self.last_incremental = done
                    stats = self.last_incremental
                    self._previous, self._notes, self._written = stats.entries, stats.notes, counts
                    self._saved_to(path, state)
                    return path
            # full_every, or an object store's collection held its chunk store: self-contained
            self._previous, self._notes, self._written = {}, {}, {}  # a self-contained save cuts every delta chain
            self._commit(store, path, fmt, sources, metadata, step, metrics, background)
            self.last_incremental = IncrementalStats(chunks_collected=collect(store))  # retention may free chunks
            return path

        self.last_incremental = None  # until this save commits (after wait() when in the background)
        if blocking:
            return write(tensors, background=False)
        if not _urls.is_url(path):
            require_directory(path)
        return self._background.submit(path, tensors, write)

    def _commit(self, store: Store, path: str, fmt: Any, tensors: Any, metadata: dict[str, Any], step: int | None,
                metrics: dict[str, float] | None, background: bool = False) -> str:
        """Write the checkpoint atomically and record it in the state file (``Store.commit``)."""
        name = os.path.basename(path)

        def write(blob: WritableBlob) -> None:
            # the GC switch is process-wide: a background save leaves it to the training loop
            with gc_paused() if not background else nullcontext():
                _formats.write_with(fmt, blob, tensors, metadata, self._compression)

        try:
            state = store.commit(name, write, self._retention.change(store, path, step, metrics), step, metrics)
        except CheckpointNotFoundError as exc:  # a missing bucket: as a missing directory is for files
            raise CheckpointNotFoundError(f"{path}: cannot save: {exc}") from exc
        except StorageError as exc:  # store faults on the way (the state file, listing orphans)
            raise CheckpointWriteError(f"{path}: cannot save: {exc}; nothing was committed") from exc
        self._saved_to(path, state)
        return path

    def should_save(self, step: int, now: float | None = None) -> bool:
        """True when ``save_interval_steps`` steps or ``save_interval_seconds`` seconds have passed
        since this Saver's last save (or, before its first save, since the checkpoint it restored:
        a resumed run goes on counting from there); False for the step last saved. With no
        interval set, True for every step not yet saved; before any save or restore, True.

        Args:
            step: the training step about to end.
            now: the time in seconds since the epoch (default: ``time.time()``).

        With ``comm``, every rank must call it at the same step: rank 0 decides and the others
        receive its answer (one broadcast, bounded by the Saver's timeout), so all ranks save
        the same step.

        Example:
            >>> import ckpt, os, tempfile
            >>> saver = ckpt.Saver([ckpt.Variable(1.0, name="w")], save_interval_steps=100)
            >>> path = os.path.join(tempfile.mkdtemp(), "m.h5")
            >>> [step for step in range(0, 350, 50) if saver.should_save(step) and saver.save(path, step)]
            [0, 100, 200, 300]
        """
        step = operator.index(step)
        if self._comm is not None:
            from ckpt.distributed.comm import decode, encode  # lazy: only with comm=

            mine = encode(self._intervals.due(step, now, self._storage_options)) if self._comm.rank == 0 else None
            return bool(decode(self._comm.broadcast(mine, 0, self._timeout), "should_save"))
        return self._intervals.due(step, now, self._storage_options)

    def wait(self) -> None:
        """Wait until this Saver's asynchronous save, if one is in flight, is committed.

        Raises:
            CheckpointError: that save failed, and its error was not already seen through its
                future (``result()``/``exception()``) or raised by a later ``save``.

        Example:
            >>> import ckpt, os, tempfile
            >>> saver = ckpt.Saver([ckpt.Variable(1.0, name="w")])
            >>> _ = saver.save(os.path.join(tempfile.mkdtemp(), "m.h5"), blocking=False)
            >>> saver.wait()
        """
        self._background.wait()

    def _saved_to(self, path: str, state: CheckpointState) -> None:
        self._last_checkpoints = kept_paths(path, state)
        self._saved = True

    def restore(self, path: str | os.PathLike[str], strict: bool = True,
                allow_cast: bool = False, *, best: bool = False, step: int | None = None) -> RestoreResult:
        """Restore this Saver's variables from a checkpoint file or a directory's latest.

        Everything is checked before any variable changes: missing keys (a KeyError, with the
        closest keys in the file), shape and dtype mismatches (a ValueError), all reported
        in one error. Data is read straight into the variables' buffers and verified.

        Args:
            path: a checkpoint file, or a directory (its latest checkpoint); a file named without
                its extension ("run/model-1" for run/model-1.h5) when exactly one has that name.
            strict: with False, keys missing from the file are skipped and listed in the
                result's ``missing`` instead of raising (mismatched shapes still raise).
            allow_cast: with True, a tensor whose dtype differs from its variable's is cast
                when the assign rule allows it (numpy's same_kind: float32 -> float64,
                float64 -> float32, int -> float; an integer that does not fit still fails,
                before any variable changes). Off by default.
            best: with True, ``path`` is a directory and its best checkpoint by the Saver's
                ``best_metric`` / ``best_mode`` is restored (``ckpt.best_checkpoint``).
            step: ``path`` is a directory and its checkpoint saved with ``global_step=step`` is
                restored (orbax's ``restore(step)``; ``ckpt.all_steps`` lists them).

        Returns:
            A RestoreResult with ``restored``, ``missing`` and ``unexpected`` keys.

        Raises:
            CheckpointNotFoundError: with ``best``, no checkpoint of the directory has the metric;
                with ``step``, none has that step.
            ValueError: ``best`` on a Saver without ``best_metric``; ``best`` and ``step`` together.
            TypeError: ``path`` is not a path (the message names the argument).
        """
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"restore(path=...) takes a checkpoint file or directory (a str or os.PathLike), "
                            f"got a {type(path).__name__}; the variables are given to Saver(...)")
        if best and step is not None:
            raise ValueError("restore takes best=True or step=, not both")
        if best:
            path = self._best_in(path)
        elif step is not None:
            path = checkpoint_at_step(path, step, self._storage_options)
        if self._comm is not None:
            from ckpt.distributed.restore import restore_collective  # lazy: only with comm=

            result = restore_collective(path, self._vars, self._comm, self._timeout, strict, allow_cast,
                                        self._storage_options)
        else:
            result = restore_variables(path, self._vars, strict=strict, allow_cast=allow_cast,
                                       storage_options=self._storage_options)
            self._restored_from = result.path
        self._intervals.restored(result.path)  # no save yet: should_save counts from there
        return result

    def restore_or_initialize(self, directory: str | os.PathLike[str], strict: bool = True,
                              allow_cast: bool = False) -> str | None:
        """Restore the directory's latest checkpoint and return its path, or, when it has none,
        initialize this Saver's uninitialized variables and return None (TF2 CheckpointManager's
        ``restore_or_initialize``): the first line of a training script that may be resumed.

        A directory that does not exist yet has no checkpoint. Initialized variables are left as
        they are when there is nothing to restore.

        Example:
            >>> import ckpt, tempfile, os
            >>> d = tempfile.mkdtemp()
            >>> with ckpt.deferred_init():
            ...     w = ckpt.Variable(ckpt.initializers.Ones(), shape=(2,), name="w")
            >>> saver = ckpt.Saver([w])
            >>> saver.restore_or_initialize(d) is None, w.numpy()
            (True, array([1., 1.], dtype=float32))
            >>> _ = w.assign([5.0, 6.0]); path = saver.save(os.path.join(d, "model.h5"), global_step=1)
            >>> _ = w.assign([0.0, 0.0])
            >>> saver.restore_or_initialize(d) == path, w.numpy()
            (True, array([5., 6.], dtype=float32))
        """
        where = os.fspath(directory)
        local_missing = not _urls.is_url(where) and not os.path.isdir(where)
        latest = None if local_missing else latest_checkpoint(where, self._storage_options)
        if latest is None:
            for var in self._vars.values():
                if not var.is_initialized():
                    var.initialize()
            return None
        return self.restore(latest, strict=strict, allow_cast=allow_cast).path

    def _best_in(self, directory: str | os.PathLike[str]) -> str:
        """The best checkpoint of ``directory`` by this Saver's metric."""
        metric, mode = self._retention.best_metric, self._retention.best_mode
        if metric is None:
            raise ValueError("restore(best=True) needs a Saver with best_metric (and best_mode)")
        found = best_checkpoint(directory, metric, mode, self._storage_options)
        if found is None:
            where = os.fspath(directory)
            raise CheckpointNotFoundError(f"{where}: no checkpoint has the metric {metric!r} (restore(best=True) "
                                          f"ranks by it, best_mode={mode!r})", path=where, key=metric)
        return found

    def __repr__(self) -> str:
        return f"<ckpt.Saver {len(self._vars)} variables format={self._format.name}>"
