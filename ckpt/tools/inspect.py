"""What is inside a checkpoint, as text or JSON: the views behind ``ckpt inspect``.

The listing reads a checkpoint's index only; values and statistics read just the tensors
they show. ``print_tensors_in_checkpoint_file`` is TensorFlow's function of that name.

Example:
    >>> import ckpt, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "m.h5")
    >>> with ckpt.name_scope("enc"):
    ...     k = ckpt.Variable([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], name="kernel")
    >>> _ = ckpt.Saver([k]).save(path)
    >>> ckpt.print_tensors_in_checkpoint_file(path, tensor_name="", all_tensors=False)
    tensor: enc/kernel (float32) [2, 3]
    # Total number of params: 6
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ckpt.dtypes import dtype_label
from ckpt.tools.jsonview import jsonable
from ckpt.errors import KeyNotFoundError, closest_hint
from ckpt.saving.reader import CheckpointReader, load_checkpoint

if TYPE_CHECKING:  # statistics load when asked for: a plain `ckpt inspect` starts faster without them
    from ckpt.tools.stats import TensorStats

__all__ = ["ParamCount", "dtype_label", "describe", "count_params", "jsonable", "inspect_lines", "inspect_report",
           "print_tensors_in_checkpoint_file"]

#: Wraps the iteration over the tensors being read (the CLI passes a progress bar).
Progress = Callable[[Sequence[Any]], Iterable[Any]]


def describe(info: Any) -> str:
    """One tensor's listing line, from its TensorInfo.

    Example:
        >>> from ckpt.formats.base import TensorInfo
        >>> describe(TensorInfo("enc/kernel", np.dtype("float32"), (2, 3), 24))
        'tensor: enc/kernel (float32) [2, 3]'
    """
    return f"tensor: {info.key} ({dtype_label(info.dtype)}) {list(info.shape)}"


@dataclass(frozen=True)
class ParamCount:
    """How many parameters (elements) a checkpoint holds, and how many were left out."""

    total: int
    excluded_tensors: int = 0
    excluded_params: int = 0


def count_params(tensors: Mapping[str, Any], exclude: str = "") -> ParamCount:
    """Count the elements of every tensor whose key does not match the regex ``exclude``.

    A scalar counts 1; a string tensor counts its elements.

    Raises:
        re.error: ``exclude`` is not a valid regular expression.

    Example:
        >>> from ckpt.formats.base import TensorInfo
        >>> f32 = np.dtype("float32")
        >>> infos = {"w": TensorInfo("w", f32, (2, 3), 24), "step": TensorInfo("step", f32, (), 4)}
        >>> count_params(infos)
        ParamCount(total=7, excluded_tensors=0, excluded_params=0)
        >>> count_params(infos, exclude="^step$")
        ParamCount(total=6, excluded_tensors=1, excluded_params=1)
    """
    pattern = re.compile(exclude) if exclude else None
    total = skipped = skipped_params = 0
    for key, info in tensors.items():
        size = math.prod(info.shape)
        if pattern is not None and pattern.search(key):
            skipped, skipped_params = skipped + 1, skipped_params + size
        else:
            total += size
    return ParamCount(total, skipped, skipped_params)


def _count_lines(count: ParamCount, exclude: str) -> list[str]:
    tensors = "tensor" if count.excluded_tensors == 1 else "tensors"
    params = "param" if count.excluded_params == 1 else "params"
    match = "matches" if count.excluded_tensors == 1 else "match"
    lines = [f"# Excluding {count.excluded_tensors} {tensors} ({count.excluded_params} {params}) that {match} "
             f"{exclude} when counting."] if exclude else []
    return lines + [f"# Total number of params: {count.total}"]


def _selected_keys(reader: CheckpointReader, tensor_name: str | None) -> list[str]:
    if not tensor_name:
        return sorted(reader.tensors)
    if reader.has_tensor(tensor_name):
        return [tensor_name]
    if tensor_name.endswith(":0") and reader.has_tensor(tensor_name[:-2]):  # a variable's name
        return [tensor_name[:-2]]
    what = _non_tensors(reader).get(tensor_name)
    if what is not None:
        raise KeyNotFoundError(f"{tensor_name} in checkpoint {reader.path} is not a tensor: {what}",
                               path=reader.path, key=tensor_name)
    raise KeyNotFoundError(f"Tensor {tensor_name} not found in checkpoint {reader.path}"
                           f"{closest_hint(tensor_name, reader.tensors)}", path=reader.path, key=tensor_name)


def _non_tensors(reader: CheckpointReader) -> dict[str, str]:
    """Entries a reader lists as present but not tensors (e.g. TensorFlow's object graph)."""
    notes = reader.metadata.get("non_tensors")
    return {str(k): str(v) for k, v in notes.items()} if isinstance(notes, dict) else {}


def _records(reader: CheckpointReader, keys: list[str], values: bool, stats: bool,
             progress: Progress | None) -> Iterator[tuple[Any, np.ndarray | None, TensorStats | None]]:
    """Yield (info, value or None, stats or None) for each key, reading only what is shown."""
    if stats:  # lazy: the statistics modules load only for --stats (start-up of a plain inspect)
        from ckpt.tools.chunks import reusing_buffers  # lazy, as above
        from ckpt.tools.stats import array_stats, stats_of  # lazy, as above
    infos = [reader.tensors[k] for k in keys]
    if values:
        for info in (progress(infos) if progress is not None else infos):
            arr = reader.get_tensor(info.key)
            yield info, arr, array_stats(arr) if stats else None
    elif stats:  # statistics alone: each tensor streams through in bounded chunks
        with reusing_buffers():
            for info in (progress(infos) if progress is not None else infos):
                yield info, None, stats_of(reader, info.key)
    else:
        for info in infos:
            yield info, None, None


def _check_views(tensor_name: str | None, all_tensors: bool, names_only: bool, stats: bool) -> None:
    if sum([bool(tensor_name), all_tensors, names_only]) > 1:
        raise ValueError("choose one of tensor_name, all_tensors and names_only")
    if names_only and stats:
        raise ValueError("names_only lists keys only; it cannot show stats")


def inspect_lines(reader: CheckpointReader, *, tensor_name: str | None = None, all_tensors: bool = False,
                  names_only: bool = False, stats: bool = False, exclude: str = "",
                  progress: Progress | None = None) -> Iterator[str]:
    """Yield the text view of a checkpoint, line by line (what ``ckpt inspect`` prints).

    Args:
        reader: an open checkpoint.
        tensor_name: show this tensor's values (a trailing ":0" is ignored).
        all_tensors: show every tensor's values.
        names_only: the keys alone, one per line.
        stats: add each shown tensor's statistics, and how many tensors hold NaN or Inf.
        exclude: a regex; matching keys are left out of the parameter count.
        progress: wraps the iteration over the TensorInfos whose data is read.

    Raises:
        KeyNotFoundError: ``tensor_name`` is not in the checkpoint (names the closest keys).
        ValueError: conflicting views were asked for.
        re.error: ``exclude`` is not a valid regular expression.

    Example:
        >>> import ckpt, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "m.msgpack")
        >>> _ = ckpt.Saver({"w": ckpt.Variable([1, 2, 3])}).save(path)
        >>> with ckpt.load_checkpoint(path) as reader:
        ...     print("\\n".join(inspect_lines(reader, tensor_name="w")))
        tensor: w (int32) [3]
        [1 2 3]
        # Total number of params: 3
    """
    _check_views(tensor_name, all_tensors, names_only, stats)
    count = count_params(reader.tensors, exclude)
    keys = _selected_keys(reader, tensor_name)
    if names_only:
        yield from keys
        return
    flagged = []
    for info, value, st in _records(reader, keys, bool(tensor_name) or all_tensors, stats, progress):
        yield describe(info)
        if value is not None:
            yield str(value)
        if st is not None:
            yield from st.lines()
            if st.nonfinite:
                flagged.append(info.key)
    if not tensor_name:
        yield from (f"non-tensor: {key} ({what})" for key, what in sorted(_non_tensors(reader).items()))
    if stats:
        yield f"# Tensors with NaN or Inf: {len(flagged)}" + (f" ({', '.join(flagged)})" if flagged else "")
    yield from _count_lines(count, exclude)


def inspect_report(reader: CheckpointReader, *, tensor_name: str | None = None, all_tensors: bool = False,
                   names_only: bool = False, stats: bool = False, exclude: str = "",
                   progress: Progress | None = None) -> dict[str, Any]:
    """Return the JSON view of a checkpoint: the same information as ``inspect_lines``.

    The document holds "path", "format", "metadata", "tensors" (each with "key", "dtype",
    "shape", "size", "nbytes", and "values" and "stats" when asked for) and "params";
    with ``names_only``, "path", "format" and "keys". Values follow :func:`jsonable`.

    Example:
        >>> import ckpt, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "m.h5")
        >>> _ = ckpt.Saver({"w": ckpt.Variable([1.5, 2.5])}).save(path)
        >>> with ckpt.load_checkpoint(path) as reader:
        ...     inspect_report(reader, all_tensors=True)["tensors"]
        [{'key': 'w', 'dtype': 'float32', 'shape': [2], 'size': 2, 'nbytes': 8, 'values': [1.5, 2.5]}]
    """
    _check_views(tensor_name, all_tensors, names_only, stats)
    count = count_params(reader.tensors, exclude)
    keys = _selected_keys(reader, tensor_name)
    doc: dict[str, Any] = {"path": reader.path, "format": reader.format}
    if names_only:
        return {**doc, "keys": keys}
    tensors = []
    for info, value, st in _records(reader, keys, bool(tensor_name) or all_tensors, stats, progress):
        entry: dict[str, Any] = {"key": info.key, "dtype": dtype_label(info.dtype), "shape": list(info.shape),
                                 "size": math.prod(info.shape), "nbytes": info.nbytes}
        if value is not None:
            entry["values"] = jsonable(value)
        if st is not None:
            entry["stats"] = st.to_json()
        tensors.append(entry)
    doc.update(metadata=jsonable(reader.metadata), tensors=tensors,
               params={"total": count.total, "excluded_tensors": count.excluded_tensors,
                       "excluded_params": count.excluded_params, "exclude": exclude or None})
    if stats:
        doc["nonfinite_tensors"] = [t["key"] for t in tensors if t["stats"]["nan"] or t["stats"]["inf"]]
    return doc


def print_tensors_in_checkpoint_file(file_name: str | os.PathLike[str], tensor_name: str | None,
                                     all_tensors: bool, all_tensor_names: bool = False,
                                     count_exclude_pattern: str = "") -> None:
    """Print what ``ckpt inspect`` prints: TensorFlow's inspect_checkpoint, for any checkpoint.

    Args:
        file_name: a checkpoint file, or a directory (its latest checkpoint).
        tensor_name: print this tensor's values ("" or None: list every tensor).
        all_tensors: print every tensor with its values.
        all_tensor_names: print the keys alone.
        count_exclude_pattern: a regex; matching keys are left out of the parameter count.

    Raises:
        KeyNotFoundError: ``tensor_name`` is not in the checkpoint (names the closest keys).
        CheckpointError: the checkpoint is missing or unreadable.

    Example:
        >>> import ckpt, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "m.h5")
        >>> _ = ckpt.Saver({"b": ckpt.Variable([0.5]), "step": ckpt.Variable(7)}).save(path)
        >>> print_tensors_in_checkpoint_file(path, "", all_tensors=True, count_exclude_pattern="step")
        tensor: b (float32) [1]
        [0.5]
        tensor: step (int32) []
        7
        # Excluding 1 tensor (1 param) that matches step when counting.
        # Total number of params: 1
    """
    with load_checkpoint(file_name) as reader:
        for line in inspect_lines(reader, tensor_name=tensor_name, all_tensors=all_tensors,
                                  names_only=all_tensor_names, exclude=count_exclude_pattern):
            print(line)
