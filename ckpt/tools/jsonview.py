"""Numpy values as JSON-ready data, for the JSON views of inspect, diff and stats.

Example:
    >>> import numpy as np
    >>> jsonable({"x": np.array([1.5, np.nan, np.inf]), "n": np.int64(3)})
    {'x': [1.5, 'NaN', 'Infinity'], 'n': 3}
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ckpt import dtypes

__all__ = ["jsonable"]


def jsonable(value: Any) -> Any:
    """Turn numpy values into JSON-ready data: lists, ints, floats, strings.

    Non-finite floats become "NaN", "Infinity" and "-Infinity"; complex numbers [real, imag]
    pairs; byte strings text (UTF-8, other bytes as \\xNN escapes).
    """
    if isinstance(value, np.ndarray):
        if value.dtype == dtypes.bfloat16:
            value = value.astype(np.float32)
        return jsonable(value.tolist())
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return jsonable(value.item())
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, complex):
        return [jsonable(value.real), jsonable(value.imag)]
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value
