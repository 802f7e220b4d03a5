"""Small helpers shared by the readers of other frameworks' files.

Foreign files name their dtypes in numpy's words (Flax, PyTorch's dtype globals) and may
hold keys that break ckpt's key rules; both are checked here the same way for every format.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_dtypes
import numpy as np

from ckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedCheckpointError

from .base import key_problem, unique_pairs

#: JSON files of other frameworks (index files, orbax's metadata) larger than this are refused.
MAX_JSON = 64 << 20
#: The longest integer literal JSON may hold here: Python's default int_max_str_digits, far past any
#: size, offset or count a checkpoint needs.
MAX_INT_DIGITS = 4300

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
    if problem or not isinstance(key, str):
        raise UnsupportedCheckpointError(
            f"{path}: key {key!r} cannot be a ckpt key ({problem}); ckpt reads files whose keys are "
            "'/'-separated names")
    return key



def read_json(path: str, limit: int = MAX_JSON) -> Any:
    """A JSON file another framework wrote: at most ``limit`` bytes, UTF-8, no duplicate keys, no
    NaN/Infinity, nesting the parser accepts; anything else is a CorruptCheckpointError."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(min(size, limit) + 1)  # read(n) allocates n bytes up front: ask for what is there
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such file", path=path) from None
    except OSError as exc:
        raise CorruptCheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if len(raw) > limit:
        raise CorruptCheckpointError(f"{path}: a JSON file over {limit} bytes; ckpt reads at most {limit}")
    return parse_json(raw, path)


def json_int(text: str) -> int:
    """A JSON integer literal (``json.loads``'s ``parse_int``); ValueError past MAX_INT_DIGITS digits.

    Python refuses such literals too, but its message sends users to sys.set_int_max_str_digits,
    which is no advice for a damaged or hostile file: this one says what was found.
    """
    digits = len(text) - text.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {digits} digits (ckpt reads integers of up to {MAX_INT_DIGITS} digits)")
    return int(text)


def parse_json(raw: bytes, path: str) -> Any:
    """JSON bytes as ``read_json`` checks them (``path`` names them in errors)."""

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=unique_pairs, parse_constant=no_constant,
                          parse_int=json_int)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise CorruptCheckpointError(f"{path}: not valid JSON: {str(exc)[:200]}") from None
