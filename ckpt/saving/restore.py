"""Planning and running a restore: match keys, check shapes and dtypes, then read in place.

Everything that can be checked before reading data is checked first, and every problem is
reported in one error; when that check fails no variable changes. Data is then read
straight into each variable's existing buffer. If a tensor fails its checksum mid-way,
every variable this restore has already written becomes uninitialized, so none silently
holds corrupt or half-restored values.

Example:
    >>> import ckpt, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "pre.h5")
    >>> with ckpt.name_scope("old"):
    ...     w = ckpt.Variable([1.0, 2.0], name="w")
    >>> _ = ckpt.Saver([w]).save(path)
    >>> with ckpt.name_scope("new"):
    ...     w2 = ckpt.Variable([0.0, 0.0], name="w")
    >>> [(key, v.name) for key, v in ckpt.init_from_checkpoint(path, {"old/": "new/"})]
    [('old/w', 'new/w:0')]
    >>> w2.numpy()
    array([1., 2.], dtype=float32)
"""

from __future__ import annotations

import itertools
import operator
import os
from collections import defaultdict
from contextlib import contextmanager
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckpt.runtime import casting
from ckpt import dtypes
from ckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    KeyNotFoundError,
    MismatchError,
    StorageError,
    closest_hint,
)
from ckpt.formats.base import Reader, as_dict
from ckpt.gcpause import gc_paused
from ckpt.runtime.module import Module
from ckpt.saving.reader import batch_bounds, open_checkpoint, read_in_batches
from ckpt.runtime.variables import Variable, global_variables

__all__ = ["RestoreResult", "restore_variables", "restore_from", "init_from_checkpoint"]


@dataclass(frozen=True)
class RestoreResult:
    """What a restore did.

    Attributes:
        path: the checkpoint file read.
        restored: keys read into variables.
        missing: requested keys the checkpoint lacks (only with ``strict=False``).
        unexpected: keys in the checkpoint nobody asked for.
    """

    path: str
    restored: list[str]
    missing: list[str]
    unexpected: list[str]


def _describe(dtype: Any) -> str:
    return dtypes.dt_name_or_none(dtype) or str(dtype)


def _castable(src: np.dtype, dst: np.dtype) -> bool:
    """True when the assign rule (numpy's same_kind) allows ``src`` values into ``dst``."""
    try:
        casting.check_cast(np.empty(0, src), False, dst, "")
    except TypeError:
        return False
    return True


def _global_shape(var: Variable) -> tuple[int, ...]:
    """The shape of the tensor a variable restores: its own, or its Shard's global shape."""
    return var.shard.global_shape if var.shard is not None else var.shape


def _key_style_hint(name: str, tensors: Mapping[str, Any], missing: Sequence[tuple[str, Variable]]) -> str | None:
    """Say so when every missing key is there in the file's other key style: variable names
    (``Saver(model.variables)``) against attribute paths (``Saver(model)``), either way round."""
    if all(key != var.key and var.key in tensors for key, var in missing):
        key, var = missing[0]
        return (f"{name} is keyed by variable names ({var.key!r} holds {key}), as Saver(module.variables) "
                f"writes them; this Saver uses attribute paths: restore with Saver(module.variables)")
    by_leaf: dict[tuple[str, tuple[int, ...]], str] = {}
    for file_key, info in tensors.items():
        by_leaf.setdefault((file_key.rsplit("/", 1)[-1], tuple(info.shape)), file_key)
    # the paths a Module gives are unknown here: a file key ending in the same name, of the same shape, stands in
    found = [by_leaf.get((key.rsplit("/", 1)[-1], _global_shape(var))) for key, var in missing]
    if all(key == var.key for key, var in missing) and all(found):
        return (f"{name} looks keyed by attribute paths ({found[0]!r} for variable {missing[0][0]}), as "
                f"Saver(module) writes them; this Saver uses variable names: restore with Saver(module)")
    return None


def _missing_hints(name: str, tensors: Mapping[str, Any], missing: Sequence[tuple[str, Variable]],
                   matched: int, only_missing: bool) -> list[str]:
    """What a Saver's restore can do about keys missing from the file: the other key style, or
    ``strict=False`` when the model merely has variables the file lacks."""
    style = _key_style_hint(name, tensors, missing)
    if style is not None:
        return [style]
    if only_missing and matched:
        return [f"restore(..., strict=False) restores the other {matched} and reports these in its result's "
                f".missing (initialize them, e.g. ckpt.initialize_variables)"]
    return []


def _plan(reader: Reader, wanted: Sequence[tuple[str, Variable]], allow_missing: bool,
          transposed: Collection[str] = (), allow_cast: bool = False, saver_hints: bool = False,
          ) -> tuple[list[tuple[str, Variable]], list[str], set[str]]:
    """Return (pairs to read, missing keys, keys to cast); raise once listing every problem.

    Keys in ``transposed`` are matched with their axes reversed (2-D at most); with
    ``allow_cast`` a dtype the assign rule converts is accepted. ``saver_hints`` adds what a
    Saver's restore can do about missing keys (another Saver, ``strict=False``).
    """
    name = os.path.basename(reader.path)
    pairs, missing, problems = [], [], []
    troubled: list[str] = []  # the key of each problem, for the error's ``key``
    cast: set[str] = set()
    any_missing = False
    tensors = as_dict(reader.tensors)  # a lazy index built at once: a restore visits most keys
    for key, var in wanted:
        info = tensors.get(key)
        # the common case first, in few attribute reads: a whole tensor of the variable's shape and dtype
        if info is not None and var._shard is None and info.shape == var._shape and info.dtype == var._dtype \
                and key not in transposed:
            pairs.append((key, var))
            continue
        if info is None:
            missing.append(key)
            if not allow_missing:
                any_missing = True
                problems.append(f"{key}: not found in {name}{closest_hint(key, reader.tensors)}")
        elif var.shard is not None and key in transposed:
            problems.append(f"{key}: {var.name} holds a block of a tensor (it has a Shard); transpose applies "
                            "to whole tensors")
        elif key in transposed and len(info.shape) > 2:
            problems.append(f"{key}: transpose applies to 2-D tensors; it is {info.shape} in {name} "
                            "(layouts of higher rank differ by a permutation, not a transpose)")
        elif (info.shape[::-1] if key in transposed else info.shape) != _global_shape(var):
            if key in transposed:
                hint = f" (transposed: {info.shape[::-1]})"
            elif len(info.shape) == 2 and info.shape[::-1] == var.shape:
                hint = " (its transpose fits: see init_from_checkpoint's transpose)"
            else:
                hint = ""
            problems.append(f"{key}: shape {_global_shape(var)} in the model, {info.shape} in {name}{hint}")
        elif info.dtype != var.dtype and not (allow_cast and key not in transposed and var.shard is None
                                              and _castable(info.dtype, var.dtype)):
            hint = " (restore(..., allow_cast=True) converts it)" if key not in transposed and \
                var.shard is None and _castable(info.dtype, var.dtype) else ""
            problems.append(f"{key}: dtype {_describe(var.dtype)} in the model, {_describe(info.dtype)} in "
                            f"{name}{hint}")
        else:
            if info.dtype != var.dtype:
                cast.add(key)
            pairs.append((key, var))
        if len(troubled) < len(problems):
            troubled.append(key)
    if problems:
        error = KeyNotFoundError if any_missing else MismatchError
        noun = "problem" if len(problems) == 1 else "problems"
        hints = []
        if any_missing and saver_hints:
            lacking = set(missing)
            hints = _missing_hints(name, tensors, [(k, v) for k, v in wanted if k in lacking], len(pairs),
                                   only_missing=len(problems) == len(missing))
        raise error(f"cannot restore from {reader.path} ({len(problems)} {noun}; no variable was "
                    "changed):\n  " + "\n  ".join(problems + [f"hint: {h}" for h in hints]), path=reader.path,
                    key=troubled[0] if len(troubled) == 1 else None)
    return pairs, missing, cast


def _read_cast(reader: Reader, pairs: Sequence[tuple[str, Variable]], cast: Collection[str]) -> dict[str, Any]:
    """Read the tensors to cast into temporary arrays and check their values fit, before any
    variable changes (an int64 value may not fit an int32 variable)."""
    staged, problems = {}, []
    for key, var in pairs:
        if key in cast:
            staged[key] = value = reader.read(key)
            try:
                casting.prepare(np.broadcast_to(np.empty((), var.dtype), var.shape), value, key)
            except TypeError as exc:
                problems.append(str(exc))
    if problems:
        raise MismatchError(f"cannot restore from {reader.path} ({len(problems)} "
                            f"{'problem' if len(problems) == 1 else 'problems'}; no variable was changed):"
                            "\n  " + "\n  ".join(problems), path=reader.path)
    return staged




def _read_into_variables(reader: Reader, pairs: Sequence[tuple[str, Variable]],
                         transposed: Collection[str] = (), staged: Mapping[str, Any] | None = None) -> None:
    """Read each tensor into its variable's buffer; on failure, uninitialize what was touched.

    Tensors whose keys are in ``transposed`` are read whole, then assigned transposed; those
    in ``staged`` (already read, to be cast) are copied with the assign cast rule.
    """
    staged = staged or {}
    touched: list[Variable] = []
    tensors = as_dict(reader.tensors)  # built by the plan already

    def plain_reads() -> Iterator[tuple[Any, np.ndarray]]:
        """Handle the special cases in place; yield the tensors read straight into their buffers."""
        for key, var in pairs:
            buffer = var._value if var._value is not None else var._writable_buffer()
            touched.append(var)  # before the read: a failed read may have written part of it
            if transposed and key in transposed:
                buffer[...] = reader.read(key).T
                continue
            if staged and key in staged:
                casting.copy_into(buffer, staged[key], key)
                continue
            if var._shard is not None and var._shard.global_shape != var._shape:
                reader.read_box_into(key, var._shard.offset, buffer)
                continue
            yield tensors[key], buffer

    with _uninitialized_on_failure(touched):
        # the plan matched every key already: (TensorInfo, buffer) pairs, no second lookup or check
        read_in_batches(reader, plain_reads(), reader.read_planned)
    for var in touched:
        var._mark_restored()


@contextmanager
def _uninitialized_on_failure(touched: list[Variable]) -> Iterator[None]:
    """On a failure inside the block, mark every variable in ``touched`` (as it is then)
    uninitialized and raise a CheckpointError that names them."""
    try:
        yield
    except BaseException as exc:
        for var in touched:
            var._mark_uninitialized()
        if not isinstance(exc, CheckpointError):
            raise
        names = ", ".join(dict.fromkeys(v.name for v in touched))
        # a store that failed (gone, timed out) is no sign of damage: code that quarantines
        # corrupt checkpoints must not act on a network outage
        kind = type(exc) if isinstance(exc, StorageError) else CorruptCheckpointError
        raise kind(
            f"{exc}\nrestore stopped; the variables it had already written are now uninitialized "
            f"(restore them again or initialize them): {names}", path=exc.path, key=exc.key) from exc


_SHARD, _SHAPE, _DTYPE, _VALUE = (operator.attrgetter(name) for name in ("_shard", "_shape", "_dtype", "_value"))
_NBYTES = operator.attrgetter("nbytes")


def _read_matching(reader: Reader, variables: Mapping[str, Variable]) -> bool:
    """Restore the usual case in a few C loops: every variable, unsharded, is a tensor of the
    file with exactly its shape and dtype (``reader.match_exact``). Return False, having changed
    nothing, for anything else: the plan then checks key by key and names every problem.

    Why: the plan and read loops cost a few microseconds per tensor, which is most of a restore of
    10,000s of small tensors (the reads themselves are batched). Checksums are still verified for
    every tensor, and a failure uninitializes the variables of the batches read so far.
    """
    found = list(variables.values())
    if not all(map(operator.is_, map(_SHARD, found), itertools.repeat(None))):
        return False
    handles = reader.match_exact(list(variables), list(map(_SHAPE, found)), list(map(_DTYPE, found)))
    if handles is None:
        return False
    buffers = list(map(_VALUE, found))
    if not all(map(operator.is_not, buffers, itertools.repeat(None))):  # not ``None in``: that compares arrays
        buffers = [var._writable_buffer() for var in found]  # deferred variables get their buffers now
    touched: list[Variable] = []
    with _uninitialized_on_failure(touched):
        for start, stop in batch_bounds(reader, map(_NBYTES, buffers)):
            touched.extend(found[start:stop])  # before the read: a failed read may have written part of it
            reader.read_matched(handles[start:stop], buffers[start:stop])
    for var in found:
        var._mark_restored()
    return True


def restore_variables(path: str | os.PathLike[str], variables: Mapping[str, Variable],
                      strict: bool = True, allow_cast: bool = False,
                      storage_options: Mapping[str, Any] | None = None) -> RestoreResult:
    """Restore ``variables`` (checkpoint key -> Variable) from a file or a directory's latest.

    With ``strict=False`` missing keys are skipped and reported instead of raising; with
    ``allow_cast=True`` tensors whose dtype the assign rule converts (same_kind) are cast.
    """
    return restore_from(lambda: open_checkpoint(path, storage_options), variables, strict, allow_cast)


def restore_from(open_reader: Callable[[], Reader], variables: Mapping[str, Variable], strict: bool = True,
                 allow_cast: bool = False) -> RestoreResult:
    """``restore_variables`` from the reader ``open_reader()`` opens (a collective restore opens
    the one commit record rank 0 read)."""
    # the collector waits from before the index is parsed until the index and the plan are freed:
    # otherwise its next pass walks their 10,000s of young objects (a tenth of a small-tensor restore)
    with gc_paused():
        with open_reader() as reader:
            if _read_matching(reader, variables):
                restored, missing = list(variables), list[str]()
            else:
                pairs, missing, cast = _plan(reader, list(variables.items()), allow_missing=not strict,
                                             allow_cast=allow_cast, saver_hints=True)
                _read_into_variables(reader, pairs, staged=_read_cast(reader, pairs, cast))
                restored = [k for k, _ in pairs]
                del pairs
            # every restored key is a distinct key of the file: when they are as many, none is unexpected
            unexpected = [k for k in reader.tensors if k not in variables] if len(restored) < len(reader.tensors) \
                else []
            result = RestoreResult(reader.path, restored, missing, unexpected)
        del reader
    return result


AssignmentTarget = Any  # a Variable, a list of Variables, a variable name, a scope ("new/"), a Module


def _transposed_keys(transpose: Collection[str] | Callable[[str], bool], keys: list[str],
                     problems: list[str]) -> frozenset[str]:
    """The restored keys ``transpose`` selects; names it gives that nothing restores are problems."""
    if isinstance(transpose, str):
        raise TypeError(f"transpose must be a collection of keys or a predicate, not the string "
                        f"{transpose!r} (write [{transpose!r}])")
    if callable(transpose):
        return frozenset(k for k in keys if transpose(k))
    unknown = [k for k in transpose if k not in keys]
    problems.extend(f"transpose names {k!r}, which the assignment map does not restore" for k in unknown)
    return frozenset(transpose)


def init_from_checkpoint(ckpt_dir_or_file: str | os.PathLike[str],
                         assignment_map: Mapping[str, AssignmentTarget] | Sequence[tuple[str, AssignmentTarget]]
                         | Module,
                         transpose: Collection[str] | Callable[[str], bool] = (),
                         storage_options: Mapping[str, Any] | None = None,
                         ) -> list[tuple[str, Variable]]:
    """Restore checkpoint tensors into existing variables, with TensorFlow's assignment maps.

    Args:
        ckpt_dir_or_file: a checkpoint file, or a directory (its latest checkpoint).
        assignment_map: checkpoint key or scope -> target, as a dict or a list of pairs
            (a list can map one tensor to several variables):

            * ``"old_scope/": "new_scope/"`` maps every live variable under "new_scope/" to the
              key with "old_scope/" in its place ("old_scope/" does not match "old_scope_1/");
            * ``"/": "new_scope/"`` maps the checkpoint's root; ``"old/": "/"`` the model's;
            * ``"key": variable`` (or a variable's name, or a list of variables) maps one tensor;
            * ``"old_scope/": module`` maps every variable of a Module, by the keys a
              ``Saver(module)`` writes ("layers/0/kernel"), to "old_scope/" + that key; ``"/"``
              (or passing the Module itself as the map) uses its keys as they are.
        transpose: checkpoint keys (a collection, or a predicate on keys) whose tensors are
            transposed before they are assigned, for frameworks that store a layer the other
            way round: PyTorch's ``Linear.weight`` is (out_features, in_features), a Dense
            kernel is (in, out). Only 2-D tensors are transposed (0-D and 1-D ones are left
            as they are); naming a tensor of higher rank is an error, since convolution
            kernels differ by a permutation, not a transpose.
        storage_options: for an object-store URL, options for its fsspec filesystem.

    Returns:
        The (checkpoint key, variable) pairs restored.

    Raises:
        ValueError: for a malformed map; KeyNotFoundError (also a ValueError) for keys missing
        from the checkpoint; MismatchError (a ValueError) for shape or dtype mismatches.
        Nothing is assigned when any entry fails.

    Example:
        >>> import ckpt
        >>> layer1 = ckpt.Variable(ckpt.initializers.Zeros(), shape=(3, 4), name="layer1/kernel")
        >>> pairs = ckpt.init_from_checkpoint("torch_state.pt", {"fc1.weight": layer1},
        ...                                   transpose=["fc1.weight"])  # doctest: +SKIP
    """
    if isinstance(assignment_map, Module):
        assignment_map = {"/": assignment_map}
    items = list(assignment_map.items()) if isinstance(assignment_map, Mapping) else list(assignment_map)
    by_name: dict[str, list[Variable]] = defaultdict(list)
    live = global_variables()
    for v in live:
        by_name[v.key].append(v)
    pairs: list[tuple[str, Variable]] = []
    problems: list[str] = []
    for ckpt_key, target in items:
        if not isinstance(ckpt_key, str) or not ckpt_key:
            problems.append(f"{ckpt_key!r}: checkpoint keys and scopes are non-empty strings")
        elif isinstance(target, Variable) or (isinstance(target, (list, tuple)) and target
                                              and all(isinstance(t, Variable) for t in target)):
            if ckpt_key.endswith("/"):
                problems.append(f"{ckpt_key!r} is a scope; map it to a scope such as 'new_scope/'")
            pairs.extend((ckpt_key, v) for v in ([target] if isinstance(target, Variable) else target))
        elif isinstance(target, Module):
            if not ckpt_key.endswith("/"):
                problems.append(f"{ckpt_key!r} -> {target!r}: a Module maps from a checkpoint scope "
                                f"ending in '/' (write {ckpt_key + '/'!r}, or '/' for the root)")
                continue
            pairs.extend((ckpt_key.lstrip("/") + key, v) for key, v in target.named_variables())
        elif isinstance(target, str) and ckpt_key.endswith("/"):
            if not target.endswith("/"):
                problems.append(f"{ckpt_key!r} -> {target!r}: a scope maps to a scope ending in '/'")
                continue
            src, dst = ckpt_key.lstrip("/"), target.lstrip("/")
            matched = [v for v in live if v.key.startswith(dst)]
            if not matched:
                problems.append(f"{ckpt_key!r} -> {target!r}: no variables in scope {target!r}")
            pairs.extend((src + v.key[len(dst):], v) for v in matched)
        elif isinstance(target, str):
            if target.endswith("/"):
                problems.append(f"{ckpt_key!r} -> {target!r}: a single tensor maps to a variable, "
                                "not a scope")
                continue
            name = target[:-2] if target.endswith(":0") else target
            found = by_name.get(name, [])
            if len(found) != 1:
                why = "no variable" if not found else f"{len(found)} variables"
                problems.append(f"{ckpt_key!r} -> {target!r}: {why} named {name!r}; pass the Variable")
            else:
                pairs.append((ckpt_key, found[0]))
        else:
            problems.append(f"{ckpt_key!r} -> {target!r}: the target must be a Variable, a list of "
                            "Variables, a variable name, a scope or a Module")
    seen: dict[int, str] = {}
    for key, var in pairs:
        if id(var) in seen and seen[id(var)] != key:
            problems.append(f"variable {var.name} is assigned twice: from {seen[id(var)]!r} and {key!r}")
        seen[id(var)] = key
    transposed = _transposed_keys(transpose, [key for key, _ in pairs], problems)
    if problems:
        raise ValueError("invalid assignment map:\n  " + "\n  ".join(problems))
    unique = {(key, id(var)): (key, var) for key, var in pairs}  # the same pair twice is one assignment
    pairs = list(unique.values())
    with gc_paused():  # as in restore_variables: the index is freed before the collector runs again
        with open_checkpoint(ckpt_dir_or_file, storage_options) as reader:
            checked, _, _ = _plan(reader, pairs, allow_missing=False, transposed=transposed)
            _read_into_variables(reader, checked, transposed)
        del reader
    return checked
