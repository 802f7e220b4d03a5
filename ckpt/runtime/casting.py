"""Turning user values into arrays: TensorFlow's dtype inference and the assign cast rule.

Inference (new variables): Python floats become float32, Python ints int32 (int64 when
they do not fit), bools bool, complex complex128, str/bytes byte strings; numpy values keep
their dtype.

Casting (``assign`` and ``dtype=``) follows numpy's ``same_kind`` rule, with Python scalars
weakly typed: int->float and float64->float32 are fine; float->int, complex->real and
anything->bool raise TypeError, as does an integer that does not fit the target.

Example:
    >>> from ckpt.runtime.casting import infer_array
    >>> infer_array([1, 2, 3]).dtype
    dtype('int32')
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ckpt import dtypes

_KIND_ORDER = {"b": 0, "i": 1, "f": 2, "c": 3}
_INT32 = np.iinfo(np.int32)


def _is_python_value(value: Any) -> bool:
    return not isinstance(value, (np.ndarray, np.generic))


def _to_strings(arr: np.ndarray) -> np.ndarray:
    """Return an object array of bytes (str elements are encoded as UTF-8)."""
    out = np.empty(arr.shape, dtype=object)
    flat = out.reshape(-1)
    for i, item in enumerate(arr.reshape(-1)):
        if isinstance(item, str):
            item = item.encode("utf-8")
        elif isinstance(item, (bytes, np.bytes_)):
            item = bytes(item)
        else:
            raise TypeError(f"a string tensor holds bytes or str, got {type(item).__name__} {item!r}")
        flat[i] = item
    return out


def as_array(value: Any) -> tuple[np.ndarray, bool]:
    """Return ``(array, weak)``: the value as an array, and whether it came from Python scalars.

    Strings come back as object arrays of bytes. Ragged nesting raises ValueError.
    """
    weak = _is_python_value(value)
    try:
        arr = np.asarray(value)
    except ValueError as exc:
        raise ValueError(f"cannot make a tensor from {value!r}: {exc}") from exc
    if arr.dtype.kind in "SU":
        return _to_strings(arr), weak
    if arr.dtype.kind == "O":
        flat = arr.reshape(-1)
        if all(isinstance(x, (bytes, str, np.bytes_, np.str_)) for x in flat):
            return _to_strings(arr), weak
        if weak and all(isinstance(x, int) and not isinstance(x, bool) for x in flat):
            raise TypeError(f"integer value {value!r} does not fit in 64 bits")
        raise ValueError(f"cannot make a tensor from {value!r}: mixed or ragged elements")
    return arr, weak


def infer_array(value: Any, dtype: Any = None) -> np.ndarray:
    """Return ``value`` as an array with TensorFlow's dtype inference, or cast to ``dtype``.

    Args:
        value: a scalar, nested list, numpy array or numpy scalar.
        dtype: optional target dtype; the cast must be allowed by the assign rule.

    Returns:
        An array; it may share memory with ``value`` when no conversion was needed.

    Example:
        >>> infer_array(3.14).dtype, infer_array(True).dtype
        (dtype('float32'), dtype('bool'))
    """
    arr, weak = as_array(value)
    if dtype is not None:
        target = dtypes.as_dtype(dtype)
        check_cast(arr, weak, target, "value")
        return arr if arr.dtype == target else arr.astype(target)
    if weak:
        if arr.dtype.kind == "f":
            return arr.astype(np.float32)
        if arr.dtype.kind == "i" and (arr.size == 0 or (_INT32.min <= arr.min() and arr.max() <= _INT32.max)):
            return arr.astype(np.int32)
        if arr.dtype.kind == "u":  # Python ints beyond int64's range
            raise TypeError(f"integer value {value!r} does not fit in int64")
    dtypes.as_dtype(arr.dtype)  # raises TypeError for unsupported dtypes (datetime, structured...)
    return arr


def check_cast(arr: np.ndarray, weak: bool, target: np.dtype, where: str) -> None:
    """Raise TypeError unless ``arr`` may be cast to ``target`` without losing information."""
    src_kind, dst_kind = dtypes.kind(arr.dtype), dtypes.kind(target)
    src_name = "Python " + {"b": "bool", "i": "int", "f": "float", "c": "complex", "S": "string"}.get(
        src_kind, str(arr.dtype)) if weak else dtypes.dt_name_or_none(arr.dtype) or str(arr.dtype)
    dst_name = dtypes.dt_name_or_none(target) or str(target)
    if (src_kind == "S") != (dst_kind == "S") or (src_kind not in _KIND_ORDER and src_kind != "S"):
        raise TypeError(f"{where}: cannot cast {src_name} to {dst_name}")
    if src_kind == "S":
        return
    if dst_kind == "b" and src_kind != "b":
        raise TypeError(f"{where}: cannot cast {src_name} to {dst_name}: only bool converts to bool")
    if _KIND_ORDER[src_kind] > _KIND_ORDER[dst_kind]:
        raise TypeError(f"{where}: cannot cast {src_name} to {dst_name} without losing information")
    if src_kind == "i" and dst_kind == "i" and arr.size and not np.can_cast(arr.dtype, target, "safe"):
        info = np.iinfo(target)
        lo, hi = arr.min(), arr.max()
        if lo < info.min or hi > info.max:
            bad = lo if lo < info.min else hi
            raise TypeError(f"{where}: value {bad} does not fit in {dst_name} [{info.min}, {info.max}]")


def copy_into(dst: np.ndarray, value: Any, where: str) -> None:
    """Copy ``value`` into the existing array ``dst`` with the assign cast and shape rules.

    A 0-d value broadcasts; any other shape must equal ``dst.shape``.
    """
    arr, _weak = prepare(dst, value, where)
    with np.errstate(over="ignore"):  # float64 -> float16 overflow is inf, as numpy casts it
        np.copyto(dst, arr, casting="unsafe")


def prepare(dst: np.ndarray, value: Any, where: str) -> tuple[np.ndarray, bool]:
    """Convert ``value`` and check its dtype and shape against ``dst``; return ``(array, weak)``."""
    arr, weak = as_array(value)
    if arr.shape != dst.shape and arr.ndim != 0:
        raise ValueError(f"{where}: shapes {dst.shape} and {arr.shape} are incompatible")
    check_cast(arr, weak, dst.dtype, where)
    return arr, weak
