"""``ckpt diff A B``: which keys, dtypes, shapes, values and metadata differ (``ckpt.compare``).

Values are compared in bounded chunks; NaNs in the same place are equal. With
``--atol``/``--rtol``, an element is close when ``|a - b| <= atol + rtol * |b|`` (numpy's
isclose, B as the reference).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import click

import ckpt

from .errors import reports_errors
from .progress import byte_bar
from .text import count

__all__ = ["diff", "diff_lines", "metadata_lines", "tally"]


def _label(info: Any) -> str:
    return f"({ckpt.dtypes.dtype_label(info.dtype)}) {list(info.shape)}"


def _values_differ(vd: ckpt.ValueDiff) -> str:
    return f"{vd.unequal} of {count(vd.count, 'value')} {'differs' if vd.unequal == 1 else 'differ'}"


def _numbers(vd: ckpt.ValueDiff) -> str:
    if vd.max_abs is None:
        return ""
    return f" (max abs diff {vd.max_abs:.6g}, max rel diff {vd.max_rel:.6g}, rel L2 change {vd.rel_l2:.6g})"


def diff_lines(result: ckpt.Comparison) -> Iterator[str]:
    """Yield the report of a comparison line by line (the summary line aside)."""
    yield f"--- {result.a}"
    yield f"+++ {result.b}"
    for t in result.tensors:
        vd = t.values
        if t.change == "only in A":
            yield f"- {t.key} {_label(t.a)}"
        elif t.change == "only in B":
            yield f"+ {t.key} {_label(t.b)}"
        elif t.change == "changed dtype or shape":
            detail = f"; {_values_differ(vd)}{_numbers(vd)}" if vd and vd.unequal else ""
            yield f"! {t.key}: {_label(t.a)} -> {_label(t.b)}{detail}"
        elif vd is not None and t.change == "differ":
            yield f"! {t.key} {_label(t.a)}: {_values_differ(vd)}{_numbers(vd)}"
        elif vd is not None and t.change == "within tolerance":
            yield f"~ {t.key} {_label(t.a)}: {_values_differ(vd)}, within tolerance{_numbers(vd)}"
    yield from metadata_lines(result.metadata)


def _shown(value: Any) -> str:
    return json.dumps(value, sort_keys=True, allow_nan=True, default=repr)


def metadata_lines(changes: list[ckpt.MetadataChange]) -> Iterator[str]:
    """One line per metadata key that differs.

    Example:
        >>> list(metadata_lines([ckpt.MetadataChange("lr", a=0.1, has_b=False),
        ...                      ckpt.MetadataChange("note", b="x", has_a=False), ckpt.MetadataChange("step", 1, 2)]))
        ['- metadata "lr": 0.1', '+ metadata "note": "x"', '! metadata "step": 1 -> 2']
    """
    for change in changes:
        key = json.dumps(change.key)
        if not change.has_b:
            yield f"- metadata {key}: {_shown(change.a)}"
        elif not change.has_a:
            yield f"+ metadata {key}: {_shown(change.b)}"
        else:
            yield f"! metadata {key}: {_shown(change.a)} -> {_shown(change.b)}"


def tally(counts: dict[str, int]) -> str:
    """The summary's counts, in words that agree with them ("1 differs", "2 differ").

    Example:
        >>> tally({"only in A": 1, "differ": 1, "identical": 3, "metadata": 2})
        '1 only in A, 1 differs, 3 identical, 2 metadata keys differ'
    """
    words = {"differ": ("differ", "differs"), "metadata": ("metadata keys differ", "metadata key differs")}
    parts = [count(n, what, *words.get(what, (what, what))) for what, n in counts.items() if n]
    return ", ".join(parts)


@click.command()
@click.argument("a")
@click.argument("b")
@click.option("--atol", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Absolute tolerance for values.")
@click.option("--rtol", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Relative tolerance for values (relative to B).")
@click.option("--json", "as_json", is_flag=True,
              help='Print one JSON document: "a", "b", "same", "counts" and "changes", one per key '
                   '(tensors, then metadata keys), each with its "change".')
@click.pass_context
@reports_errors(exit_code=2)
def diff(ctx: click.Context, a: str, b: str, atol: float, rtol: float, as_json: bool) -> None:
    """Compare two checkpoints: keys, dtypes, shapes, values and metadata.

    \b
    Lines: "- key" only in A, "+ key" only in B, "! key" a changed dtype or shape or values
    outside the tolerance, "~ key" values that differ within the tolerance (with the largest
    |a-b| and |a-b|/|b|, and the relative L2 change ||a-b||/||a||: how far the tensor moved); then
    "- metadata", "+ metadata" and "! metadata" lines for metadata keys that differ.
    Exit status: 0 the same (within tolerance), 1 different, 2 trouble (as diff(1)).

    \b
    ckpt diff run1/ run2/ --atol 1e-6      latest checkpoints of two runs
    """
    with ckpt.load_checkpoint(a) as ra, ckpt.load_checkpoint(b) as rb:
        # the bar follows the bytes read: both files, so two bytes read per byte of A compared
        with byte_bar(sum(info.nbytes for info in ra.tensors.values()), "comparing", io_factor=2) as progress:
            result = ckpt.compare(ra, rb, atol=atol, rtol=rtol, progress=progress)
    if as_json:
        click.echo(json.dumps(result.to_json(), allow_nan=False))
    else:
        for line in diff_lines(result):
            click.echo(line)
        click.echo(f"# {'same' if result.same else 'different'}: {tally(result.counts) or 'no tensors'}")
    if not result.same:
        ctx.exit(1)
