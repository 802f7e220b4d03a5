"""Dtype names <-> numpy dtypes.

ckpt speaks numpy dtypes everywhere. Two need help: bfloat16 comes from ml_dtypes, and
byte strings (TensorFlow's ``tf.string``) are numpy object arrays holding ``bytes``, so
any length fits without reallocating. Files store the canonical names below.

Example:
    >>> from ckpt import dtypes
    >>> dtypes.as_dtype("bfloat16").itemsize
    2
    >>> dtypes.dtype_name(dtypes.as_dtype("string"))
    'string'
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["bfloat16", "string", "NAMES", "as_dtype", "dtype_name", "dtype_label", "is_string", "kind"]

bfloat16: np.dtype = np.dtype(ml_dtypes.bfloat16)
#: Byte-string tensors are object arrays whose elements are ``bytes``.
string: np.dtype = np.dtype(object)

_BY_NAME: dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "bfloat16": bfloat16,
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32),
    "uint64": np.dtype(np.uint64),
    "bool": np.dtype(np.bool_),
    "complex64": np.dtype(np.complex64),
    "complex128": np.dtype(np.complex128),
    "string": string,
}
#: The canonical names of every dtype a Variable can hold, as written into files.
NAMES: tuple[str, ...] = tuple(_BY_NAME)
_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "bytes": "string", "str": "string"}


def as_dtype(spec: Any) -> np.dtype:
    """Return the numpy dtype for a name, a numpy dtype or a scalar type.

    Args:
        spec: "float32", "bfloat16", "string", np.float32, np.dtype("int8"), bytes, ...

    Returns:
        The numpy dtype (object for strings).

    Raises:
        TypeError: for a dtype a Variable cannot hold.

    Example:
        >>> as_dtype("int8")
        dtype('int8')
    """
    if isinstance(spec, str):
        name = _ALIASES.get(spec, spec)
        if name in _BY_NAME:
            return _BY_NAME[name]
        raise TypeError(f"unsupported dtype {spec!r}; supported: {', '.join(NAMES)}")
    if spec in (bytes, str, object):
        return string
    try:
        dt = np.dtype(spec)
    except TypeError as exc:
        raise TypeError(f"unsupported dtype {spec!r}; supported: {', '.join(NAMES)}") from exc
    if dt.kind in "SUO":
        return string
    native: np.dtype = dt.newbyteorder("=") if dt.byteorder not in "=|" else dt
    if dt_name_or_none(native) is None:
        raise TypeError(f"unsupported dtype {native}; supported: {', '.join(NAMES)}")
    return native


_NAMES_SEEN: dict[np.dtype, str | None] = {}


def dt_name_or_none(dtype: np.dtype) -> str | None:
    """Return the canonical name of a supported dtype, or None."""
    try:
        return _NAMES_SEEN[dtype]  # a hot path: once per tensor in every save, restore and index
    except KeyError:
        name = _name_or_none(dtype)
        if len(_NAMES_SEEN) < 1024:  # bounded: a program may make endless structured dtypes
            _NAMES_SEEN[dtype] = name
        return name


def _name_or_none(dtype: np.dtype) -> str | None:
    if dtype.kind == "O":
        return "string"
    if dtype == bfloat16:
        return "bfloat16"
    if dtype.kind == "V":
        return None
    name = dtype.newbyteorder("=").name if dtype.byteorder not in "=|" else dtype.name
    return name if name in _BY_NAME else None


def dtype_name(dtype: Any) -> str:
    """Return the canonical name ckpt writes into files for ``dtype``.

    Example:
        >>> dtype_name(np.dtype("float32"))
        'float32'
    """
    name = dt_name_or_none(np.dtype(dtype))
    if name is None:
        raise TypeError(f"unsupported dtype {dtype}; supported: {', '.join(NAMES)}")
    return name


def dtype_label(dtype: np.dtype) -> str:
    """ckpt's name for ``dtype`` ("float32", "bfloat16", "string"), numpy's for others (float8...).

    Example:
        >>> dtype_label(np.dtype("float32")), dtype_label(np.dtype("datetime64[s]"))
        ('float32', 'datetime64[s]')
    """
    name = dt_name_or_none(np.dtype(dtype))
    return str(dtype) if name is None else name


def is_string(dtype: np.dtype) -> bool:
    """True for the byte-string dtype."""
    return dtype.kind == "O"


def kind(dtype: np.dtype) -> str:
    """Return the casting kind: "b" bool, "i" integer, "f" float, "c" complex, "S" string.

    numpy calls bfloat16 a void ("V") type; for casting it is a float.
    """
    if dtype == bfloat16 or dtype.kind == "f":
        return "f"
    if dtype.kind in "iu":
        return "i"
    if dtype.kind in "SUO":
        return "S"
    return dtype.kind
