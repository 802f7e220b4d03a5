"""The global random generator behind unseeded initializers.

An initializer built without a seed takes its randomness from one process-wide numpy
Generator. :func:`set_seed` resets that generator, so a program that calls it once at
start-up creates the same variables on every run.

Example:
    >>> from ckpt import random
    >>> random.set_seed(5)
    >>> first = random.generator().random(3)
    >>> random.set_seed(5)
    >>> bool((random.generator().random(3) == first).all())
    True
"""

from __future__ import annotations

import operator
import threading

import numpy as np

__all__ = ["set_seed", "generator", "draw_seed"]

# Re-entrant so a caller holding the lock (e.g. while drawing) may call set_seed safely.
_lock = threading.RLock()
_generator: np.random.Generator | None = None  # created on first use: numpy.random costs ~10 ms to import


def _check_seed(seed: int) -> int:
    """Return ``seed`` as a Python int, rejecting what numpy's seeding would reject."""
    if isinstance(seed, bool):
        raise TypeError(f"seed must be an int, not {seed!r}")
    try:
        seed = operator.index(seed)
    except TypeError:
        raise TypeError(f"seed must be an int, not {type(seed).__name__}") from None
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    return seed


def set_seed(seed: int) -> None:
    """Reset the global generator to ``np.random.default_rng(seed)``.

    The generator object stays the same one (its state is replaced), so references
    taken earlier with :func:`generator` see the new seed too.

    Args:
        seed: a non-negative integer.

    Raises:
        TypeError: if ``seed`` is not an integer.
        ValueError: if ``seed`` is negative.

    Example:
        >>> set_seed(0)
        >>> a = draw_seed()
        >>> set_seed(0)
        >>> draw_seed() == a
        True
    """
    seed = _check_seed(seed)
    with _lock:
        generator().bit_generator.state = np.random.default_rng(seed).bit_generator.state


def generator() -> np.random.Generator:
    """Return the global generator that unseeded initializers draw from.

    Other threads may draw between two calls on it; :func:`draw_seed` draws under the
    module's lock, which :func:`set_seed` also takes.

    Example:
        >>> generator().integers(0, 10) in range(10)
        True
    """
    global _generator
    with _lock:
        if _generator is None:
            _generator = np.random.default_rng()
        return _generator


def draw_seed() -> int:
    """Draw a fresh seed in ``[0, 2**63)`` from the global generator.

    ``ckpt.Variable`` uses it to pin an unseeded initializer to concrete values
    (``init.with_seed(draw_seed())``), and unseeded initializers use it for every call.

    Example:
        >>> set_seed(1)
        >>> 0 <= draw_seed() < 2**63
        True
    """
    with _lock:
        return int(generator().integers(0, 2**63, dtype=np.int64))
