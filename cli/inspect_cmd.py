"""``ckpt inspect``: what TensorFlow's inspect_checkpoint shows, and statistics and JSON."""

from __future__ import annotations

import json
from typing import Any

import click
import numpy as np

import ckpt

from .errors import check_regex, reports_errors
from .progress import emit, shows_progress, tracked

__all__ = ["inspect", "parse_printoptions"]

_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


class _InspectCommand(click.Command):
    """Accepts TensorFlow's "--printoptions a=1 b=2" (several values after one flag)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, spread_printoptions(args))


def spread_printoptions(args: list[str]) -> list[str]:
    """Rewrite "--printoptions a=1 b=2" as "--printoptions a=1 --printoptions b=2".

    Example:
        >>> spread_printoptions(["m.h5", "--printoptions", "precision=3", "threshold=5", "--stats"])
        ['m.h5', '--printoptions', 'precision=3', '--printoptions', 'threshold=5', '--stats']
    """
    out: list[str] = []
    awaiting = extending = False  # after "--printoptions"; after its value
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        if awaiting:
            out.append(arg)
            awaiting, extending = False, True
            continue
        if extending and "=" in arg and not arg.startswith("-"):
            out += ["--printoptions", arg]
            continue
        awaiting = arg == "--printoptions"
        extending = arg.startswith("--printoptions=")
        out.append(arg)
    return out


def parse_printoptions(values: tuple[str, ...]) -> dict[str, Any]:
    """Turn "name=value" strings into keyword arguments for ``numpy.printoptions``.

    Raises:
        click.BadParameter: not name=value, not a numpy print option, or a bad value.

    Example:
        >>> parse_printoptions(("threshold=10000 precision=4", "suppress=true"))
        {'threshold': 10000, 'precision': 4, 'suppress': True}
    """
    current: dict[str, Any] = dict(np.get_printoptions())
    options: dict[str, Any] = {}
    for item in (word for value in values for word in value.split()):
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"{item!r} is not in the form name=value", param_hint="--printoptions")
        if current.get(name, None) is None:  # unknown, or a callable-valued option (formatter)
            names = ", ".join(sorted(k for k, v in current.items() if v is not None))
            raise click.BadParameter(f"{name!r} is not a numpy print option that can be set here; "
                                     f"choose from {names}", param_hint="--printoptions")
        options[name] = _convert(name, text, current[name])
    try:
        with np.printoptions(**options):
            pass
    except (TypeError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="--printoptions") from exc
    return options


def _convert(name: str, text: str, default: Any) -> Any:
    if isinstance(default, bool):
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        if name == "legacy":  # also takes a numpy version string, "1.13"
            return text
        raise click.BadParameter(f"{name}={text}: expected true or false", param_hint="--printoptions")
    if isinstance(default, int):
        try:
            return int(text)
        except ValueError:
            raise click.BadParameter(f"{name}={text}: expected an integer", param_hint="--printoptions") from None
    return text


@click.command(cls=_InspectCommand)
@click.argument("path")
@click.option("--tensor", "tensor_name", metavar="KEY", help="Print this tensor's values.")
@click.option("--all-tensors", is_flag=True, help="Print every tensor with its values.")
@click.option("--names-only", is_flag=True, help="Print the keys alone.")
@click.option("--exclude", metavar="REGEX", default="",
              help="Leave keys matching REGEX out of the parameter count.")
@click.option("--printoptions", multiple=True, metavar="NAME=VALUE ...",
              help="numpy print options for values, e.g. --printoptions threshold=10000 precision=4.")
@click.option("--stats", is_flag=True,
              help="Per tensor: min, max, mean, std, NaN and Inf counts, zeros, and a 16-bin histogram "
                   "with power-of-two bin widths (the first bin holds min), printed between its first and "
                   "last edges.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of text.")
@reports_errors()
def inspect(path: str, tensor_name: str | None, all_tensors: bool, names_only: bool, exclude: str,
            printoptions: tuple[str, ...], stats: bool, as_json: bool) -> None:
    """Show a checkpoint's tensors, values or statistics.

    By default: every tensor with its dtype and shape, then the number of parameters. When PATH
    is a directory, a first "# checkpoint: FILE" line names the checkpoint shown (on stderr with
    --names-only).

    \b
    ckpt inspect model.h5                      every tensor, then the parameter count
    ckpt inspect run/ --tensor enc/kernel      one tensor's values (run/'s latest checkpoint)
    ckpt inspect model.h5 --stats --json       statistics, as JSON
    """
    if tensor_name and all_tensors:
        raise click.UsageError("--tensor and --all-tensors cannot be used together")
    if names_only and (tensor_name or all_tensors or stats):
        raise click.UsageError("--names-only cannot be combined with --tensor, --all-tensors or --stats")
    check_regex(exclude, "--exclude")
    options = parse_printoptions(printoptions)
    with ckpt.load_checkpoint(path) as reader:
        if reader.path != path and not as_json:  # a directory or prefix: say which checkpoint it meant
            # beside --names-only's keys it goes to stderr, so that they stay a clean list
            click.echo(f"# checkpoint: {reader.path}", err=names_only)
        # only --stats over many bytes is slow enough for a bar; values print as they come
        held = stats and shows_progress(sum(info.nbytes for key, info in reader.tensors.items()
                                            if not tensor_name or key == tensor_name))
        view: dict[str, Any] = dict(tensor_name=tensor_name, all_tensors=all_tensors, names_only=names_only,
                                    stats=stats, exclude=exclude,
                                    progress=tracked("computing statistics") if held else None)
        if as_json:
            click.echo(json.dumps(ckpt.inspect_report(reader, **view), allow_nan=False))
        else:
            with np.printoptions(**options):
                emit(ckpt.inspect_lines(reader, **view), held)
