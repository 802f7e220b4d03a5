"""ckpt.Variable: tf.Variable's semantics on a numpy buffer, and the registry of live variables.

A Variable owns one C-contiguous numpy array, allocated once. Its shape and dtype never
change; ``assign``/``assign_add``/``assign_sub`` and restores write into that array.

Example:
    >>> import ckpt
    >>> v = ckpt.Variable([1.0, 2.0], name="v")
    >>> v.assign_add([1, 1]).numpy()
    array([2., 3.], dtype=float32)
"""

from __future__ import annotations

import itertools
import operator
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ckpt.runtime import casting, random, scopes
from ckpt import dtypes
from ckpt.buffers import aligned_empty, is_aligned
from ckpt.errors import UninitializedVariableError
from ckpt.runtime.shard import Shard
from ckpt.runtime.initializer_base import Initializer, RandomInitializer, as_shape

__all__ = ["Variable", "global_variables", "trainable_variables", "initialize_variables",
           "initialize_all_variables", "report_uninitialized_variables"]

_registry: weakref.WeakValueDictionary[int, Variable] = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()
_ids = itertools.count()


def _binary(op: Callable[[Any, Any], Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def forward(self: Variable, other: Any) -> Any:
        return op(self._read(), _unwrap(other))

    def reverse(self: Variable, other: Any) -> Any:
        return op(_unwrap(other), self._read())

    return forward, reverse


def _unwrap(value: Any) -> Any:
    return value._read() if isinstance(value, Variable) else value


class Variable:
    """A named, fixed-shape, fixed-dtype array updated in place.

    Args:
        initial_value: an array-like or scalar; another Variable (its value is copied); or a
            callable initializer, called as ``init(shape, dtype=dtype)`` when ``shape`` is
            given and as ``init()`` otherwise.
        trainable: whether ``trainable_variables()`` and ``Module.trainable_variables`` list it.
        name: the name inside the active name scope; "Variable" when omitted. Names need not
            be unique. The checkpoint key is ``name`` without ":0".
        dtype: cast the initial value to this dtype (the cast must not lose information).
        shape: the shape, required with a callable initializer under ``deferred_init()``.
        shard: a :class:`ckpt.Shard`: this variable holds one block of a larger tensor
            (see ckpt/runtime/shard.py); checkpoints save and restore the global tensor.

    Example:
        >>> import ckpt
        >>> v = ckpt.Variable(3.14, name="var_a")
        >>> v
        <ckpt.Variable 'var_a:0' shape=() dtype=float32, numpy=3.14>
        >>> v.assign(2)
        <ckpt.Variable 'var_a:0' shape=() dtype=float32, numpy=2.0>
    """

    __slots__ = (
        "__weakref__",
        "_adoptable",
        "_dtype",
        "_initial",
        "_initialized",
        "_name",
        "_requested_device",
        "_shape",
        "_shard",
        "_trainable",
        "_uid",
        "_value",
        "_writes",
    )

    def __init__(self, initial_value: Any, trainable: bool = True, name: str | None = None,
                 dtype: Any = None, shape: Sequence[int] | None = None, shard: Shard | None = None) -> None:
        if name is None:
            name = "Variable"
        scopes.validate_name(name, "variable name")
        self._name = scopes.current_name_scope() + name
        self._trainable = bool(trainable)
        self._requested_device = scopes.current_device()
        target = None if dtype is None else dtypes.as_dtype(dtype)
        want_shape = None if shape is None else as_shape(shape)
        self._value: np.ndarray | None = None
        self._initialized = False
        #: bumped by every write (assign, assign_add/sub, initialize, restores): an incremental
        #: Saver reuses the entry of a variable whose count is unchanged since its last save
        self._writes = 0
        first: np.ndarray | None
        if callable(initial_value) and not isinstance(initial_value, Variable):
            init = _pin_seed(initial_value)
            if want_shape is None and isinstance(init, Initializer):  # it makes values of a given shape
                raise ValueError(f"variable {self._name!r}: an initializer ({type(init).__name__}) needs "
                                f"shape=, e.g. ckpt.Variable(ckpt.initializers.{type(init).__name__}(), shape=(2, 3))")
            if want_shape is None:
                if scopes.is_deferred():
                    raise ValueError(f"variable {self._name!r}: deferred_init needs a shape for a "
                                     "callable initializer")
                self._initial: Callable[[], np.ndarray] = lambda: casting.infer_array(init(), target)
                first = self._initial()
                self._shape, self._dtype = first.shape, first.dtype
            else:
                self._shape = want_shape
                self._dtype = target if target is not None else np.dtype(np.float32)
                call_dtype = self._dtype
                self._initial = lambda: np.asarray(init(want_shape, dtype=call_dtype))
                first = None if scopes.is_deferred() else self._initial()
            self._adoptable = isinstance(init, Initializer)
        else:
            source = _unwrap(initial_value)
            value = np.array(casting.infer_array(source, target), copy=True, order="C")
            if want_shape is not None and value.shape != want_shape:
                raise ValueError(f"variable {self._name!r}: initial value has shape {value.shape}, "
                                 f"shape={want_shape} was given")
            value.flags.writeable = False
            self._shape, self._dtype = value.shape, value.dtype
            self._initial = lambda: value
            self._adoptable = False
            first = value
        if shard is not None:
            if not isinstance(shard, Shard):
                raise TypeError(f"variable {self._name!r}: shard must be a ckpt.Shard, got {type(shard).__name__}")
            shard.check(self._shape, self._name)
        self._shard = shard
        if first is not None:
            self._copy_initial(first)
        with _registry_lock:
            self._uid = next(_ids)  # creation order for global_variables()
            _registry[self._uid] = self

    # --- properties -----------------------------------------------------------------
    @property
    def name(self) -> str:
        """The name with TensorFlow's ":0" output suffix, e.g. "layer1/kernel:0"."""
        return self._name + ":0"

    @property
    def key(self) -> str:
        """The name as a checkpoint key (without ":0")."""
        return self._name

    @property
    def shape(self) -> tuple[int, ...]:
        """The fixed shape."""
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def dtype(self) -> np.dtype:
        """The fixed numpy dtype (object for byte strings)."""
        return self._dtype

    @property
    def trainable(self) -> bool:
        return self._trainable

    @property
    def device(self) -> str:
        """Where the value really lives: always this process's CPU memory."""
        return scopes.LOCAL_CPU

    @property
    def requested_device(self) -> str:
        """The device asked for with ``ckpt.device(...)`` when the variable was created ("" if none)."""
        return self._requested_device

    @property
    def shard(self) -> Shard | None:
        """The block of a global tensor this variable holds, or None (it is the whole tensor)."""
        return self._shard

    def is_initialized(self) -> bool:
        """False for a deferred variable not yet initialized or restored, or after a failed restore."""
        return self._initialized

    # --- reads ----------------------------------------------------------------------
    def _read(self) -> np.ndarray:
        if not self._initialized:
            raise UninitializedVariableError(
                f"variable {self.name!r} is uninitialized: call initialize() or restore it from a "
                "checkpoint before reading it")
        assert self._value is not None
        return self._value

    def numpy(self) -> Any:
        """Return a copy of the value (a numpy scalar for 0-d variables)."""
        value = self._read()
        return value[()] if value.ndim == 0 else value.copy()

    def value(self) -> np.ndarray:
        """Return a read-only snapshot of the value."""
        snapshot: np.ndarray = self._read().copy()
        snapshot.flags.writeable = False
        return snapshot

    read_value = value

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if copy is False:
            raise ValueError("a Variable cannot be viewed without a copy; use copy=None")
        return np.array(self._read(), dtype=dtype, copy=True)

    def initialized_value(self) -> np.ndarray:
        """Return the initial value (computed again for an initializer; seeds make it the same).

        Example:
            >>> import ckpt
            >>> w = ckpt.Variable(ckpt.initializers.RandomNormal(), shape=(2, 2))
            >>> bool((w.initialized_value() == w.numpy()).all())
            True
        """
        return np.array(self._initial(), dtype=self._dtype, copy=True)

    # --- writes ---------------------------------------------------------------------
    def _writable_buffer(self) -> np.ndarray:
        """The buffer a restore reads into, allocated (uninitialized) for a deferred variable.
        Counts as a write: the caller writes into it."""
        if self._value is None:
            self._value = aligned_empty(self._shape, self._dtype)
        self._writes += 1
        return self._value

    def _copy_initial(self, value: np.ndarray) -> None:
        if self._value is None and self._adoptable and value.flags.c_contiguous and is_aligned(value) \
                and value.shape == self._shape and value.dtype == self._dtype:
            self._value = value  # a ckpt initializer returns a fresh array: adopt it, no copy
        else:
            casting.copy_into(self._writable_buffer(), value, f"initializing variable {self.name}")
        self._writes += 1
        self._initialized = True

    def initialize(self) -> None:
        """Set the variable to its initial value (runs the initializer for a deferred variable)."""
        self._copy_initial(self._initial())

    # a restore writes into ``_value`` directly (batched reads), then calls one of these two
    def _mark_restored(self) -> None:
        self._writes += 1
        self._initialized = True

    def _mark_uninitialized(self) -> None:
        self._writes += 1
        self._initialized = False

    def assign(self, value: Any, read_value: bool = True) -> Variable | None:
        """Write ``value`` into the existing buffer.

        Args:
            value: same shape (or a scalar), dtype castable without loss.
            read_value: return the variable when True, None otherwise.

        Raises:
            ValueError: for a different shape. TypeError: for a lossy cast.

        Example:
            >>> import ckpt
            >>> v = ckpt.Variable([1, 2])
            >>> v.assign([3, 4]).numpy()
            array([3, 4], dtype=int32)
        """
        buffer = self._writable_buffer()
        casting.copy_into(buffer, _unwrap(value), f"Cannot assign to variable {self.name}")
        self._writes += 1  # after the write too: a save that read the count meanwhile sees a change
        self._initialized = True
        return self if read_value else None

    def _update(self, ufunc: np.ufunc, value: Any, read_value: bool, verb: str) -> Variable | None:
        where = f"Cannot {verb} variable {self.name}"
        if dtypes.kind(self._dtype) in "bS":
            raise TypeError(f"{where}: {verb} is not defined for {dtypes.dtype_name(self._dtype)}")
        buffer = self._read()
        arr, _ = casting.prepare(buffer, _unwrap(value), where)
        with np.errstate(over="ignore"):
            ufunc(buffer, arr, out=buffer, casting="unsafe")
        self._writes += 1
        return self if read_value else None

    def assign_add(self, delta: Any, read_value: bool = True) -> Variable | None:
        """Add ``delta`` in place; same rules as ``assign``.

        Example:
            >>> import ckpt
            >>> ckpt.Variable(1.0).assign_add(2).numpy()
            np.float32(3.0)
        """
        return self._update(np.add, delta, read_value, "assign_add to")

    def assign_sub(self, delta: Any, read_value: bool = True) -> Variable | None:
        """Subtract ``delta`` in place; same rules as ``assign``."""
        return self._update(np.subtract, delta, read_value, "assign_sub from")

    # --- python protocol --------------------------------------------------------------
    def __repr__(self) -> str:
        dtype = dtypes.dt_name_or_none(self._dtype) or str(self._dtype)
        if not self._initialized:
            shown = "<uninitialized>"
        elif self._value is not None and self._value.ndim == 0:
            item = self._value[()]
            shown = repr(item) if dtypes.is_string(self._dtype) else str(item)
        else:
            shown = repr(self._value)
        return f"<ckpt.Variable {self.name!r} shape={self._shape} dtype={dtype}, numpy={shown}>"

    __hash__ = object.__hash__  # identity, so variables can key dicts; == stays elementwise

    def __bool__(self) -> bool:
        return bool(self._read())

    def __float__(self) -> float:
        return float(self._read())

    def __int__(self) -> int:
        return int(self._read())

    def __complex__(self) -> complex:
        return complex(self._read())

    def __index__(self) -> int:
        return operator.index(self._read()[()])

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError(f"len() of a 0-d variable {self.name!r}")
        return int(self._shape[0])

    def __iter__(self) -> Iterator[np.ndarray]:
        if not self._shape:
            raise TypeError(f"iteration over a 0-d variable {self.name!r}")
        return iter(self._read().copy())

    def __getitem__(self, key: Any) -> Any:
        item = self._read()[key]
        return item.copy() if isinstance(item, np.ndarray) else item

    __add__, __radd__ = _binary(operator.add)
    __sub__, __rsub__ = _binary(operator.sub)
    __mul__, __rmul__ = _binary(operator.mul)
    __truediv__, __rtruediv__ = _binary(operator.truediv)
    __floordiv__, __rfloordiv__ = _binary(operator.floordiv)
    __mod__, __rmod__ = _binary(operator.mod)
    __pow__, __rpow__ = _binary(operator.pow)
    __matmul__, __rmatmul__ = _binary(operator.matmul)
    __and__, __rand__ = _binary(operator.and_)
    __or__, __ror__ = _binary(operator.or_)
    __xor__, __rxor__ = _binary(operator.xor)
    __lt__, __gt__ = _binary(operator.lt)[0], _binary(operator.gt)[0]
    __le__, __ge__ = _binary(operator.le)[0], _binary(operator.ge)[0]
    __eq__, __ne__ = _binary(operator.eq)[0], _binary(operator.ne)[0]

    def __neg__(self) -> Any:
        return -self._read()

    def __pos__(self) -> Any:
        return +self._read()

    def __abs__(self) -> Any:
        return abs(self._read())

    def __invert__(self) -> Any:
        return ~self._read()


def _pin_seed(init: Callable[..., Any]) -> Callable[..., Any]:
    """Fix an unseeded ckpt initializer to a seed drawn now, so initialized_value() repeats it."""
    if isinstance(init, RandomInitializer) and init.seed is None:
        return init.with_seed(random.draw_seed())
    return init


def global_variables() -> list[Variable]:
    """Return every live variable in creation order.

    Example:
        >>> import ckpt
        >>> v = ckpt.Variable(1.0, name="counted")
        >>> any(x is v for x in ckpt.global_variables())  # not ``in``: == compares values
        True
    """
    with _registry_lock:
        return list(_registry.values())


def trainable_variables() -> list[Variable]:
    """Return the live variables created with ``trainable=True``, in creation order."""
    return [v for v in global_variables() if v.trainable]


def initialize_variables(var_list: Iterable[Variable]) -> None:
    """Set each variable in ``var_list`` to its initial value.

    Example:
        >>> import ckpt
        >>> v = ckpt.Variable(1.0)
        >>> _ = v.assign(5.0)
        >>> ckpt.initialize_variables([v]); float(v)
        1.0
    """
    for v in var_list:
        v.initialize()


def initialize_all_variables() -> None:
    """Set every live variable to its initial value (TF1's global initializer)."""
    initialize_variables(global_variables())


def report_uninitialized_variables(var_list: Iterable[Variable] | None = None) -> list[str]:
    """Return the names (without ":0") of the uninitialized variables in ``var_list`` (default: all).

    Example:
        >>> import ckpt
        >>> with ckpt.deferred_init():
        ...     v = ckpt.Variable(ckpt.initializers.Zeros(), shape=(2,), name="later")
        >>> "later" in ckpt.report_uninitialized_variables()
        True
    """
    candidates = global_variables() if var_list is None else var_list
    return [v.key for v in candidates if not v.is_initialized()]
