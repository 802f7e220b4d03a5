"""Name scopes, device scopes and deferred initialization: the context a Variable is born in.

State lives in context variables, so each thread (and asyncio task) has its own scopes.

Example:
    >>> import ckpt
    >>> with ckpt.name_scope("layer1"):
    ...     with ckpt.name_scope("dense") as scope:
    ...         print(scope)
    layer1/dense/
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

__all__ = ["name_scope", "device", "deferred_init", "current_name_scope", "current_device",
           "DeviceSpec", "LOCAL_CPU"]

_name_scope: contextvars.ContextVar[str] = contextvars.ContextVar("ckpt_name_scope", default="")
_device: contextvars.ContextVar[DeviceSpec | None] = contextvars.ContextVar("ckpt_device", default=None)
_deferred: contextvars.ContextVar[bool] = contextvars.ContextVar("ckpt_deferred", default=False)


def validate_name(name: str, what: str) -> None:
    """Raise ValueError for a name that cannot become part of a checkpoint key."""
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a string, got {type(name).__name__}")
    parts = name.rstrip("/").split("/")
    if ":" in name or "\x00" in name or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid {what} {name!r}: use '/'-separated parts without ':', NUL, "
                         "empty, '.' or '..' parts")


class name_scope:
    """Prefix the names of variables created inside the block with ``name + "/"``.

    Scopes nest: ``name_scope("a")`` inside ``name_scope("b")`` gives "b/a/". A name that
    ends with "/" is absolute and replaces the current scope; "" returns to the root.
    Entering yields the full scope string.

    Example:
        >>> import ckpt
        >>> with ckpt.name_scope("layer1"):
        ...     v = ckpt.Variable(1.0, name="w")
        >>> v.name
        'layer1/w:0'
    """

    def __init__(self, name: str) -> None:
        if name:
            validate_name(name, "name scope")
        self._name = name
        self._tokens: list[contextvars.Token[str]] = []

    def __enter__(self) -> str:
        if not self._name:
            scope = ""
        elif self._name.endswith("/"):
            scope = self._name
        else:
            scope = _name_scope.get() + self._name + "/"
        self._tokens.append(_name_scope.set(scope))
        return scope

    def __exit__(self, *exc: object) -> None:
        _name_scope.reset(self._tokens.pop())


def current_name_scope() -> str:
    """Return the active name scope ("" at the root, else ending with "/")."""
    return _name_scope.get()


class DeviceSpec(NamedTuple):
    """A parsed device string; None fields are unspecified and inherit from outer scopes."""

    job: str | None = None
    replica: int | None = None
    task: int | None = None
    device_type: str | None = None
    device_index: int | None = None

    @classmethod
    def parse(cls, spec: str) -> DeviceSpec:
        """Parse "CPU:0", "GPU:1", "/device:GPU:0", "/gpu:0" or "/job:ps/task:7/device:CPU:0"."""
        fields: dict[str, object] = {}
        for part in filter(None, spec.strip().split("/")):
            pieces = part.split(":")
            if pieces[0].lower() == "device" and len(pieces) > 1:
                pieces = pieces[1:]
            key, value = pieces[0].lower(), ":".join(pieces[1:])
            if key in _DEVICE_TYPES and len(pieces) <= 2 and (value in ("", "*") or value.isdigit()):
                fields["device_type"] = key.upper()
                fields["device_index"] = int(value) if value.isdigit() else None
            elif key == "job" and len(pieces) == 2 and value:
                fields["job"] = value
            elif key in ("replica", "task") and value.isdigit():
                fields[key] = int(value)
            else:
                raise ValueError(f"invalid device string {spec!r}: cannot parse {part!r}")
        return cls(**fields)  # type: ignore[arg-type]

    def merged_into(self, outer: DeviceSpec | None) -> DeviceSpec:
        """Fields set here win; unset ones come from the enclosing scope."""
        if outer is None:
            return self
        return DeviceSpec._make(mine if mine is not None else theirs for mine, theirs in zip(self, outer))

    def to_string(self) -> str:
        """The canonical form, e.g. "/job:ps/task:7/device:CPU:0"."""
        out = []
        if self.job is not None:
            out.append(f"/job:{self.job}")
        if self.replica is not None:
            out.append(f"/replica:{self.replica}")
        if self.task is not None:
            out.append(f"/task:{self.task}")
        if self.device_type is not None:
            index = "*" if self.device_index is None else self.device_index
            out.append(f"/device:{self.device_type}:{index}")
        return "".join(out)


_DEVICE_TYPES = ("cpu", "gpu", "tpu")
#: Where every variable really lives: numpy arrays are in this process's memory.
LOCAL_CPU = "/job:localhost/replica:0/task:0/device:CPU:0"


@contextmanager
def device(spec: str | None) -> Iterator[None]:
    """Request a device for variables created in the block (soft placement).

    The request is recorded (``v.requested_device``); variables are numpy arrays in this
    process, so ``v.device`` always reports the local CPU. Inner scopes override the
    fields they name; ``device(None)`` clears the request.

    Example:
        >>> import ckpt
        >>> with ckpt.device("GPU:0"):
        ...     v = ckpt.Variable(1.0)
        >>> v.requested_device, v.device
        ('/device:GPU:0', '/job:localhost/replica:0/task:0/device:CPU:0')
    """
    new = None if not spec else DeviceSpec.parse(spec).merged_into(_device.get())
    token = _device.set(new)
    try:
        yield
    finally:
        _device.reset(token)


def current_device() -> str:
    """Return the requested device of the active scope ("" when none)."""
    spec = _device.get()
    return "" if spec is None else spec.to_string()


@contextmanager
def deferred_init() -> Iterator[None]:
    """Create variables from initializers without computing their values.

    A variable built from a callable initializer and a ``shape`` inside this block
    allocates nothing; reading it raises UninitializedVariableError until
    ``initialize()`` runs or a restore fills it. Use it for a large model that is about to
    be restored, so it never pays for random initialization.

    Example:
        >>> import ckpt
        >>> with ckpt.deferred_init():
        ...     v = ckpt.Variable(ckpt.initializers.GlorotUniform(), shape=(4, 4))
        >>> v.is_initialized()
        False
    """
    token = _deferred.set(True)
    try:
        yield
    finally:
        _deferred.reset(token)


def is_deferred() -> bool:
    """True inside ``deferred_init()``."""
    return _deferred.get()
