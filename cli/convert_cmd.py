"""``ckpt convert SRC DST``: rewrite a checkpoint in another format, a subset, or renamed (``ckpt.convert``).

Everything is checked before anything is written; the new file is written to a temporary
file, read back and checked against SRC, and only then renamed to DST, so a failure never
leaves a half-written DST.
"""

from __future__ import annotations

import os
import re

import click

import ckpt

from .errors import check_compression, check_regex, reports_errors
from .progress import byte_bar
from .text import count

__all__ = ["parse_renames", "convert"]


def parse_renames(values: tuple[str, ...]) -> dict[str, str]:
    """Parse "OLD=NEW" scope renames; a trailing "/" is optional and NEW may be empty.

    Raises:
        click.BadParameter: not in the form OLD=NEW, or an OLD given twice.

    Example:
        >>> parse_renames(("enc/=encoder", "model="))
        {'enc': 'encoder', 'model': ''}
    """
    renames: dict[str, str] = {}
    for value in values:
        old, sep, new = value.partition("=")
        old, new = old.rstrip("/"), new.rstrip("/")
        if not sep or not old:
            raise click.BadParameter(f"{value!r} is not in the form OLD=NEW", param_hint="--rename")
        if old in renames:
            raise click.BadParameter(f"{old!r} is renamed twice", param_hint="--rename")
        renames[old] = new
    return renames


def _in_flags(exc: ckpt.KeyNotFoundError, path: str, pattern: str | None) -> ckpt.KeyNotFoundError:
    """The library's words for a key problem, in the command's flags ("rename" -> "--rename")."""
    message, prefix = str(exc), f"{path}: "
    if message.startswith(prefix + "rename "):
        return ckpt.KeyNotFoundError(prefix + "--" + message[len(prefix):])
    if pattern is not None and message == f"{prefix}no tensor key matches {pattern!r}":
        return ckpt.KeyNotFoundError(f"{prefix}no tensor key matches --keys {pattern!r}")
    return exc


@click.command()
@click.argument("src")
@click.argument("dst")
@click.option("--keys", "pattern", metavar="REGEX", help="Only the tensors whose key matches REGEX.")
@click.option("--rename", multiple=True, metavar="OLD=NEW",
              help="Rename the scope OLD to NEW (repeatable; NEW may be empty).")
@click.option("--force", is_flag=True, help="Replace DST if it exists.")
@click.option("--shards", type=click.IntRange(1, 99999), metavar="N",
              help="Write a sharded checkpoint (a directory): each tensor split along its first axis "
                   "into N files.")
@click.option("--compression", type=click.Choice(["zstd", "none"], case_sensitive=False), default="none",
              show_default=True, help="Store DST's numeric tensors as losslessly compressed byte planes (zstd; "
                                      ".msgpack only), or uncompressed (none), whatever SRC is.")
@reports_errors()
def convert(src: str, dst: str, pattern: str | None, rename: tuple[str, ...], force: bool,
            shards: int | None, compression: str) -> None:
    """Convert a checkpoint between formats; extract or rename keys.

    DST's extension names the format; SRC's tensors and metadata are written to it. An
    existing DST is replaced only with --force; missing directories are created.

    \b
    ckpt convert model.h5 model.msgpack
    ckpt convert run/ encoder.h5 --keys '^enc/' --rename enc=encoder
    ckpt convert model.h5 sharded.msgpack --shards 4
    ckpt convert model.h5 small.msgpack --compression zstd
    ckpt convert run/model-100.msgpack whole.h5     (a sharded checkpoint to one file)
    """
    try:
        fmt = ckpt.writable_format(dst)
    except ckpt.UnsupportedCheckpointError as exc:
        raise click.BadParameter(str(exc), param_hint="DST") from exc
    codec = check_compression(compression, fmt, dst)
    remote = "://" in dst and not dst.startswith("file://")  # an object store: committed create-only
    if remote and force:
        raise click.BadParameter("an object-store DST is written once (create-only): no --force",
                                 param_hint="DST")
    if not remote and os.path.lexists(dst) and not force:
        raise click.BadParameter(f"{dst} exists; pass --force to replace it", param_hint="DST")
    if pattern is not None:
        check_regex(pattern, "--keys")
    renames = parse_renames(rename)
    with ckpt.load_checkpoint(src) as reader:
        total = sum(info.nbytes for key, info in reader.tensors.items() if pattern is None or re.search(pattern, key))
        try:
            with byte_bar(2 * total, "converting") as progress:  # written, then read back and checked
                done = ckpt.convert(reader, dst, pattern, renames=renames, shards=shards, overwrite=force,
                                    progress=progress, compression=codec)
        except ckpt.KeyNotFoundError as exc:
            raise _in_flags(exc, reader.path, pattern) from exc
        except ckpt.CheckpointError:
            raise
        except ValueError as exc:  # the renames give two keys one name, or make a key ckpt refuses
            raise click.BadParameter(str(exc), param_hint="--rename") from exc
    what = f"{done.format}, {done.shards} shards" if done.shards is not None else done.format
    what += f", {codec}-compressed" if codec else ""
    click.echo(f"{dst} ({what}): {count(len(done.keys), 'tensor')} from {done.source} ({done.source_format})"
               + (f", {done.renamed} renamed" if done.renamed else "") + "; read back and checked")
