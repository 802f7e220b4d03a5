"""What a Saver is given, checked once: the var_list as an ordered {checkpoint key: Variable} map,
the global step, and the keep-best and incremental policies (internal; ``ckpt.Saver`` calls these).

Example:
    >>> import ckpt
    >>> from ckpt.saving.arguments import key_map
    >>> sorted(key_map({"model": {"w": ckpt.Variable(1.0)}, "step": ckpt.Variable(0)}))
    ['model/w', 'step']
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterable, Mapping
from typing import Any

from ckpt.formats import base as _formats  # the format registry; importing it registers the built-ins
from ckpt.runtime.module import Module
from ckpt.runtime.variables import Variable, global_variables
from ckpt.saving.retention import BEST_MODES

__all__ = ["VarTree", "VarList", "where", "key_map", "check_global_step", "best_policy", "incremental_policy"]

VarTree = Mapping[str, "Variable | Module | VarTree"]
VarList = None | Module | VarTree | Iterable[Variable]


def where(path_arg: Any) -> str:
    """The path a save was given, for messages, whatever the caller passed."""
    return str(os.fspath(path_arg)) if isinstance(path_arg, (str, os.PathLike)) else repr(path_arg)


def key_map(var_list: VarList) -> dict[str, Variable]:
    """Turn a var_list into an ordered {checkpoint key: Variable} map, refusing ambiguity."""
    if var_list is None:
        pairs = [(v.key, v) for v in global_variables()]
    elif isinstance(var_list, Module):
        pairs = var_list.named_variables()
    elif isinstance(var_list, Mapping):
        pairs = tree_pairs(var_list, "")
    elif isinstance(var_list, Iterable) and not isinstance(var_list, (str, bytes)):  # type: ignore[unreachable]
        unique = {id(v): v for v in var_list}  # the same variable listed twice is listed once
        pairs = [(v.key if isinstance(v, Variable) else v, v) for v in unique.values()]
    else:
        raise TypeError(f"var_list must be None, a Module, a dict or a list of Variables, "
                        f"got {type(var_list).__name__}")
    keys: dict[str, Variable] = {}
    owner: dict[int, str] = {}
    for key, var in pairs:
        if not isinstance(var, Variable):
            raise TypeError(f"var_list entry {key!r} is a {type(var).__name__}: a dict's values are "
                            f"ckpt.Variables, Modules or dicts of them")
        if not isinstance(key, str):
            raise TypeError(f"checkpoint keys are strings, got {key!r} for {var.name}")
        if key in keys:
            raise ValueError(f"two variables would be saved under the key {key!r}: {keys[key].name} "
                             f"and {var.name}; give them distinct names or pass a dict")
        if id(var) in owner:
            raise ValueError(f"variable {var.name} would be saved under two keys: {owner[id(var)]!r} "
                             f"and {key!r}")
        keys[key] = var
        owner[id(var)] = key
    if not keys:
        raise ValueError("there are no variables to save (empty var_list)")
    _formats.validate_keys(keys, "Saver")
    return keys


def check_global_step(global_step: Any) -> None:
    """Refuse a global_step that is not an int, naming the argument (operator.index's own error
    names nothing)."""
    if global_step is None:
        return
    try:
        operator.index(global_step)
    except TypeError:
        raise TypeError(f"save(global_step=...) takes an int or an int Variable (or None), got "
                        f"{global_step!r}") from None


def best_policy(keep_best: int | None, best_metric: str | None, best_mode: str) -> tuple[int | None, str | None, str]:
    """The Saver's keep-best arguments, checked."""
    if keep_best is not None and (not isinstance(keep_best, int) or isinstance(keep_best, bool) or keep_best < 0):
        raise ValueError(f"keep_best must be a non-negative int or None, got {keep_best!r}")
    if keep_best and best_metric is None:
        raise ValueError("keep_best needs best_metric: the metric (save(..., metrics=)) that ranks checkpoints")
    if best_metric is not None and not isinstance(best_metric, str):
        raise ValueError(f"best_metric must be a metric's name, got {best_metric!r}")
    if best_mode not in BEST_MODES:
        raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
    return keep_best or None, best_metric, best_mode


def incremental_policy(incremental: bool, full_every: int | None, chunk_bytes: int,
                       max_chain: int = 0) -> tuple[int | None, int, int] | None:
    """(full_every, chunk_bytes, max_chain) of an incremental Saver, checked; None when not incremental."""
    for name, value in (("full_every", full_every), ("chunk_bytes", chunk_bytes), ("max_chain", max_chain)):
        low = 0 if name == "max_chain" else 1
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            kind = "a non-negative int" if low == 0 else "a positive int"
            raise ValueError(f"{name} must be {kind}{' or None' if name == 'full_every' else ''}, got {value!r}")
    if not incremental:
        return None
    return full_every, chunk_bytes, max_chain


def tree_pairs(tree: Mapping[Any, Any], prefix: str) -> list[tuple[Any, Any]]:
    """A dict's (key, value) pairs with its Modules and nested dicts expanded, as TF2's
    ``Checkpoint(model=..., optimizer=...)``: ``{"model": m}`` gives "model/<attribute path>"."""
    pairs: list[tuple[Any, Any]] = []
    for key, value in tree.items():
        if not isinstance(key, str):  # refused by the caller, which names it
            pairs.append((key, value))
        elif isinstance(value, Module):
            pairs += [(f"{prefix}{key}/{path}", var) for path, var in value.named_variables()]
        elif isinstance(value, Mapping):
            pairs += tree_pairs(value, f"{prefix}{key}/")
        else:
            pairs.append((prefix + key, value))
    return pairs
