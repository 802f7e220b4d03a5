"""ckpt.Module: tf.Module's semantics — a container that finds its variables.

Variables and submodules are found through attributes, lists, tuples and dicts, in a
deterministic order (attributes and dict keys sorted, as TensorFlow does; a module's own
variables before its submodules'). A variable reachable twice is listed once.

Example:
    >>> import ckpt
    >>> class Dense(ckpt.Module):
    ...     def __init__(self, n_in, n_out, name=None):
    ...         super().__init__(name=name)
    ...         with self.name_scope:
    ...             self.kernel = ckpt.Variable(ckpt.initializers.GlorotUniform(seed=1),
    ...                                         shape=(n_in, n_out), name="kernel")
    ...             self.bias = ckpt.Variable(ckpt.initializers.Zeros(), shape=(n_out,), name="bias")
    >>> class MLP(ckpt.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         with self.name_scope:
    ...             self.layers = [Dense(4, 8, name="dense_0"), Dense(8, 2, name="dense_1")]
    >>> mlp = MLP()
    >>> [v.name for v in mlp.variables][:2]
    ['mlp/dense_0/bias:0', 'mlp/dense_0/kernel:0']
    >>> [path for path, _ in mlp.named_variables()][:2]
    ['layers/0/bias', 'layers/0/kernel']
"""

from __future__ import annotations

import functools
import re
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ckpt.runtime import scopes
from ckpt.runtime.variables import Variable

__all__ = ["Module"]

F = TypeVar("F", bound=Callable[..., Any])
_OWN_ATTRIBUTES = frozenset({"_module_name", "_module_scope", "__weakref__"})

# (parent scope, name) -> the live module holding that name; weak, so a dropped model frees its names
_live_names: dict[tuple[str, str], weakref.ref[Module]] = {}
_names_lock = threading.Lock()


def _claim_name(parent: str, name: str | None, default: str, module: Module) -> str:
    """Return ``name``, or for None the first of default, default_1, ... no live module in
    ``parent`` holds (as Keras and TF1 graphs name layers), and record it as taken."""
    with _names_lock:
        if name is None:
            name, n = default, 0
            while (ref := _live_names.get((parent, name))) is not None and ref() is not None:
                n += 1
                name = f"{default}_{n}"
        slot = (parent, name)

        def release(ref: weakref.ref[Module]) -> None:
            with _names_lock:
                if _live_names.get(slot) is ref:
                    del _live_names[slot]

        _live_names[slot] = weakref.ref(module, release)
        return name


def _snake_case(name: str) -> str:
    # "MLP" -> "mlp", "DenseLayer" -> "dense_layer", "HTTPServer" -> "http_server"
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


class Module:
    """A named container of variables and other modules.

    Args:
        name: the module's name. It must be a valid Python identifier. Without one, the
            class name in snake_case made unique among the live modules of the enclosing
            name scope, as Keras names layers: "dense", "dense_1", ... Variables created under
            ``with self.name_scope:`` are named "<enclosing scopes>/<name>/<variable name>:0".

    Example:
        >>> import ckpt
        >>> class Scale(ckpt.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         with self.name_scope:
        ...             self.w = ckpt.Variable(2.0, name="w")
        >>> Scale().w.name
        'scale/w:0'
        >>> class Pair(ckpt.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         with self.name_scope:
        ...             self.parts = [Scale(), Scale()]
        >>> [v.name for v in Pair().variables]
        ['pair/scale/w:0', 'pair/scale_1/w:0']
    """

    def __init__(self, name: str | None = None) -> None:
        if name is not None and (not isinstance(name, str) or not name.isidentifier()):
            raise ValueError(f"{name!r} is not a valid module name: use a Python identifier")
        name = _claim_name(scopes.current_name_scope(), name, _snake_case(type(self).__name__), self)
        self._module_name = name
        with scopes.name_scope(name) as scope:
            self._module_scope = scope  # absolute: includes the scopes active at construction

    def _scope(self) -> str:
        try:
            return self._module_scope
        except AttributeError:
            raise RuntimeError(f"{type(self).__name__}.__init__ must call super().__init__() "
                               "before using the module") from None

    @property
    def name(self) -> str:
        """The module's own name."""
        self._scope()
        return self._module_name

    @property
    def name_scope(self) -> scopes.name_scope:
        """A context manager that enters this module's (absolute) name scope."""
        return scopes.name_scope(self._scope())

    @classmethod
    def with_name_scope(cls, method: F) -> F:
        """Decorate a method so that it runs inside the module's name scope.

        Example:
            >>> import ckpt
            >>> class Lazy(ckpt.Module):
            ...     @ckpt.Module.with_name_scope
            ...     def build(self):
            ...         self.w = ckpt.Variable(0.0, name="w")
            >>> m = Lazy(); m.build(); m.w.name
            'lazy/w:0'
        """

        @functools.wraps(method)
        def wrapper(self: Module, *args: Any, **kwargs: Any) -> Any:
            with self.name_scope:
                return method(self, *args, **kwargs)

        return wrapper  # type: ignore[return-value]

    # --- discovery ------------------------------------------------------------------
    def _walk(self) -> Iterator[tuple[tuple[str, ...], Any]]:
        """Yield (path, leaf) for every Variable and Module below self, each object once."""
        self._scope()
        seen: set[int] = {id(self)}
        pending: list[tuple[tuple[str, ...], Module]] = [((), self)]
        while pending:
            prefix, module = pending.pop(0)
            found: list[tuple[tuple[str, ...], Module]] = []
            for name in sorted(vars(module)):
                if name in _OWN_ATTRIBUTES:
                    continue
                for path, leaf in _flatten(vars(module)[name], prefix + (name,), seen):
                    yield path, leaf
                    if isinstance(leaf, Module):
                        found.append((path, leaf))
            pending[0:0] = found  # a module's own leaves first, then its submodules depth-first

    def named_variables(self) -> list[tuple[str, Variable]]:
        """Return ``(path, variable)`` pairs; the path joins attribute names and indices with "/".

        These paths are the keys a ``Saver(module)`` writes ("layers/0/kernel").
        """
        return [("/".join(path), leaf) for path, leaf in self._walk() if isinstance(leaf, Variable)]

    @property
    def variables(self) -> list[Variable]:
        """Every variable of this module and its submodules."""
        return [v for _, v in self.named_variables()]

    @property
    def trainable_variables(self) -> list[Variable]:
        """The variables with ``trainable=True``."""
        return [v for v in self.variables if v.trainable]

    @property
    def non_trainable_variables(self) -> list[Variable]:
        """The variables with ``trainable=False``."""
        return [v for v in self.variables if not v.trainable]

    @property
    def submodules(self) -> list[Module]:
        """Every module below this one (not including itself)."""
        return [leaf for _, leaf in self._walk() if isinstance(leaf, Module)]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {getattr(self, '_module_name', '?')!r}>"


def _flatten(value: Any, prefix: tuple[str, ...], seen: set[int]) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Yield (path, leaf) for Variables and Modules inside nested dicts, lists and tuples."""
    if isinstance(value, (Variable, Module)):
        if id(value) not in seen:
            seen.add(id(value))
            yield prefix, value
        return
    if isinstance(value, dict):
        if id(value) in seen:
            return
        seen.add(id(value))
        try:
            keys = sorted(value)
        except TypeError:  # keys of mixed types: keep insertion order
            keys = list(value)
        for key in keys:
            yield from _flatten(value[key], prefix + (str(key),), seen)
    elif isinstance(value, (list, tuple)):
        if id(value) in seen:
            return
        seen.add(id(value))
        for i, item in enumerate(value):
            yield from _flatten(item, prefix + (str(i),), seen)
