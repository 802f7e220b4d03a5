"""``ckpt diff A B``: which keys, dtypes, shapes, values and metadata differ between two checkpoints.

Values are compared in chunks, one pair of tensors in memory at a time. NaNs in the same
place are equal. With ``--atol``/``--rtol``, an element is close when
``|a - b| <= atol + rtol * |b|`` (numpy's isclose, B as the reference).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from collections.abc import Iterator
from typing import Any

import click
import numpy as np

import ckpt
from ckpt import dtypes
from ckpt.inspect import dtype_label, jsonable

from .errors import reports_errors
from .progress import emit, shows_progress, tracked
from .text import count

__all__ = ["ValueDiff", "compare_values", "diff"]

#: Elements compared per step: bounds the temporaries for huge tensors.
CHUNK = 1 << 20


@dataclass(frozen=True)
class ValueDiff:
    """How two same-shape tensors differ."""

    count: int  # elements compared
    unequal: int  # elements not exactly equal
    outside: int  # elements outside the tolerance
    max_abs: float | None  # None for strings
    max_rel: float | None


def _as_number(raw: np.ndarray) -> np.ndarray:
    return raw.astype(np.complex128 if raw.dtype.kind == "c" else np.float64)


def compare_values(a: np.ndarray, b: np.ndarray, atol: float = 0.0, rtol: float = 0.0) -> ValueDiff:
    """Compare two tensors of one shape element by element (B is the reference for rtol).

    Example:
        >>> compare_values(np.array([1.0, 2.0, np.nan]), np.array([1.0, 2.5, np.nan]), atol=0.1)
        ValueDiff(count=3, unequal=1, outside=1, max_abs=0.5, max_rel=0.2)
    """
    fa, fb = a.reshape(-1), b.reshape(-1)
    if dtypes.is_string(a.dtype) or dtypes.is_string(b.dtype):
        unequal = sum(int(np.count_nonzero(fa[i:i + CHUNK] != fb[i:i + CHUNK])) for i in range(0, fa.size, CHUNK))
        return ValueDiff(fa.size, unequal, unequal, None, None)
    unequal = outside = 0
    max_abs = max_rel = 0.0
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for i in range(0, fa.size, CHUNK):
            ra, rb = fa[i:i + CHUNK], fb[i:i + CHUNK]
            xa, xb = _as_number(ra), _as_number(rb)
            both_nan = np.isnan(xa) & np.isnan(xb)
            neq = ((ra != rb) if a.dtype == b.dtype else (xa != xb)) & ~both_nan
            d = np.where(neq, np.abs(xa - xb), 0.0)
            d[np.isnan(d)] = np.inf  # NaN against a number (or inf - inf of opposite signs)
            ref = np.abs(xb)
            rel = np.where(d == 0, 0.0, d / ref)
            rel[np.isnan(rel)] = np.inf
            close = ~neq | (np.isfinite(d) & (d <= atol + rtol * ref))
            unequal += int(np.count_nonzero(neq))
            outside += int(np.count_nonzero(~close))
            if d.size:
                max_abs, max_rel = max(max_abs, float(d.max())), max(max_rel, float(rel.max()))
    return ValueDiff(fa.size, unequal, outside, max_abs, max_rel)


def _label(info: Any) -> str:
    return f"({dtype_label(info.dtype)}) {list(info.shape)}"


def _values_differ(vd: ValueDiff) -> str:
    return f"{vd.unequal} of {count(vd.count, 'value')} {'differs' if vd.unequal == 1 else 'differ'}"


def _numbers(vd: ValueDiff) -> str:
    if vd.max_abs is None:
        return ""
    return f" (max abs diff {vd.max_abs:.6g}, max rel diff {vd.max_rel:.6g})"


def _described(info: Any) -> dict[str, Any]:
    return {"dtype": dtype_label(info.dtype), "shape": list(info.shape)}


def _values(vd: ValueDiff | None) -> dict[str, Any] | None:
    return None if vd is None else jsonable(dataclasses.asdict(vd))


def diff_lines(ra: ckpt.CheckpointReader, rb: ckpt.CheckpointReader, atol: float, rtol: float,
               counts: dict[str, int], progress: Any = None,
               records: list[dict[str, Any]] | None = None) -> Iterator[str]:
    """Yield the report line by line, tallying each kind of difference into ``counts`` and,
    when given ``records``, appending one JSON-ready record per key (``--json``)."""
    records = [] if records is None else records
    ta, tb = ra.tensors, rb.tensors
    yield f"--- {ra.path}"
    yield f"+++ {rb.path}"
    # values are compared wherever shapes match, also across numeric dtypes (float32 -> float16)
    comparable = [ta[k] for k in sorted(ta) if k in tb and ta[k].shape == tb[k].shape and
                  dtypes.is_string(ta[k].dtype) == dtypes.is_string(tb[k].dtype)]
    values = {info.key: compare_values(ra.get_tensor(info.key), rb.get_tensor(info.key), atol, rtol)
              for info in (progress(comparable) if progress is not None else comparable)}
    for key in sorted(set(ta) | set(tb)):
        if key not in tb:
            counts["only in A"] += 1
            records.append({"key": key, "change": "only in A", "a": _described(ta[key])})
            yield f"- {key} {_label(ta[key])}"
        elif key not in ta:
            counts["only in B"] += 1
            records.append({"key": key, "change": "only in B", "b": _described(tb[key])})
            yield f"+ {key} {_label(tb[key])}"
        else:
            a, b, vd = ta[key], tb[key], values.get(key)
            changed = a.dtype != b.dtype or a.shape != b.shape
            if changed:
                change = "changed dtype or shape"
            elif vd is None:  # unreachable: equal shapes and kinds were compared above
                raise AssertionError(key)
            else:
                change = "differ" if vd.outside else "within tolerance" if vd.unequal else "identical"
            counts[change] += 1
            records.append({"key": key, "change": change, "a": _described(a), "b": _described(b),
                            "values": _values(vd)})
            if changed:
                detail = f"; {_values_differ(vd)}{_numbers(vd)}" if vd and vd.unequal else ""
                yield f"! {key}: {_label(a)} -> {_label(b)}{detail}"
            elif vd is None:  # unreachable: equal shapes and kinds were compared above
                raise AssertionError(key)
            elif vd.outside:
                yield f"! {key} {_label(a)}: {_values_differ(vd)}{_numbers(vd)}"
            elif vd.unequal:
                yield f"~ {key} {_label(a)}: {_values_differ(vd)}, within tolerance{_numbers(vd)}"
    yield from metadata_lines(ra.metadata, rb.metadata, counts, records)


def _shown(value: Any) -> str:
    return json.dumps(value, sort_keys=True, allow_nan=True)


def metadata_lines(ma: dict[str, Any], mb: dict[str, Any], counts: dict[str, int],
                   records: list[dict[str, Any]] | None = None) -> Iterator[str]:
    """One line per metadata key that differs, tallied into ``counts["metadata"]`` (and a
    record in ``records``, with "a" and "b" values where the key exists).

    Example:
        >>> list(metadata_lines({"step": 1, "lr": 0.1}, {"step": 2, "note": "x"}, {"metadata": 0}))
        ['- metadata "lr": 0.1', '+ metadata "note": "x"', '! metadata "step": 1 -> 2']
    """
    for key in sorted(set(ma) | set(mb)):
        if key not in mb:
            line = f"- metadata {json.dumps(key)}: {_shown(ma[key])}"
        elif key not in ma:
            line = f"+ metadata {json.dumps(key)}: {_shown(mb[key])}"
        elif _shown(ma[key]) != _shown(mb[key]) or type(ma[key]) is not type(mb[key]):
            line = f"! metadata {json.dumps(key)}: {_shown(ma[key])} -> {_shown(mb[key])}"
        else:
            continue
        counts["metadata"] += 1
        if records is not None:
            records.append({"key": key, "change": "metadata",
                            **{side: jsonable(m[key]) for side, m in (("a", ma), ("b", mb)) if key in m}})
        yield line


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
    outside the tolerance, "~ key" values that differ within the tolerance; then
    "- metadata", "+ metadata" and "! metadata" lines for metadata keys that differ.
    Exit status: 0 the same (within tolerance), 1 different, 2 trouble (as diff(1)).

    \b
    ckpt diff run1/ run2/ --atol 1e-6      latest checkpoints of two runs
    """
    with ckpt.load_checkpoint(a) as ra, ckpt.load_checkpoint(b) as rb:
        counts = dict.fromkeys(["only in A", "only in B", "changed dtype or shape", "differ",
                                "within tolerance", "identical", "metadata"], 0)
        held = shows_progress(sum(info.nbytes for info in ra.tensors.values()))
        records: list[dict[str, Any]] = []
        lines = diff_lines(ra, rb, atol, rtol, counts, tracked("comparing", io_factor=2) if held else None, records)
        if as_json:
            list(lines)
        else:
            emit(lines, held)
        paths = ra.path, rb.path
    different = sum(counts[k] for k in ("only in A", "only in B", "changed dtype or shape", "differ", "metadata"))
    if as_json:
        click.echo(json.dumps({"a": paths[0], "b": paths[1], "same": not different, "counts": counts,
                               "changes": records}, allow_nan=False))
    else:
        click.echo(f"# {'different' if different else 'same'}: {tally(counts) or 'no tensors'}")
    if different:
        ctx.exit(1)
