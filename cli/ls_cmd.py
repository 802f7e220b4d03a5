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
                   '"time" (seconds since the epoch), "size" (bytes), "latest", "note" and "metrics" '
                   '(null when its save was given none).')
@reports_errors()
def ls(directory: str, as_json: bool) -> None:
    """List a directory's checkpoints.

    From its state file: path, step, time (UTC), size, the metrics its save was given (a
    column shown when any checkpoint has them), which is latest.

    Checkpoint files the state file does not know are listed too, marked as such.

    \b
    ckpt ls run/
    """
    rows = ckpt.list_checkpoints(directory)
    if as_json:
        click.echo(json.dumps({"directory": directory, "checkpoints": [row.to_json() for row in rows]}))
        return
    with_metrics = any(row.metrics for row in rows)  # runs without metrics keep the table they had
    table = [("path", "step", "saved (UTC)", "size") + (("metrics",) if with_metrics else ()) + ("",)] + [
        (row.path, "-" if row.step is None else str(row.step), _when(row.time),
         "-" if row.size is None else human_size(row.size)) + ((_metrics(row.metrics),) if with_metrics else ())
        + (row.note,) for row in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        cells = [f"{row[0]:<{widths[0]}}", f"{row[1]:>{widths[1]}}", f"{row[2]:<{widths[2]}}", f"{row[3]:>{widths[3]}}"]
        cells += [f"{row[4]:<{widths[4]}}"] if with_metrics else []
        click.echo("  ".join(cells + [row[-1]]).rstrip())


def _metrics(metrics: dict[str, float] | None) -> str:
    """The metrics as "val_loss=0.31 acc=0.91" ("-" for none), short enough for a table."""
    return " ".join(f"{name}={value:.6g}" for name, value in metrics.items()) if metrics else "-"
