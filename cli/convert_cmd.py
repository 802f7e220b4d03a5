"""``ckpt convert SRC DST``: rewrite a checkpoint in another format, a subset, or renamed.

Everything is checked before anything is written (keys, dtypes, metadata); the new file is
written to a temporary file, read back and compared with SRC, and only then renamed to DST,
so a failure never leaves a half-written DST. Tensors go one at a time (the writer reads each
from SRC when it writes it; the check compares them one by one): memory holds one tensor.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import click
import numpy as np

import ckpt
from ckpt import dtypes
from ckpt.atomic import fsync_directory, replace_atomically, require_directory
from ckpt.errors import CheckpointWriteError, KeyNotFoundError, closest_hint
from ckpt.formats import base

from .errors import Failure, check_regex, reports_errors
from .progress import byte_bar
from .text import count

__all__ = ["parse_renames", "plan_keys", "convert"]

#: Bytes compared per step when checking the written file.
CHUNK = 64 << 20


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


def _renamed(key: str, renames: dict[str, str]) -> tuple[str, str | None]:
    """Apply the longest scope rename that covers ``key``; return (new key, the OLD used)."""
    for old in sorted(renames, key=len, reverse=True):
        if key == old or key.startswith(old + "/"):
            rest = key[len(old):]
            return (renames[old] + rest if renames[old] else rest.lstrip("/")), old
    return key, None


def plan_keys(keys: list[str], pattern: str | None, renames: dict[str, str], src: str) -> list[tuple[str, str]]:
    """Return [(key in SRC, key in DST)] for the keys matching ``pattern``, renamed.

    Raises:
        KeyNotFoundError: nothing matches ``pattern``, or an OLD scope covers no key.
        ValueError: two keys would get the same new key.

    Example:
        >>> plan_keys(["enc/w", "enc/b", "head/w"], "^enc/", {"enc": "encoder"}, "m.h5")
        [('enc/w', 'encoder/w'), ('enc/b', 'encoder/b')]
    """
    chosen = [k for k in keys if pattern is None or re.search(pattern, k)]
    if not chosen:
        raise KeyNotFoundError(f"{src}: no tensor key matches --keys {pattern!r}")
    plan: list[tuple[str, str]] = []
    used: set[str | None] = set()
    source: dict[str, str] = {}
    for key in chosen:
        new, old = _renamed(key, renames)
        if new in source:
            raise ValueError(f"{source[new]!r} and {key!r} would both become {new!r}")
        plan.append((key, new))
        used.add(old)
        source[new] = key
    for old in renames:
        if old not in used:
            raise KeyNotFoundError(f"{src}: --rename {old}=...: no tensor key is {old!r} or under "
                                   f"{old + '/'!r}{closest_hint(old, {k.split('/')[0] for k in chosen})}")
    return plan


def _writable_format(dst: str) -> Any:
    fmt = base.format_for_path(dst)
    writable = ", ".join(f"{'/'.join(f.extensions)} ({f.name})" for f in base.formats() if f.can_write)
    if fmt is None:
        raise click.BadParameter(f"cannot tell a checkpoint format from the extension of {dst!r}; use "
                                 f"one of {writable}", param_hint="DST")
    if not fmt.can_write:
        raise click.BadParameter(f"the {fmt.name} format can be read but not written; write one of "
                                 f"{writable}", param_hint="DST")
    return fmt


def _same_data(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-for-bit equality (NaN payloads included), compared in bounded chunks."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if dtypes.is_string(a.dtype):
        return bool(a.reshape(-1).tolist() == b.reshape(-1).tolist())
    va, vb = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
    return all(np.array_equal(va[i:i + CHUNK], vb[i:i + CHUNK]) for i in range(0, va.size, CHUNK))


class _Source:
    """A tensor of SRC that the writer reads only when it writes it (bounded memory)."""

    def __init__(self, reader: Any, info: Any, progress: Any) -> None:
        self.dtype, self.shape = info.dtype, info.shape
        self._reader, self._info, self._progress = reader, info, progress

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        value: np.ndarray = self._reader.get_tensor(self._info.key)
        if self._progress is not None:
            self._progress(self._info.nbytes)
        return value


def _check_written(fmt: Any, tmp: str, dst: str, source: Any, plan: list[tuple[str, str]],
                   metadata: dict[str, Any], progress: Any) -> None:
    """Read the new file back; raise CheckpointWriteError unless it holds exactly SRC's tensors."""

    def fail(what: str) -> CheckpointWriteError:
        return CheckpointWriteError(f"{dst}: the converted file does not read back as written ({what}); "
                                    "DST was not replaced")

    reader = fmt.open(tmp)
    try:
        if sorted(reader.tensors) != sorted(new for _, new in plan):
            raise fail("its keys differ")
        if reader.metadata != metadata:
            raise fail("its metadata differs")
        problems = reader.verify()
        if problems:
            raise fail(problems[0])
        for old, new in plan:
            if not _same_data(source.get_tensor(old), reader.read(new)):
                raise fail(f"tensor {new!r} differs")
            if progress is not None:
                progress(reader.tensors[new].nbytes)
    finally:
        reader.close()


def _write_sharded(reader: Any, plan: list[tuple[str, str]], metadata: dict[str, Any], dst: str, shards: int,
                   fmt: Any) -> None:
    """Write SRC's planned tensors as a sharded checkpoint: into a temporary directory, read back
    and compared, then renamed to DST (which must not exist)."""
    from ckpt.formats import ckpt_sharded as sharded

    if os.path.lexists(dst):
        raise Failure(f"{dst} exists; --shards writes a new directory and never replaces a checkpoint, "
                      "--force or not (remove it or pick another name)")
    parent = os.path.dirname(os.path.abspath(dst))
    require_directory(dst)  # missing directories are created, as for a single file
    old_of = {new: old for old, new in plan}
    specs = [(new, reader.tensors[old].dtype, reader.tensors[old].shape) for old, new in plan]

    def read(key: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
        return np.asarray(reader.get_slice(old_of[key], tuple(slice(o, o + n) for o, n in zip(offset, shape))))

    tmp = os.path.join(parent, f".{os.path.basename(dst)}.ckpt-tmp-{os.urandom(6).hex()}")
    try:
        sharded.write_single_process(tmp, specs, read, metadata, shards, ext=fmt.extensions[0])
        with sharded.ShardedReader(tmp) as written:
            problems = written.verify()
            if problems or written.metadata != metadata or sorted(written.tensors) != sorted(old_of):
                raise CheckpointWriteError(f"{dst}: the converted checkpoint does not read back as written "
                                           f"({problems[0] if problems else 'keys or metadata differ'})")
            for old, new in plan:
                if not _same_data(reader.get_tensor(old), written.read(new)):
                    raise CheckpointWriteError(f"{dst}: tensor {new!r} does not read back as written")
        os.rename(tmp, dst)
        fsync_directory(parent)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, ckpt.CheckpointError):
            raise type(exc)(str(exc).replace(tmp, dst)) from exc  # never name the temporary directory
        raise CheckpointWriteError(f"{dst}: writing failed: {exc.strerror or exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
@reports_errors()
def convert(src: str, dst: str, pattern: str | None, rename: tuple[str, ...], force: bool,
            shards: int | None) -> None:
    """Convert a checkpoint between formats; extract or rename keys.

    DST's extension names the format; SRC's tensors and metadata are written to it. An
    existing DST is replaced only with --force; missing directories are created.

    \b
    ckpt convert model.h5 model.msgpack
    ckpt convert run/ encoder.h5 --keys '^enc/' --rename enc=encoder
    ckpt convert model.h5 sharded.msgpack --shards 4
    ckpt convert run/model-100.msgpack whole.h5     (a sharded checkpoint to one file)
    """
    fmt = _writable_format(dst)
    remote = "://" in dst and not dst.startswith("file://")  # an object store: committed create-only
    if remote and (force or shards is not None):
        raise click.BadParameter("an object-store DST is written once (create-only): no --force or --shards",
                                 param_hint="DST")
    if not remote and os.path.lexists(dst) and not force:
        raise click.BadParameter(f"{dst} exists; pass --force to replace it", param_hint="DST")
    if pattern is not None:
        check_regex(pattern, "--keys")
    renames = parse_renames(rename)
    with ckpt.load_checkpoint(src) as reader:
        try:
            plan = plan_keys(list(reader.tensors), pattern, renames, reader.path)
            base.validate_keys((new for _, new in plan), dst)
        except ckpt.KeyNotFoundError:
            raise
        except ValueError as exc:
            if renames:
                raise click.BadParameter(str(exc), param_hint="--rename") from exc
            raise Failure(f"cannot convert {reader.path}: {exc}") from exc
        for key, _ in plan:
            try:
                dtypes.dtype_name(reader.tensors[key].dtype)
            except TypeError:
                raise Failure(f"{reader.path}: tensor {key!r} is {reader.tensors[key].dtype}, which the "
                              f"{fmt.name} format cannot store") from None
        try:
            metadata = base.normalize_metadata(reader.metadata, dst)
        except ValueError as exc:
            raise Failure(f"cannot convert {reader.path}: {exc}") from exc
        total = sum(reader.tensors[key].nbytes for key, _ in plan)
        if shards is not None:
            _write_sharded(reader, plan, metadata, dst, shards, fmt)
            click.echo(f"{dst} ({fmt.name}, {shards} shards): {count(len(plan), 'tensor')} from {reader.path} "
                       f"({reader.format}); read back and checked")
            return
        def write(tmp: str) -> None:
            with byte_bar(total, "writing") as progress:
                fmt.write(tmp, [(new, _Source(reader, reader.tensors[old], progress)) for old, new in plan],
                          metadata)
            with byte_bar(total, "checking", io_factor=2) as progress:  # reads DST and SRC
                _check_written(fmt, tmp, dst, reader, plan, metadata, progress)

        try:
            if remote:  # checked locally, then uploaded and committed (docs/formats.md, object stores)
                from ckpt._remote import directory, split_url

                parent, name = split_url(dst)
                directory(parent).write_checkpoint(name, write)
            else:
                with replace_atomically(dst) as tmp:  # its errors name DST, never the temporary file
                    write(tmp)
        except (ValueError, TypeError) as exc:  # a writer refusing a dtype or value it cannot store
            if isinstance(exc, ckpt.CheckpointError):
                raise
            raise Failure(str(exc)) from exc
        source = f"{reader.path} ({reader.format})"
    renamed = sum(old != new for old, new in plan)
    click.echo(f"{dst} ({fmt.name}): {count(len(plan), 'tensor')} from {source}"
               + (f", {renamed} renamed" if renamed else "") + "; read back and checked")
