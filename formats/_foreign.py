"""Small helpers shared by the readers of other frameworks' files.

Foreign files name their dtypes in numpy's words (Flax, PyTorch's dtype globals) and may
hold keys that break ckpt's key rules; both are checked here the same way for every format.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from ckpt.errors import UnsupportedCheckpointError

from .base import key_problem

#: numpy-style dtype names -> dtypes, for names read from files (never ``np.dtype(name)``,
#: which would also accept "object" and structured types).
NUMPY_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name) for name in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128")
}
NUMPY_DTYPES.update({
    name: np.dtype(getattr(ml_dtypes, name)) for name in (
        "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
        "float8_e4m3b11fnuz", "float8_e8m0fnu", "float8_e3m4", "float8_e4m3")
    if hasattr(ml_dtypes, name)
})


def check_key(key: Any, path: str) -> str:
    """Return ``key`` if it follows ckpt's key rules, else raise UnsupportedCheckpointError."""
    problem = key_problem(key)
    if problem:
        raise UnsupportedCheckpointError(
            f"{path}: key {key!r} cannot be a ckpt key ({problem}); ckpt reads files whose keys are "
            "'/'-separated names")
    return key

