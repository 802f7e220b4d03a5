"""Exponential moving averages of variables, as TF1's ``tf.train.ExponentialMovingAverage``.

Each averaged variable gets a shadow variable named ``<name>/ExponentialMovingAverage`` (TF1's
name, so a Saver that includes the shadows writes TF1's keys) that ``apply`` updates in place::

    shadow -= (1 - decay) * (shadow - variable)

with ``decay = min(decay, (1 + n) / (10 + n))`` when ``num_updates`` (n) is given. For evaluation,
``Saver(ema.variables_to_restore(model.variables))`` restores the averages into the model's own
variables.

Example:
    >>> import ckpt
    >>> w = ckpt.Variable(0.0, name="w")
    >>> ema = ckpt.ExponentialMovingAverage(decay=0.5)
    >>> _ = ema.apply([w])  # the shadow starts at w's value
    >>> _ = w.assign(4.0)
    >>> _ = ema.apply([w])
    >>> ema.average(w).name, float(ema.average(w).numpy())
    ('w/ExponentialMovingAverage:0', 2.0)
    >>> sorted(ema.variables_to_restore([w]))
    ['w/ExponentialMovingAverage']
"""

from __future__ import annotations

from collections.abc import Iterable
import numpy as np

from ckpt import dtypes

from .scopes import name_scope
from .variables import Variable

__all__ = ["ExponentialMovingAverage"]

#: The dtypes TF1 averages (it refuses the others with a TypeError, as ckpt does).
_FLOATS = frozenset(map(np.dtype, (np.float16, np.float32, np.float64))) | {np.dtype(dtypes.bfloat16)}


class ExponentialMovingAverage:
    """Maintains moving averages of variables in shadow variables (TF1's ``ExponentialMovingAverage``).

    Args:
        decay: the decay, typically close to 1 (0.999, 0.9999).
        num_updates: optional step count (an int or a ckpt.Variable such as the global step, read at
            each ``apply``): the decay used is then ``min(decay, (1 + n) / (10 + n))``, so averages
            follow the variables closely early in training.
        name: the shadows' name suffix, TF1's "ExponentialMovingAverage" by default.
    """

    def __init__(self, decay: float, num_updates: int | Variable | None = None,
                 name: str = "ExponentialMovingAverage") -> None:
        if not 0.0 <= float(decay) <= 1.0:
            raise ValueError(f"ExponentialMovingAverage: decay must be in [0, 1], got {decay!r}")
        self._decay = float(decay)
        self._num_updates = num_updates
        self._name = name
        # id(variable) -> (the variable, its shadow): the variable is held so that its id stays its own
        self._averages: dict[int, tuple[Variable, Variable]] = {}

    @property
    def name(self) -> str:
        """The shadows' name suffix."""
        return self._name

    def apply(self, variables: Iterable[Variable]) -> list[Variable]:
        """Update the shadows of ``variables`` in place, creating (non-trainable) shadows holding the
        variables' current values the first time each is seen; return the shadows.

        Raises:
            TypeError: for a variable that is not a float16/bfloat16/float32/float64 ckpt.Variable,
                or that is itself one of this object's shadows.
        """
        variables = list(variables)
        for variable in variables:  # all checked before any shadow is made or updated
            self._check(variable)
        shadows = [self._shadow_of(v) for v in variables]
        for variable, shadow in zip(variables, shadows):
            one_minus = np.asarray(self._one_minus_decay(), dtype=variable.dtype)
            current = shadow.numpy()
            # TF1's assign_moving_average: shadow -= (shadow - value) * (1 - decay), in the variable's dtype
            shadow.assign(current - (current - variable.numpy()) * one_minus)
        return shadows

    def average(self, variable: Variable) -> Variable | None:
        """The shadow of ``variable``, or None when ``apply`` has not seen it."""
        pair = self._averages.get(id(variable))
        return None if pair is None else pair[1]

    def average_name(self, variable: Variable) -> str:
        """The checkpoint key of ``variable``'s shadow: ``<key>/ExponentialMovingAverage``."""
        return f"{variable.key}/{self._name}"

    def variables_to_restore(self, variables: Iterable[Variable],
                             moving_avg_variables: Iterable[Variable] | None = None) -> dict[str, Variable]:
        """A Saver's var_list that restores the averages into ``variables`` themselves (TF1's pattern).

        Each variable averaged (those of ``moving_avg_variables``; by default the trainable ones and
        those this object has shadows for) is keyed by its shadow's name; the others by their own
        key; this object's shadows are left out.
        """
        variables = list(variables)
        shadows = {id(s) for _, s in self._averages.values()}
        if moving_avg_variables is None:
            averaged = {id(v) for v in variables if v.trainable or id(v) in self._averages}
        else:
            averaged = {id(v) for v in moving_avg_variables}
        return {self.average_name(v) if id(v) in averaged else v.key: v
                for v in variables if id(v) not in shadows}

    def _one_minus_decay(self) -> np.float32:
        """``1 - decay`` as TF1 computes it: in float32 (its decay is a float32 tensor), cast to each
        variable's dtype afterwards."""
        decay = np.float32(self._decay)
        if self._num_updates is not None:
            n = np.float32(np.asarray(self._num_updates))
            decay = min(decay, (np.float32(1.0) + n) / (np.float32(10.0) + n))
        one_minus: np.float32 = np.float32(1.0) - decay
        return one_minus

    def _check(self, variable: Variable) -> None:
        if not isinstance(variable, Variable):
            raise TypeError(f"ExponentialMovingAverage.apply: expected ckpt.Variables, got {type(variable).__name__}")
        if id(variable) in self._averages:
            return
        if variable.dtype not in _FLOATS:
            raise TypeError(f"ExponentialMovingAverage.apply: variable {variable.key!r} is "
                            f"{dtypes.dtype_name(variable.dtype)}; only float16, bfloat16, float32 and float64 "
                            "variables are averaged")
        if any(s is variable for _, s in self._averages.values()):
            raise TypeError(f"ExponentialMovingAverage.apply: {variable.key!r} is a shadow of this average")

    def _shadow_of(self, variable: Variable) -> Variable:
        pair = self._averages.get(id(variable))
        if pair is not None:
            return pair[1]
        with name_scope(""):  # TF1's name: the variable's own key, whatever scope apply runs in
            shadow = Variable(variable.numpy(), trainable=False, name=self.average_name(variable))
        self._averages[id(variable)] = (variable, shadow)
        return shadow
