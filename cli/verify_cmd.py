"""``ckpt verify PATH``: check a checkpoint's structure and every tensor's checksum (``ckpt.verify``)."""

from __future__ import annotations

import json
import os

import click

import ckpt

from .errors import Failure, reports_errors
from .progress import byte_bar
from .text import count

__all__ = ["verify"]


@click.command()
@click.argument("path")
@click.option("--json", "as_json", is_flag=True,
              help='Print one JSON document: "path", "format", "checksummed", "tensors", "problems", "ok".')
@reports_errors()
def verify(path: str, as_json: bool) -> None:
    """Check a checkpoint's structure and every checksum.

    Prints each problem (naming the tensor) and exits 1 if there are any. PATH may be a
    directory of checkpoints: then every checkpoint its state file keeps is checked (for
    incremental checkpoints, every chunk each one references).

    Files that carry no checksums (HDF5 written by other tools) are read in full, which finds
    unreadable data but cannot vouch for the values; verify says so.

    \b
    ckpt verify model.h5 && cp model.h5 /backup/
    """
    if os.path.isdir(path) and ckpt.latest_checkpoint(path) is not None:  # a run's directory, not a sharded checkpoint
        _verify_directory(path, as_json)
        return
    with ckpt.load_checkpoint(path) as reader:
        with byte_bar(sum(info.nbytes for info in reader.tensors.values()), "verifying") as progress:
            report = ckpt.verify(reader, progress=progress)
    if as_json:
        click.echo(json.dumps(report.to_json()))
    else:
        for problem in report.problems:
            click.echo(problem)
    if report.problems:
        raise Failure(f"{report.path}: {count(len(report.problems), 'problem')} found", file=report.path)
    if as_json:
        return
    if not report.checksummed:
        click.echo(f"{report.path}: {count(report.tensors, 'tensor')} read without error; the file has no "
                   "checksums (not written by ckpt), so their values cannot be vouched for")
        return
    click.echo(f"{report.path}: OK ({count(report.tensors, 'tensor')}; the structure and every checksum match)")


def _verify_directory(directory: str, as_json: bool) -> None:
    reports = ckpt.verify_directory(directory)
    problems = [problem for report in reports for problem in report.problems]
    if as_json:
        click.echo(json.dumps({"directory": directory, "checkpoints": [r.to_json() for r in reports],
                               "ok": not problems}))
    else:
        for problem in problems:
            click.echo(problem)
    if problems:
        raise Failure(f"{directory}: {count(len(problems), 'problem')} found in "
                      f"{count(sum(not r.ok for r in reports), 'checkpoint')}", file=directory)
    if not as_json:
        click.echo(f"{directory}: OK ({count(len(reports), 'kept checkpoint')}; the structure and every checksum "
                   "match)")
