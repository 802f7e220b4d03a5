"""``ckpt ls DIR``: a directory's checkpoints, from its state file, and the files it does not know."""

from __future__ import annotations

import json
import os
import time
from typing import Any
from collections.abc import Iterator

import click

import ckpt
from ckpt.atomic import is_temporary
from ckpt.errors import CheckpointNotFoundError
from ckpt.formats import base
from ckpt.state import STATE_FILE, read_state

from .errors import reports_errors

__all__ = ["ls", "human_size"]


def human_size(nbytes: int) -> str:
    """Bytes for people: "512 B", "4.1 KiB", "1.5 GiB".

    Example:
        >>> human_size(512), human_size(4200), human_size(3 << 30)
        ('512 B', '4.1 KiB', '3.0 GiB')
    """
    size, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{nbytes} B" if unit == "B" else f"{size:.1f} {unit}"


def _when(seconds: float | None) -> str:
    # TensorFlow state files without timestamps give 0
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds)) if seconds else "-"


def _files_of(path: str) -> list[str]:
    """The files of a checkpoint: the file itself, or those of a prefix (TensorFlow's
    "model.ckpt-7" is model.ckpt-7.index and model.ckpt-7.data-*)."""
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):  # a sharded checkpoint: its commit record and shard files
        return [os.path.join(path, n) for n in sorted(os.listdir(path)) if not n.startswith(".")]
    parent, prefix = os.path.split(path)
    try:
        names = os.listdir(parent or ".")
    except OSError:
        return []
    return [os.path.join(parent, n) for n in sorted(names) if n.startswith(prefix + ".")]


def _size(files: list[str]) -> int | None:
    return sum(os.path.getsize(f) for f in files) if files else None


def _rows(directory: str) -> Iterator[dict[str, Any]]:
    """{"path", "step", "time", "size", "note"} for each entry of the state file, then unknown
    files (step, time and size are None when unknown)."""
    state = read_state(directory)
    latest = ckpt.latest_checkpoint(directory)
    known: set[str] = set()
    if state is not None:
        preserved = {e.path for e in state.preserved}
        for entry in state.all_entries():
            full = os.path.join(directory, entry.path)  # TensorFlow may record absolute paths
            files = _files_of(full)
            known.update(os.path.abspath(f) for f in files)
            note = "latest" if full == latest else "missing" if not base.checkpoint_exists(full) else \
                "preserved" if entry.path in preserved else ""
            yield {"path": entry.path, "step": entry.step, "time": entry.time or None, "size": _size(files),
                   "note": note}
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if os.path.abspath(full) in known or name == STATE_FILE or is_temporary(name) or \
                not os.path.isfile(full) or base.format_for_path(name) is None:
            continue
        yield {"path": name, "step": None, "time": os.path.getmtime(full), "size": _size([full]),
               "note": f"not in the '{STATE_FILE}' state file"}


@click.command()
@click.argument("directory")
@click.option("--json", "as_json", is_flag=True,
              help='Print one JSON document: "directory" and "checkpoints", each with "path", "step", '
                   '"time" (seconds since the epoch), "size" (bytes), "latest" and "note".')
@reports_errors()
def ls(directory: str, as_json: bool) -> None:
    """List a directory's checkpoints.

    From its state file: path, step, time (UTC), size, which is latest.

    Checkpoint files the state file does not know are listed too, marked as such.

    \b
    ckpt ls run/
    """
    rows: list[dict[str, Any]]
    if "://" in directory and not directory.startswith("file://"):  # an object store: the same rows,
        from ckpt._remote import listing  # from the state file and the commit records

        rows = [{"path": name, "step": step, "time": when, "size": size, "note": note}
                for name, step, when, size, note in listing(directory)]
    elif not os.path.isdir(directory):
        what = "not a directory" if os.path.exists(directory) else "no such directory"
        raise CheckpointNotFoundError(f"{directory}: {what}")
    else:
        rows = list(_rows(directory))
    if not rows:
        raise CheckpointNotFoundError(f"{directory}: no checkpoints (no '{STATE_FILE}' state file and no "
                                      "checkpoint files)")
    if as_json:
        checkpoints = [{**row, "latest": row["note"] == "latest"} for row in rows]
        click.echo(json.dumps({"directory": directory, "checkpoints": checkpoints}))
        return
    table = [("path", "step", "saved (UTC)", "size", "")] + [
        (row["path"], "-" if row["step"] is None else str(row["step"]), _when(row["time"]),
         "-" if row["size"] is None else human_size(row["size"]), row["note"]) for row in rows]
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    for path, step, when, size, note in table:
        line = f"{path:<{widths[0]}}  {step:>{widths[1]}}  {when:<{widths[2]}}  {size:>{widths[3]}}  {note}"
        click.echo(line.rstrip())
