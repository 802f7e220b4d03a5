"""``ckpt ls DIR``: a directory's checkpoints (``ckpt.list_checkpoints``) as a table or JSON."""

from __future__ import annotations

import json
import time

import click

import ckpt

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


@click.command()
@click.argument("directory")
@click.option("--json", "as_json", is_flag=True,
              help='Print one JSON document: "directory" and "checkpoints", each with "path", "step", '
                   '"time" (seconds since the epoch), "size" (bytes), "latest", "note", "metrics" '
                   '(null when its save was given none), "owned" and "shared" (bytes).')
@reports_errors()
def ls(directory: str, as_json: bool) -> None:
    """List a directory's checkpoints.

    From its state file: path, step, time (UTC), size, the metrics its save was given (a
    column shown when any checkpoint has them), which is latest. When any checkpoint is
    incremental, two more columns: the bytes each one owns (its file and the chunks only it
    references: what deleting it frees) and the bytes of the chunks it shares with others.

    Checkpoint files the state file does not know are listed too, marked as such.

    \b
    ckpt ls run/
    """
    rows = ckpt.list_checkpoints(directory)
    if as_json:
        click.echo(json.dumps({"directory": directory, "checkpoints": [row.to_json() for row in rows]}))
        return
    with_metrics = any(row.metrics for row in rows)  # runs without metrics keep the table they had
    with_usage = any(row.shared or row.owned != row.size for row in rows)  # only incremental checkpoints share
    table = [("path", "step", "saved (UTC)", "size") + (("owns", "shares") if with_usage else ())
             + (("metrics",) if with_metrics else ()) + ("",)] + [
        (row.path, "-" if row.step is None else str(row.step), _when(row.time), _bytes(row.size))
        + ((_bytes(row.owned), _bytes(row.shared)) if with_usage else ())
        + ((_metrics(row.metrics),) if with_metrics else ()) + (row.note,) for row in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    right = {1, 3, 4, 5} if with_usage else {1, 3}  # numbers align right
    for row in table:
        cells = [f"{cell:>{widths[i]}}" if i in right else f"{cell:<{widths[i]}}" for i, cell in enumerate(row[:-1])]
        click.echo("  ".join(cells + [row[-1]]).rstrip())


def _bytes(nbytes: int | None) -> str:
    return "-" if nbytes is None else human_size(nbytes)


def _metrics(metrics: dict[str, float] | None) -> str:
    """The metrics as "val_loss=0.31 acc=0.91" ("-" for none), short enough for a table."""
    return " ".join(f"{name}={value:.6g}" for name, value in metrics.items()) if metrics else "-"
