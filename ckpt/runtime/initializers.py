"""Keras-compatible initializers that return numpy arrays.

An initializer is a small configured object called as ``init(shape, dtype)``; it
returns a new C-contiguous array of exactly that shape and dtype. The formulas follow
Keras, so ``GlorotUniform`` here draws from the same distribution as
``keras.initializers.GlorotUniform``.

Seeding: an initializer built with ``seed=`` gives the same values on every call. An
unseeded one takes one fresh seed per call from :func:`ckpt.random.draw_seed`, so
``ckpt.random.set_seed`` makes a whole program reproducible.

Example:
    >>> from ckpt import initializers
    >>> init = initializers.GlorotUniform(seed=0)
    >>> w = init((784, 256))
    >>> w.shape, w.dtype
    ((784, 256), dtype('float32'))
    >>> bool((init((784, 256)) == w).all())
    True
    >>> initializers.get("he_normal")
    HeNormal(seed=None)
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from ckpt import dtypes
from ckpt.runtime.initializer_base import (_TRUNCATED_STD, Initializer, RandomInitializer, _float_arg,
                                           _truncated_normal, compute_fans)

__all__ = [
    "Initializer", "RandomInitializer",
    "Zeros", "Ones", "Constant", "Identity",
    "RandomNormal", "RandomUniform", "TruncatedNormal", "Orthogonal",
    "VarianceScaling", "GlorotNormal", "GlorotUniform", "HeNormal", "HeUniform",
    "LecunNormal", "LecunUniform",
    "compute_fans", "get", "serialize",
]

class Zeros(Initializer):
    """Fill with zeros (empty byte strings for the string dtype).

    Example:
        >>> Zeros()((2,), dtype="int32")
        array([0, 0], dtype=int32)
    """

    def _generate(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if dtypes.is_string(dtype):
            return np.full(shape, b"", dtype=object)
        return np.zeros(shape, dtype=dtype)


class Ones(Initializer):
    """Fill with ones.

    Example:
        >>> Ones()(3, dtype=bool)
        array([ True,  True,  True])
    """

    def _generate(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if dtypes.is_string(dtype):
            raise ValueError("Ones cannot fill the string dtype")
        return np.ones(shape, dtype=dtype)


class Constant(Initializer):
    """Fill with ``value``, broadcast to the shape and cast to the dtype.

    ``value`` may be a scalar or anything numpy broadcasts to the requested shape; a
    ``str`` or ``bytes`` value fills the string dtype.

    Example:
        >>> Constant(7)((2, 2), dtype="int8")
        array([[7, 7],
               [7, 7]], dtype=int8)
        >>> Constant([1, 2])((2, 2))
        array([[1., 2.],
               [1., 2.]], dtype=float32)
    """

    def __init__(self, value: Any = 0) -> None:
        # store plain Python values so the config stays JSON-friendly
        self.value = value.tolist() if isinstance(value, (np.ndarray, np.generic)) else value

    def _generate(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        value = self.value
        if dtypes.is_string(dtype):
            value = np.asarray(value.encode() if isinstance(value, str) else value, dtype=object)
        else:
            value = np.asarray(value).astype(dtype)
        try:
            out: np.ndarray = np.broadcast_to(value, shape).copy()
            return out
        except ValueError:
            raise ValueError(f"Constant value of shape {value.shape} does not broadcast "
                             f"to shape {shape}") from None

    def get_config(self) -> dict[str, Any]:
        return {"value": self.value}


class Identity(Initializer):
    """The identity matrix times ``gain``; 2-D shapes only (rectangular is fine).

    Example:
        >>> Identity(gain=2.0)((2, 3))
        array([[2., 0., 0.],
               [0., 2., 0.]], dtype=float32)
    """

    def __init__(self, gain: float = 1.0) -> None:
        self.gain = _float_arg("gain", gain)

    def _generate(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if len(shape) != 2:
            raise ValueError(f"Identity needs a 2-D shape, got {shape} of rank {len(shape)}")
        if dtypes.is_string(dtype):
            raise ValueError("Identity cannot fill the string dtype")
        return np.eye(*shape) * self.gain

    def get_config(self) -> dict[str, Any]:
        return {"gain": self.gain}


class RandomNormal(RandomInitializer):
    """Draw from a normal distribution with ``mean`` and ``stddev``.

    Example:
        >>> w = RandomNormal(mean=1.0, stddev=0.1, seed=0)((100, 100))
        >>> round(float(w.mean()), 1), round(float(w.std()), 2)
        (1.0, 0.1)
    """

    def __init__(self, mean: float = 0.0, stddev: float = 0.05, seed: int | None = None) -> None:
        super().__init__(seed)
        self.mean = _float_arg("mean", mean)
        self.stddev = _float_arg("stddev", stddev, nonnegative=True)

    def _generate(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        self._require_float(dtype)
        return self._rng().normal(self.mean, self.stddev, shape)

    def get_config(self) -> dict[str, Any]:
        return {"mean": self.mean, "stddev": self.stddev, "seed": self.seed}


class TruncatedNormal(RandomInitializer):
    """Draw from a normal distribution, re-drawing values beyond two ``stddev`` of ``mean``.

    The result's standard deviation is about ``0.8796 * stddev``.

    Example:
        >>> w = TruncatedNormal(stddev=1.0, seed=0)((100, 100))
        >>> bool((abs(w) <= 2.0).all())
        True
    """

    def __init__(self, mean: float = 0.0, stddev: float = 0.05, seed: int | None = None) -> None:
        super().__init__(seed)
        self.mean = _float_arg("mean", mean)
        self.stddev = _float_arg("stddev", stddev, nonnegative=True)

    def _generate(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        self._require_float(dtype)
        return self.mean + self.stddev * _truncated_normal(self._rng(), shape)

    def get_config(self) -> dict[str, Any]:
        return {"mean": self.mean, "stddev": self.stddev, "seed": self.seed}


class RandomUniform(RandomInitializer):
    """Draw uniformly from ``[minval, maxval)``; integer dtypes get integers in that range.

    Example:
        >>> w = RandomUniform(-1.0, 1.0, seed=0)((100, 100))
        >>> bool((w >= -1).all() and (w <= 1).all())
        True
        >>> sorted(set(RandomUniform(0, 3, seed=0)(1000, dtype="int32").tolist()))
        [0, 1, 2]
    """

    def __init__(self, minval: float = -0.05, maxval: float = 0.05, seed: int | None = None) -> None:
        super().__init__(seed)
        self.minval = _float_arg("minval", minval)
        self.maxval = _float_arg("maxval", maxval)
        if self.maxval < self.minval:
            raise ValueError(f"maxval ({self.maxval}) must not be less than minval ({self.minval})")

    def _generate(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if dtypes.kind(dtype) == "i":
            return self._integers(shape, dtype)
        self._require_float(dtype)
        return self._rng().uniform(self.minval, self.maxval, shape)

    def _integers(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        # the integers n with minval <= n < maxval
        low, high = math.ceil(self.minval), math.ceil(self.maxval)
        info = np.iinfo(dtype)
        if high <= low:
            raise ValueError(f"RandomUniform: no integer in [{self.minval}, {self.maxval})")
        if low < info.min or high - 1 > info.max:
            raise ValueError(f"RandomUniform: [{low}, {high}) does not fit {dtype.name}")
        return self._rng().integers(low, high, shape, dtype=dtype)

    def get_config(self) -> dict[str, Any]:
        return {"minval": self.minval, "maxval": self.maxval, "seed": self.seed}


class VarianceScaling(RandomInitializer):
    """Scale the spread to the weight's fan, as Keras's ``VarianceScaling`` does.

    ``scale`` is divided by ``max(1, n)`` where ``n`` is fan_in, fan_out or their
    average (``mode``). Then ``truncated_normal`` uses
    ``stddev = sqrt(scale) / 0.8796...`` (so the truncated result has ``sqrt(scale)``),
    ``untruncated_normal`` uses ``stddev = sqrt(scale)`` and ``uniform`` draws from
    ``[-limit, limit]`` with ``limit = sqrt(3 * scale)``.

    Example:
        >>> init = VarianceScaling(scale=2.0, mode="fan_out", distribution="uniform", seed=0)
        >>> w = init((100, 200))
        >>> bool(abs(w).max() <= (3 * 2.0 / 200) ** 0.5)
        True
    """

    MODES = ("fan_in", "fan_out", "fan_avg")
    DISTRIBUTIONS = ("truncated_normal", "untruncated_normal", "uniform")

    def __init__(self, scale: float = 1.0, mode: str = "fan_in",
                 distribution: str = "truncated_normal", seed: int | None = None) -> None:
        super().__init__(seed)
        self.scale = _float_arg("scale", scale)
        if not self.scale > 0:
            raise ValueError(f"scale must be positive, got {scale}")
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {', '.join(self.MODES)}; got {mode!r}")
        if distribution not in self.DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {', '.join(self.DISTRIBUTIONS)}; "
                             f"got {distribution!r}")
        self.mode = mode
        self.distribution = distribution

    def _generate(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        self._require_float(dtype)
        fan_in, fan_out = compute_fans(shape)
        fan = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2.0}[self.mode]
        scale = self.scale / max(1.0, fan)
        rng = self._rng()
        if self.distribution == "truncated_normal":
            return math.sqrt(scale) / _TRUNCATED_STD * _truncated_normal(rng, shape)
        if self.distribution == "untruncated_normal":
            return rng.normal(0.0, math.sqrt(scale), shape)
        limit = math.sqrt(3.0 * scale)
        return rng.uniform(-limit, limit, shape)

    def get_config(self) -> dict[str, Any]:
        return {"scale": self.scale, "mode": self.mode, "distribution": self.distribution,
                "seed": self.seed}


class _Preset(VarianceScaling):
    """A VarianceScaling with fixed (scale, mode, distribution); only the seed varies."""

    _preset: tuple[float, str, str]

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(*self._preset, seed=seed)

    def get_config(self) -> dict[str, Any]:
        return {"seed": self.seed}


class GlorotNormal(_Preset):
    """Glorot (Xavier) normal: truncated normal, ``stddev = sqrt(2 / (fan_in + fan_out))``.

    Example:
        >>> GlorotNormal(seed=0)((3, 3, 64, 128)).shape
        (3, 3, 64, 128)
    """

    _preset = (1.0, "fan_avg", "truncated_normal")


class GlorotUniform(_Preset):
    """Glorot (Xavier) uniform: ``[-limit, limit]``, ``limit = sqrt(6 / (fan_in + fan_out))``.

    Example:
        >>> bool(abs(GlorotUniform(seed=0)((4, 2))).max() <= 1.0)
        True
    """

    _preset = (1.0, "fan_avg", "uniform")


class HeNormal(_Preset):
    """He normal: truncated normal, ``stddev = sqrt(2 / fan_in)``.

    Example:
        >>> HeNormal(seed=0)((8, 4)).dtype
        dtype('float32')
    """

    _preset = (2.0, "fan_in", "truncated_normal")


class HeUniform(_Preset):
    """He uniform: ``[-limit, limit]``, ``limit = sqrt(6 / fan_in)``.

    Example:
        >>> bool(abs(HeUniform(seed=0)((6, 4))).max() <= 1.0)
        True
    """

    _preset = (2.0, "fan_in", "uniform")


class LecunNormal(_Preset):
    """LeCun normal: truncated normal, ``stddev = sqrt(1 / fan_in)``.

    Example:
        >>> LecunNormal(seed=0)(5).shape
        (5,)
    """

    _preset = (1.0, "fan_in", "truncated_normal")


class LecunUniform(_Preset):
    """LeCun uniform: ``[-limit, limit]``, ``limit = sqrt(3 / fan_in)``.

    Example:
        >>> bool(abs(LecunUniform(seed=0)((3, 4))).max() <= 1.0)
        True
    """

    _preset = (1.0, "fan_in", "uniform")


class Orthogonal(RandomInitializer):
    """A random orthogonal matrix times ``gain`` (Keras's algorithm); needs rank >= 2.

    The shape is flattened to ``(prod(shape[:-1]), shape[-1])``; the result has
    orthonormal columns when that is tall and orthonormal rows when it is wide.

    Example:
        >>> q = Orthogonal(seed=0)((4, 3), dtype="float64")
        >>> bool(np.allclose(q.T @ q, np.eye(3)))
        True
    """

    def __init__(self, gain: float = 1.0, seed: int | None = None) -> None:
        super().__init__(seed)
        self.gain = _float_arg("gain", gain)

    def _generate(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if len(shape) < 2:
            raise ValueError(f"Orthogonal needs a shape of rank >= 2, got {shape} of rank {len(shape)}")
        self._require_float(dtype)
        rows, cols = math.prod(shape[:-1]), shape[-1]
        if rows == 0 or cols == 0:
            return np.zeros(shape)
        # QR of the tall orientation gives orthonormal columns
        a = self._rng().standard_normal((max(rows, cols), min(rows, cols)))
        q, r = np.linalg.qr(a)
        q *= np.sign(np.diag(r))  # makes the distribution uniform (Haar), as Keras does
        if rows < cols:
            q = q.T
        return self.gain * q.reshape(shape)

    def get_config(self) -> dict[str, Any]:
        return {"gain": self.gain, "seed": self.seed}


_CLASSES: dict[str, type[Initializer]] = {
    cls.__name__: cls
    for cls in (Zeros, Ones, Constant, Identity, RandomNormal, RandomUniform, TruncatedNormal,
                Orthogonal, VarianceScaling, GlorotNormal, GlorotUniform, HeNormal, HeUniform,
                LecunNormal, LecunUniform)
}
# "GlorotUniform" -> "glorot_uniform"
_BY_SNAKE_NAME = {re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower(): cls for name, cls in _CLASSES.items()}


def _lookup(name: str) -> type[Initializer]:
    cls = _CLASSES.get(name) or _BY_SNAKE_NAME.get(name)
    if cls is None:
        raise ValueError(f"unknown initializer {name!r}; valid names: "
                         f"{', '.join(list(_CLASSES) + list(_BY_SNAKE_NAME))}")
    return cls


def get(identifier: Initializer | str | Mapping[str, Any]) -> Initializer:
    """Return the initializer an identifier names.

    Args:
        identifier: an :class:`Initializer` (returned as is), a class name
            ("GlorotUniform"), a snake_case name ("glorot_uniform"), or a config dict
            ``{"class_name": ..., "config": {...}}`` as :func:`serialize` returns.

    Raises:
        ValueError: for an unknown name or anything else that names no initializer.

    Example:
        >>> get("zeros")
        Zeros()
        >>> get({"class_name": "RandomNormal", "config": {"stddev": 1.0, "seed": 2}})
        RandomNormal(mean=0.0, stddev=1.0, seed=2)
    """
    if isinstance(identifier, Initializer):
        return identifier
    if isinstance(identifier, str):
        return _lookup(identifier)()
    if isinstance(identifier, Mapping) and isinstance(identifier.get("class_name"), str):
        return _lookup(identifier["class_name"]).from_config(identifier.get("config") or {})
    raise ValueError(f"cannot interpret {identifier!r} as an initializer: pass an Initializer, "
                     "a name such as 'glorot_uniform', or {'class_name': ..., 'config': ...}")


def serialize(initializer: Initializer) -> dict[str, Any]:
    """Return ``{"class_name": ..., "config": ...}``, the dict :func:`get` accepts.

    Example:
        >>> serialize(HeNormal(seed=1))
        {'class_name': 'HeNormal', 'config': {'seed': 1}}
        >>> get(serialize(HeNormal(seed=1))) == HeNormal(seed=1)
        True
    """
    return {"class_name": type(initializer).__name__, "config": initializer.get_config()}
