"""``ckpt average P1 P2 ... -o OUT``: the weighted average of checkpoints (``ckpt.average_checkpoints``).

Float tensors are averaged in float64 and written in their own dtype; integer, bool and string
tensors must be equal in every input and are copied. OUT is written atomically.
"""

from __future__ import annotations

import math
import os

import click

import ckpt

from .errors import check_compression, reports_errors
from .text import count

__all__ = ["parse_weights", "average"]


def parse_weights(value: str | None, inputs: int) -> list[float] | None:
    """Parse "--weights 0.2,0.3,0.5": one finite non-negative number per checkpoint.

    Raises:
        click.BadParameter: not numbers, or not one per checkpoint.

    Example:
        >>> parse_weights("1,3", 2)
        [1.0, 3.0]
    """
    if value is None:
        return None
    try:
        weights = [float(part) for part in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of numbers",
                                 param_hint="--weights") from None
    if len(weights) != inputs:
        raise click.BadParameter(f"{len(weights)} weights for {count(inputs, 'checkpoint')}: give one per checkpoint",
                                 param_hint="--weights")
    if any(not math.isfinite(w) or w < 0 for w in weights) or not sum(weights) > 0:
        raise click.BadParameter("weights must be finite, non-negative and not all zero", param_hint="--weights")
    return weights


@click.command()
@click.argument("checkpoints", nargs=-1, required=True)
@click.option("-o", "--output", "out", required=True, metavar="OUT",
              help="The averaged checkpoint to write (its extension names the format).")
@click.option("--weights", metavar="W1,W2,...", help="One weight per checkpoint (divided by their sum).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--compression", type=click.Choice(["zstd", "none"], case_sensitive=False), default="none",
              show_default=True, help="Store OUT's numeric tensors losslessly compressed (zstd; .msgpack only).")
@reports_errors()
def average(checkpoints: tuple[str, ...], out: str, weights: str | None, force: bool, compression: str) -> None:
    """Average checkpoints into one: the weighted mean of their float tensors.

    Every checkpoint must hold the same keys, shapes and dtypes; integer, bool and string
    tensors must be equal in all of them and are copied. Float tensors are accumulated in
    float64 and written in their own dtype. OUT is written atomically; an existing OUT is
    replaced only with --force.

    \b
    ckpt average run/model-800.h5 run/model-900.h5 run/model-1000.h5 -o avg.h5
    ckpt average a.msgpack b.msgpack -o avg.msgpack --weights 0.25,0.75
    ckpt average a.msgpack b.msgpack -o avg.msgpack --compression zstd
    """
    shares = parse_weights(weights, len(checkpoints))
    try:
        fmt = ckpt.writable_format(out)
    except ckpt.UnsupportedCheckpointError as exc:
        raise click.BadParameter(str(exc), param_hint="-o") from exc
    codec = check_compression(compression, fmt, out)
    if "://" not in out and os.path.lexists(out) and not force:
        raise click.BadParameter(f"{out} exists; pass --force to replace it", param_hint="-o")
    ckpt.average_checkpoints(list(checkpoints), out, shares, overwrite=force, compression=codec)
    click.echo(f"{out}: the average of {count(len(checkpoints), 'checkpoint')}"
               + (f" (weights {weights})" if weights else ""))
