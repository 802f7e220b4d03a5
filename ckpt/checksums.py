"""crc32c, the checksum of every tensor ckpt writes, and the arithmetic that combines the
checksums of pieces read side by side (ground floor: formats and storage both use it).

Example:
    >>> a, b = b"hello, ", b"world"
    >>> crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)
    True
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
from typing import Any

__all__ = ["crc32c", "crc32c_combine", "gf2_times"]

_crc32c: Any = None  # the compiled function, loaded on first use
_CRC32C_POLY = 0x82F63B78  # Castagnoli, reflected
_operators: dict[int, list[int]] = {}  # zeros operators by length (a few piece sizes)


def crc32c(data: Any, value: int = 0) -> int:
    """Return the crc32c of ``data`` (a bytes-like object), continuing from ``value``."""
    global _crc32c
    if _crc32c is None:
        _crc32c = _load_crc32c()
    return int(_crc32c(data, value))


def _load_crc32c() -> Any:
    """The crc32c package's compiled function, loaded on first use without running the
    package's ``__init__``: that imports importlib.metadata to look up its own version, 30-60 ms
    of a command's start-up. Any surprise in the package's layout falls back to the import."""
    try:
        spec = importlib.util.find_spec("crc32c")
        for folder in (spec.submodule_search_locations or []) if spec is not None else []:
            for suffix in importlib.machinery.EXTENSION_SUFFIXES:
                location = os.path.join(folder, "_crc32c" + suffix)
                if os.path.isfile(location):
                    loader = importlib.machinery.ExtensionFileLoader("crc32c._crc32c", location)
                    found = importlib.util.spec_from_file_location(loader.name, location, loader=loader)
                    if found is not None:
                        module = importlib.util.module_from_spec(found)
                        loader.exec_module(module)
                        return module.crc32c
    except (ImportError, AttributeError, OSError):
        pass
    import crc32c as package  # the plain import: only if the layout above surprised us

    return package.crc32c


def gf2_times(matrix: list[int], vector: int) -> int:
    """Multiply a 32x32 GF(2) matrix (its columns as ints) by a 32-bit vector."""
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _zeros_operator(nbytes: int) -> list[int]:
    """The matrix that advances a crc32c register over ``nbytes`` zero bytes (by squaring)."""
    op = [_CRC32C_POLY] + [1 << n for n in range(31)]  # one zero bit
    result = [1 << n for n in range(32)]  # identity
    bits = 8 * nbytes
    while bits:
        if bits & 1:
            result = [gf2_times(op, column) for column in result]
        op = [gf2_times(op, column) for column in op]
        bits >>= 1
    return result


def crc32c_combine(crc_a: int, crc_b: int, nbytes_b: int) -> int:
    """crc32c(a + b) from crc32c(a), crc32c(b) and ``len(b)``."""
    op = _operators.get(nbytes_b)
    if op is None:
        op = _zeros_operator(nbytes_b)
        if len(_operators) < 16:  # the piece sizes in use: a handful
            _operators[nbytes_b] = op
    return gf2_times(op, crc_a) ^ crc_b
