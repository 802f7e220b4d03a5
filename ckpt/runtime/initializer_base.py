"""The base of ckpt's initializers: the Initializer classes, shapes and fans, argument checks.

ckpt.runtime.initializers holds the concrete initializers and re-exports these names; this
module is apart so that families of initializers build on it without importing each other.

Example:
    >>> from ckpt.runtime.initializer_base import compute_fans
    >>> compute_fans((3, 3, 64, 128))
    (576, 1152)
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from typing import Any

import numpy as np

from ckpt import dtypes
from ckpt.runtime import random as _random

__all__ = ["Initializer", "RandomInitializer", "as_shape", "compute_fans"]

# The standard deviation of a unit normal truncated at +-2 (Keras divides by it).
_TRUNCATED_STD = 0.87962566103423978


def as_shape(shape: Any) -> tuple[int, ...]:
    """Return ``shape`` (an int or a sequence of ints) as a tuple of non-negative ints: TypeError
    for anything else, ValueError for a negative dimension (as numpy refuses shapes).

    Example:
        >>> as_shape(3), as_shape([2, np.int64(4)])
        ((3,), (2, 4))
    """
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"shape must not have negative dimensions, got {dims}")
    return dims


def compute_fans(shape: Any) -> tuple[int, int]:
    """Return ``(fan_in, fan_out)`` for a weight shape, as Keras computes them.

    Rank 0 gives (1, 1), rank 1 (n, n), rank 2 (rows, cols). Higher ranks are
    convolution kernels ``(*spatial, in_channels, out_channels)``: both fans are
    multiplied by the receptive field, the product of the spatial dimensions.

    Example:
        >>> compute_fans((784, 256))
        (784, 256)
        >>> compute_fans((3, 3, 64, 128))
        (576, 1152)
    """
    dims = as_shape(shape)
    if len(dims) == 0:
        return 1, 1
    if len(dims) == 1:
        return dims[0], dims[0]
    if len(dims) == 2:
        return dims[0], dims[1]
    receptive_field = math.prod(dims[:-2])
    return dims[-2] * receptive_field, dims[-1] * receptive_field


class Initializer:
    """The base class: a configured recipe for an array of a given shape and dtype.

    Subclasses implement ``_generate(shape, dtype)``; the base class parses the
    arguments and makes the result a fresh C-contiguous array of that dtype.

    Example:
        >>> class Twos(Initializer):
        ...     def _generate(self, shape, dtype):
        ...         return np.full(shape, 2)
        >>> Twos()(3, dtype="int8")
        array([2, 2, 2], dtype=int8)
    """

    #: None for deterministic initializers; random ones store their seed here.
    seed: int | None = None

    def __call__(self, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        """Return a new array of ``shape`` and ``dtype``.

        Args:
            shape: an int or a tuple/list of ints.
            dtype: a numpy dtype, a name such as "float32" or "bfloat16", or
                ``ml_dtypes.bfloat16``.

        Example:
            >>> from ckpt.runtime.initializers import Ones
        >>> Ones()((2, 3), dtype="bfloat16").dtype.name
            'bfloat16'
        """
        dims = as_shape(shape)
        dt = dtypes.as_dtype(dtype)
        # _generate returns a fresh array of that shape, so this cast copies at most once
        return np.asarray(self._generate(dims, dt), dtype=dt, order="C")

    def _generate(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        raise NotImplementedError(f"{type(self).__name__} does not implement _generate")

    def get_config(self) -> dict[str, Any]:
        """Return the constructor arguments as a dict (JSON-friendly).

        Example:
            >>> from ckpt.runtime.initializers import RandomNormal
            >>> RandomNormal(stddev=0.1, seed=3).get_config()
            {'mean': 0.0, 'stddev': 0.1, 'seed': 3}
        """
        return {}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Initializer:
        """Build an initializer from the dict :meth:`get_config` returned.

        Example:
            >>> from ckpt.runtime.initializers import HeUniform
            >>> HeUniform.from_config({"seed": 1})
            HeUniform(seed=1)
        """
        return cls(**config)

    def with_seed(self, seed: int | None) -> Initializer:
        """Return a copy drawing from ``seed``; deterministic initializers return self.

        Example:
            >>> from ckpt.runtime.initializers import Zeros
            >>> Zeros().with_seed(7)
            Zeros()
        """
        return self

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return bool(self.get_config() == other.get_config())

    def __hash__(self) -> int:
        return hash((type(self), repr(self)))


def _check_seed(seed: int | None) -> int | None:
    return None if seed is None else _random._check_seed(seed)


def _float_arg(name: str, value: Any, *, nonnegative: bool = False) -> float:
    """Return ``value`` as a float, rejecting NaN (and negatives when asked)."""
    number = float(value)
    if math.isnan(number) or (nonnegative and number < 0):
        raise ValueError(f"{name} must be a {'non-negative ' if nonnegative else ''}number, got {number}")
    return number


def _truncated_normal(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Draw unit normals, re-drawing (not clipping) every value beyond +-2."""
    flat = rng.standard_normal(math.prod(shape))
    bad = np.flatnonzero(np.abs(flat) > 2.0)
    while bad.size:  # about 4.6% are redrawn each round
        flat[bad] = rng.standard_normal(bad.size)
        bad = bad[np.abs(flat[bad]) > 2.0]
    return flat.reshape(shape)


class RandomInitializer(Initializer):
    """The base class of initializers that draw random numbers.

    Seeded instances use a fresh ``np.random.default_rng(seed)`` per call, so they
    repeat themselves; unseeded ones draw a seed from :mod:`ckpt.random` per call.
    Values are sampled in float64 and then cast, so one seed gives the same values
    (up to rounding) in every float dtype.

    Example:
        >>> from ckpt.runtime.initializers import RandomNormal
        >>> init = RandomNormal(seed=4)
        >>> a, b = init(5), init(5, dtype="float64")
        >>> bool((a == b.astype("float32")).all())
        True
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = _check_seed(seed)

    def with_seed(self, seed: int | None) -> Initializer:
        """Return a copy of this initializer with ``seed`` (None: unseeded).

        Example:
            >>> from ckpt.runtime.initializers import GlorotNormal
            >>> GlorotNormal().with_seed(3)
            GlorotNormal(seed=3)
        """
        return type(self).from_config({**self.get_config(), "seed": seed})

    def _rng(self) -> np.random.Generator:
        seed = self.seed if self.seed is not None else _random.draw_seed()
        return np.random.default_rng(seed)

    def _require_float(self, dtype: np.dtype) -> None:
        if dtypes.kind(dtype) != "f":
            raise ValueError(f"{type(self).__name__} needs a floating-point dtype, "
                             f"got {dtypes.dtype_name(dtype)}")
