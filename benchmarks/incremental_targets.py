"""Case ``incremental`` of ``python -m benchmarks``: issue 28's two targets for ``Saver(incremental=True)``, on disk.

- **frozen backbone**: a float32 model of ``model_mib`` (default 1 GiB): a backbone of 16 MiB
  tensors (90% of the bytes) that never changes and a head (10%) rewritten before every save; ``saves`` saves after
  the first (which fills the chunk store). Per save: bytes written (the new pack + the index)
  / the model, the save's time against a full (self-contained msgpack) save of the same values,
  interleaved; then every kept checkpoint (``max_to_keep=3``) is restored from a cold page cache
  and checked bit-exact, against the restore of the last full save. The control: the same
  restores of a fresh copy of the incremental directory (a disk that reads recently written
  blocks faster, as this project's virtual disk does, favours the full checkpoint, written last,
  over the backbone's chunks, written by the first save).
- **sparse rows**: a float32 table of ``rows`` x 64 (default 2**20: 256 MiB) of which 1% of the
  rows (random, seeded) change before every save; ``table_saves`` saves after the first. Per save:
  bytes written / the table (median, mean, max), save time against a full save, interleaved;
  then the last checkpoint restored cold and checked bit-exact.

Also the memory the Saver keeps between saves (its copies of the chunks that changed, the
bases of the next deltas), as a share of the model: the largest after any save.

Every save is durable (its pack, the index, their folders and the state file fsynced), as a
full save is. Digests of the values at each step are taken outside the timed parts.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

import ckpt

from .run import evict, fmt_row

MiB = 1 << 20
TENSOR_MIB = 16
DIM, ROW_SHARE, KEEP = 64, 0.01, 3


@dataclass
class Run:
    """Figures of one model's saves."""

    written: list[float] = field(default_factory=list)  # share of the model per save
    kept: list[float] = field(default_factory=list)  # the Saver's copies of changed chunks, share of the model
    incremental: list[float] = field(default_factory=list)
    full: list[float] = field(default_factory=list)
    restore: list[float] = field(default_factory=list)  # incremental restores, cold
    full_restore: list[float] = field(default_factory=list)
    #: restores of a fresh copy of the last kept checkpoint's directory, and the full ones beside them
    copy_restore: list[float] = field(default_factory=list)
    copy_full_restore: list[float] = field(default_factory=list)
    exact: list[bool] = field(default_factory=list)
    files: int = 0


def _variable(key: str, shape: tuple[int, ...], rng: np.random.Generator) -> ckpt.Variable:
    var = ckpt.Variable(ckpt.initializers.Zeros(), shape=shape, name=key)
    rng.standard_normal(out=var._value, dtype=np.float32)  # fill in place: no second copy
    return var


def frozen_backbone(model_mib: int) -> tuple[dict[str, ckpt.Variable], Callable[[np.random.Generator], list[str]]]:
    """A backbone of 16 MiB tensors (90% of the model) that never changes and one head tensor (10%)
    rewritten entirely before every save."""
    rng = np.random.default_rng(0)
    total = model_mib * MiB // 4  # float32 elements
    head_n = total // 10
    sizes = [TENSOR_MIB * MiB // 4] * ((total - head_n) // (TENSOR_MIB * MiB // 4))
    sizes += [total - head_n - sum(sizes)] if total - head_n > sum(sizes) else []
    variables = {f"backbone/{i:03d}/w": _variable(f"backbone/{i:03d}/w", (n,), rng) for i, n in enumerate(sizes)}
    head = variables["head/w"] = _variable("head/w", (head_n,), rng)

    def change(r: np.random.Generator) -> list[str]:
        head.assign(r.standard_normal(head.shape, dtype=np.float32))  # as training code writes a variable
        return [head.key]

    return variables, change


def sparse_table(rows: int) -> tuple[dict[str, ckpt.Variable], Callable[[np.random.Generator], list[str]]]:
    """One table whose rows change 1% at a time."""
    table = _variable("embedding/table", (rows, DIM), np.random.default_rng(0))

    def change(r: np.random.Generator) -> list[str]:
        at = r.choice(rows, size=max(1, int(rows * ROW_SHARE)), replace=False)
        # rows in place, through the buffer a write is counted for (an optimizer's sparse update;
        # Variable has no public scatter): the save must not reuse the table's previous entry
        table._writable_buffer()[at] += r.standard_normal((len(at), DIM), dtype=np.float32) * 0.01
        return [table.key]

    return {table.key: table}, change


def _digests(variables: dict[str, ckpt.Variable], keys: list[str]) -> dict[str, bytes]:
    return {k: hashlib.sha256(variables[k]._value).digest() for k in keys}


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _evict_all(directory: str) -> None:
    """Flush and drop every file of ``directory`` (chunks included) from the page cache."""
    for folder, _, names in os.walk(directory):
        for name in names:
            evict(os.path.join(folder, name))


def measure(variables: dict[str, ckpt.Variable], change: Callable[[np.random.Generator], list[str]],
            directory: str, saves: int, restore_kept: bool, chunk_bytes: int | None = None,
            restore_reps: int = 3) -> Run:
    """``saves`` incremental saves after the first, each beside a full save; then cold restores,
    ``restore_reps`` of each kept checkpoint, each beside one of the last full checkpoint, which of
    the two goes first alternating (a restore from disk varies by tens of percent from one run to
    the next on a shared virtual disk: more samples, fewer surprises); ``chunk_bytes``: the
    incremental Saver's, None for its default."""
    total = sum(v._value.nbytes for v in variables.values())
    inc_dir, full_dir = os.path.join(directory, "inc"), os.path.join(directory, "full")
    os.makedirs(inc_dir)
    os.makedirs(full_dir)
    chunks = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    saver = ckpt.Saver(variables, max_to_keep=KEEP, incremental=True, **chunks)
    full = ckpt.Saver(variables, max_to_keep=1, format="msgpack")
    out, rng = Run(), np.random.default_rng(1)
    state = _digests(variables, list(variables))
    want: dict[str, dict[str, bytes]] = {}
    try:
        want[saver.save(os.path.join(inc_dir, "m.msgpack"), global_step=0)] = dict(state)
        for step in range(1, saves + 1):
            state.update(_digests(variables, change(rng)))
            saved: list[str] = []
            inc = _timed(lambda: saved.append(saver.save(os.path.join(inc_dir, "m.msgpack"), global_step=step)))
            stats = saver.last_incremental
            assert stats is not None
            out.written.append((stats.bytes_written + os.path.getsize(saved[0])) / total)
            out.kept.append(sum(len(n) for n in stats.notes.values() if isinstance(n, bytes)) / total)
            out.incremental.append(inc)
            out.full.append(_timed(lambda: full.save(os.path.join(full_dir, "m.msgpack"), global_step=step)))
            want[saved[0]] = dict(state)
        out.files = len(os.listdir(os.path.join(inc_dir, ".ckpt-chunks")))
        kept = [p for p in want if os.path.exists(p)]
        last_full = ckpt.latest_checkpoint(full_dir)
        assert last_full is not None

        def cold_restores(path: str, expected: dict[str, bytes], inc_out: list[float], full_out: list[float]) -> None:
            """``restore_reps`` cold restores of ``path``, each beside one of the last full
            checkpoint, which goes first alternating; each checked bit-exact."""
            for rep in range(restore_reps):
                for which in ("inc", "full") if rep % 2 == 0 else ("full", "inc"):
                    if which == "full":
                        _evict_all(full_dir)
                        full_out.append(_timed(lambda: full.restore(last_full)))
                        continue
                    _evict_all(os.path.dirname(path))
                    inc_out.append(_timed(lambda: saver.restore(path)))
                    out.exact.append(_digests(variables, list(variables)) == expected)

        for path in kept if restore_kept else kept[-1:]:
            cold_restores(path, want[path], out.restore, out.full_restore)
        if restore_kept:  # the control: the same files freshly written, as the full checkpoint is
            copy_dir = os.path.join(directory, "inc-copy")
            _fresh_copy(inc_dir, copy_dir)
            cold_restores(os.path.join(copy_dir, os.path.basename(kept[-1])), want[kept[-1]], out.copy_restore,
                          out.copy_full_restore)
    finally:
        for folder in (inc_dir, full_dir, os.path.join(directory, "inc-copy")):
            shutil.rmtree(folder, ignore_errors=True)
    return out


def _fresh_copy(source: str, target: str) -> None:
    """Copy a checkpoint directory file by file, durably (its bytes written now, in new blocks)."""
    for folder, _, names in os.walk(source):
        into = os.path.join(target, os.path.relpath(folder, source))
        os.makedirs(into, exist_ok=True)
        for name in names:
            with open(os.path.join(folder, name), "rb") as src, open(os.path.join(into, name), "wb") as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
                dst.flush()
                os.fsync(dst.fileno())


def _ratio(full: list[float], inc: list[float]) -> str:
    return f"{statistics.median(full) / statistics.median(inc):.2f}x"


def incremental_targets(label: str, directory: str, model_mib: int, saves: int, rows: int, table_saves: int,
                        chunk_bytes: int | None = None, restore_reps: int = 3) -> str:
    """The markdown table of both targets, saved in ``directory`` (``chunk_bytes``: the incremental
    Saver's, None for its default)."""
    chunk = "the default chunk_bytes" if chunk_bytes is None else f"chunk_bytes={chunk_bytes >> 20} MiB"
    lines = [f"**incremental on {label} ({chunk}; issue 28 targets): bytes written per save (new pack + "
             "index) / the model; save and cold restore against a full msgpack save / restore of the same values, "
             "interleaved; medians**\n",
             fmt_row(["model", "saves", "written / model: median, mean, max", "incremental save s",
                      "full save s", "speed-up", "restore s (kept steps)", "full restore s", "restore / full",
                      "a fresh copy's restore / full", "bit-exact", "files in the chunk store",
                      "memory kept / model"]),
             fmt_row(["---"] * 13)]
    for name, make, arg, count, every in (
            (f"frozen backbone {model_mib} MiB, 10% changes", frozen_backbone, model_mib, saves, True),
            (f"table {rows} x {DIM} float32, 1% rows", sparse_table, rows, table_saves, False)):
        variables, change = make(arg)
        run = measure(variables, change, directory, count, every, chunk_bytes, restore_reps)
        del variables
        lines.append(fmt_row([
            name, str(count),
            f"{statistics.median(run.written):.1%}, {statistics.mean(run.written):.1%}, {max(run.written):.1%}",
            f"{statistics.median(run.incremental):.3f}", f"{statistics.median(run.full):.3f}",
            _ratio(run.full, run.incremental), f"{statistics.median(run.restore):.3f} ({len(run.restore)})",
            f"{statistics.median(run.full_restore):.3f}",
            f"{statistics.median(run.full_restore) / statistics.median(run.restore):.2f}x",
            _ratio(run.copy_full_restore, run.copy_restore) if run.copy_restore else "-",
            "yes" if all(run.exact) else "**NO**", f"{run.files:,}", f"{max(run.kept):.0%}"]))
    return "\n".join(lines)
