"""A restricted unpickler for the ``data.pkl`` of torch.save files.

This is not Python's pickle. The opcodes are parsed by ``pickletools.genops`` (which decodes
arguments and executes nothing) and interpreted here by a small stack machine that can
only build plain values: None, bool, int, float, str, bytes, tuple, list, dict, set — plus
tensor and storage *descriptions* (never torch objects). No module is imported and no
function named in the file is ever called. A GLOBAL resolves only to one of these names:

* ``collections.OrderedDict``: called with no arguments or a list of pairs -> a dict; a
  later BUILD with a dict state (torch's ``_metadata`` versions) is accepted and ignored;
* ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata])``,
  ``torch._utils._rebuild_tensor_v3(..., dtype[, metadata])`` and PyTorch 0.4's
  ``_rebuild_tensor(storage, offset, size, stride)`` -> a :class:`TensorRef`; the metadata may only
  mark a lazily conjugated or negated view (``{"conj": True}``, ``{"neg": True}``);
* ``torch._utils._rebuild_parameter(data, requires_grad, hooks)`` -> its tensor;
* ``torch.<Type>Storage`` / ``torch.storage.UntypedStorage`` and ``torch.<dtype>`` (float32, bfloat16,
  float8_e4m3fn, ...): markers naming an element type, never called;
* ``_codecs.encode(text, "latin1")``, how protocol 2 writes bytes -> bytes.

Any other global (``os.system``, ``builtins.eval``, a model class, numpy) is refused with an
UnsupportedCheckpointError naming it, before anything is called. Opcodes that build
arbitrary objects (NEWOBJ, INST, OBJ, EXT*, out-of-band buffers) are refused the same
way; REDUCE calls only the functions above, BUILD applies only to an OrderedDict. Dict keys
and set items must be strings, numbers, bytes or None (hashing anything deeper could crash).
Persistent ids (BINPERSID) must be torch's ``("storage", type, key, location, numel)`` (the
legacy format adds a sixth item, which must be None: storage views are refused).

Example:
    >>> data = b"\\x80\\x02}q\\x00(X\\x04\\x00\\x00\\x00stepq\\x01K\\x03u."  # {"step": 3}, protocol 2
    >>> load(data, "x.pt", lambda ref: ref)
    {'step': 3}
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any, Protocol, cast

import numpy as np

from ckpt.errors import CorruptCheckpointError, UnsupportedCheckpointError

from ._foreign import NUMPY_DTYPES


@dataclass(frozen=True)
class StorageRef:
    """A storage the pickle refers to: zip member ``data/<key>`` holding ``numel`` elements."""

    key: str
    dtype: np.dtype
    numel: int


@dataclass(frozen=True, eq=False)
class TensorRef:
    """A tensor as torch rebuilds it: a strided view (in elements) of a storage."""

    storage: StorageRef
    dtype: np.dtype
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    #: torch's lazy views: the values are the storage's conjugated / negated.
    conj: bool = False
    neg: bool = False


@dataclass(frozen=True)
class _ElementType:
    """What ``torch.FloatStorage`` or ``torch.float32`` stands for: just a dtype."""

    dtype: np.dtype


class _OrderedDict(dict):  # type: ignore[type-arg]
    """The dict an OrderedDict call builds; only it accepts BUILD (torch's ``_metadata``)."""


class _Marker:
    """A mark on the stack (the MARK opcode)."""


_STORAGES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64", "ComplexDoubleStorage": "complex128",
    "UntypedStorage": "uint8",
}
_TORCH_DTYPES = {"float": "float32", "double": "float64", "half": "float16", "long": "int64",
                 "int": "int32", "short": "int16", "cfloat": "complex64", "cdouble": "complex128",
                 **{name: name for name in NUMPY_DTYPES}}


_SCALARS = (str, int, float, bool, bytes, type(None))


class Unpickler:
    """Interprets one pickle; ``persistent_load(pid)`` turns storage ids into StorageRefs."""

    def __init__(self, data: bytes | PickleStream, path: str,
                 persistent_load: Callable[[StorageRef], StorageRef]) -> None:
        self._data, self._path, self._persistent_load = data, path, persistent_load
        self._globals: dict[tuple[str, str], Any] = {
            ("collections", "OrderedDict"): self._ordered_dict,
            ("torch._utils", "_rebuild_tensor_v2"): self._rebuild_tensor_v2,
            ("torch._utils", "_rebuild_tensor_v3"): self._rebuild_tensor_v3,
            ("torch._utils", "_rebuild_parameter"): self._rebuild_parameter,
            ("torch._utils", "_rebuild_tensor"): self._rebuild_tensor,
            ("_codecs", "encode"): self._encode,
        }
        for name, dtype in _STORAGES.items():
            self._globals[("torch", name)] = _ElementType(NUMPY_DTYPES[dtype])
        for name, dtype in _TORCH_DTYPES.items():
            self._globals[("torch", name)] = _ElementType(NUMPY_DTYPES[dtype])
        self._globals[("torch.storage", "UntypedStorage")] = self._globals[("torch", "UntypedStorage")]

    def load(self) -> Any:
        import pickletools  # parses opcodes only; imported on first use

        stack: list[Any] = []
        memo: dict[int, Any] = {}
        try:
            stream = io.BytesIO(self._data) if isinstance(self._data, bytes) else self._data
            with warnings.catch_warnings():  # a protocol-0 STRING's bad escape warns (an error under -W error)
                warnings.simplefilter("ignore", DeprecationWarning)
                # genops only calls read() (and tell() where there is one); typeshed asks for IO[bytes]
                return self._run(pickletools.genops(cast(IO[bytes], stream)), stack, memo)
        except (ValueError, TypeError, IndexError, KeyError, RecursionError, OverflowError) as exc:
            if isinstance(exc, (CorruptCheckpointError, UnsupportedCheckpointError)):
                raise
            raise CorruptCheckpointError(f"{self._path}: the pickle is malformed ({type(exc).__name__}: "
                                         f"{exc})") from exc

    def _run(self, ops: Any, stack: list[Any], memo: dict[int, Any]) -> Any:
        for opcode, arg, pos in ops:  # genops stops right after STOP
            if opcode.name == "STOP":
                if len(stack) != 1:
                    raise CorruptCheckpointError(f"{self._path}: the pickle ends with {len(stack)} values on "
                                                 "its stack")
                return stack[0]
            handler = getattr(self, "_op_" + opcode.name, None)
            if handler is None:
                raise UnsupportedCheckpointError(
                    f"{self._path}: the pickle uses opcode {opcode.name} (at byte {pos}), which ckpt does not "
                    "allow (it builds tensors, dicts, lists and plain values only)")
            handler(stack, memo, arg)
        raise CorruptCheckpointError(f"{self._path}: the pickle has no STOP opcode: it is truncated")

    # --- opcodes --------------------------------------------------------------------------
    # Each takes (stack, memo, arg). Values are pushed as they are; containers are the builtins.

    def _op_PROTO(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        if arg > 5:
            raise UnsupportedCheckpointError(f"{self._path}: pickle protocol {arg} is newer than 5")

    def _op_FRAME(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        pass

    def _push_arg(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        stack.append(arg)

    _op_INT = _op_BININT = _op_BININT1 = _op_BININT2 = _op_LONG = _op_LONG1 = _op_LONG4 = _push_arg
    _op_FLOAT = _op_BINFLOAT = _push_arg
    _op_STRING = _op_BINSTRING = _op_SHORT_BINSTRING = _push_arg
    _op_UNICODE = _op_BINUNICODE = _op_SHORT_BINUNICODE = _op_BINUNICODE8 = _push_arg
    _op_BINBYTES = _op_SHORT_BINBYTES = _op_BINBYTES8 = _push_arg

    def _op_BYTEARRAY8(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        stack.append(bytes(arg))

    def _op_NONE(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        stack.append(None)

    def _op_NEWTRUE(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        stack.append(True)

    def _op_NEWFALSE(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        stack.append(False)

    def _op_MARK(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        stack.append(_Marker())

    def _pop_mark(self, stack: list[Any]) -> list[Any]:
        for i in range(len(stack) - 1, -1, -1):
            if isinstance(stack[i], _Marker):
                items = stack[i + 1:]
                del stack[i:]
                return items
        raise CorruptCheckpointError(f"{self._path}: the pickle pops a MARK it never pushed")

    def _pop(self, stack: list[Any]) -> Any:
        if not stack or isinstance(stack[-1], _Marker):
            raise CorruptCheckpointError(f"{self._path}: the pickle pops a value from an empty stack")
        return stack.pop()

    def _top(self, stack: list[Any]) -> Any:
        if not stack or isinstance(stack[-1], _Marker):
            raise CorruptCheckpointError(f"{self._path}: the pickle uses a value from an empty stack")
        return stack[-1]

    def _op_POP(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        if stack and isinstance(stack[-1], _Marker):
            stack.pop()
        else:
            self._pop(stack)

    def _op_POP_MARK(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        self._pop_mark(stack)

    def _op_DUP(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        stack.append(self._top(stack))

    def _op_EMPTY_LIST(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        stack.append([])

    def _op_EMPTY_DICT(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        stack.append({})

    def _op_EMPTY_TUPLE(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        stack.append(())

    def _op_EMPTY_SET(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        stack.append(set())

    def _op_LIST(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        stack.append(self._pop_mark(stack))

    def _op_TUPLE(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        stack.append(tuple(self._pop_mark(stack)))

    def _op_FROZENSET(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        stack.append(frozenset(self._hashable(self._pop_mark(stack))))

    def _hashable(self, items: list[Any]) -> list[Any]:
        """Dict keys and set items must be plain scalars: hashing a deeply nested tuple would
        overflow the C stack (CPython's tuple hash has no recursion guard)."""
        for item in items:
            if type(item) not in _SCALARS:
                raise UnsupportedCheckpointError(f"{self._path}: the pickle uses a {type(item).__name__} as a "
                                                 "dict key or set item; ckpt allows strings, numbers and None")
        return items

    def _tuple_n(self, n: int, stack: list[Any]) -> None:
        items = [self._pop(stack) for _ in range(n)][::-1]
        stack.append(tuple(items))

    def _op_TUPLE1(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        self._tuple_n(1, stack)

    def _op_TUPLE2(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        self._tuple_n(2, stack)

    def _op_TUPLE3(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        self._tuple_n(3, stack)

    def _op_DICT(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        items = self._pop_mark(stack)
        stack.append(self._set_items({}, items))

    def _set_items(self, target: Any, items: list[Any]) -> Any:
        if type(target) not in (dict, _OrderedDict):
            raise CorruptCheckpointError(f"{self._path}: the pickle sets items on a {type(target).__name__}")
        if len(items) % 2:
            raise CorruptCheckpointError(f"{self._path}: the pickle sets an odd number of dict items")
        for i in range(0, len(items), 2):
            target[self._hashable([items[i]])[0]] = items[i + 1]
        return target

    def _op_SETITEM(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        value, key = self._pop(stack), self._pop(stack)
        self._set_items(self._top(stack), [key, value])

    def _op_SETITEMS(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        items = self._pop_mark(stack)
        self._set_items(self._top(stack), items)

    def _append(self, target: Any, items: list[Any]) -> None:
        if type(target) is not list:
            raise CorruptCheckpointError(f"{self._path}: the pickle appends to a {type(target).__name__}")
        target.extend(items)

    def _op_APPEND(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        value = self._pop(stack)
        self._append(self._top(stack), [value])

    def _op_APPENDS(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        items = self._pop_mark(stack)
        self._append(self._top(stack), items)

    def _op_ADDITEMS(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        items = self._pop_mark(stack)
        target = self._top(stack)
        if type(target) is not set:
            raise CorruptCheckpointError(f"{self._path}: the pickle adds items to a {type(target).__name__}")
        target.update(self._hashable(items))

    def _op_PUT(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        memo[arg] = self._top(stack)

    _op_BINPUT = _op_LONG_BINPUT = _op_PUT

    def _op_MEMOIZE(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        memo[len(memo)] = self._top(stack)

    def _op_GET(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        if arg not in memo:
            raise CorruptCheckpointError(f"{self._path}: the pickle reads memo entry {arg}, never stored")
        stack.append(memo[arg])

    _op_BINGET = _op_LONG_BINGET = _op_GET

    def _op_GLOBAL(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        module, _, name = arg.partition(" ")
        stack.append(self._find(module, name))

    def _op_STACK_GLOBAL(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        name, module = self._pop(stack), self._pop(stack)
        if type(name) is not str or type(module) is not str:
            raise CorruptCheckpointError(f"{self._path}: STACK_GLOBAL needs two strings")
        stack.append(self._find(module, name))

    def _find(self, module: str, name: str) -> Any:
        found = self._globals.get((module, name))
        if found is None:
            raise UnsupportedCheckpointError(
                f"{self._path}: the pickle refers to the global {module}.{name}, which ckpt refuses to "
                "load (it builds only tensors, OrderedDicts and plain values; nothing was executed). "
                "Save a state_dict, or convert the file with its framework")
        return found

    def _op_REDUCE(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        args, func = self._pop(stack), self._pop(stack)
        if not callable(func) or func not in self._globals.values() or type(args) is not tuple:
            raise UnsupportedCheckpointError(f"{self._path}: the pickle calls a {type(func).__name__}, which is "
                                             "not one of the functions ckpt allows")
        stack.append(func(*args))

    def _op_BUILD(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        state = self._pop(stack)
        target = self._top(stack)
        if type(target) is not _OrderedDict or not isinstance(state, dict):
            raise UnsupportedCheckpointError(f"{self._path}: the pickle sets the state of a "
                                             f"{type(target).__name__}; ckpt allows that for OrderedDicts only")

    def _op_BINPERSID(self, stack: list[Any], memo: dict[int, Any], arg: Any) -> None:
        pid = self._pop(stack)
        if type(pid) is tuple and len(pid) == 6 and pid[5] is None:  # the legacy format's, no view
            pid = pid[:5]
        if type(pid) is not tuple or len(pid) != 5 or pid[0] not in ("storage", b"storage") or \
                not isinstance(pid[1], _ElementType) or type(pid[2]) is not str or \
                type(pid[4]) is not int or pid[4] < 0:
            raise UnsupportedCheckpointError(f"{self._path}: the pickle refers to an external object "
                                             f"{shown(pid)}; ckpt reads torch's storages only")
        if pid[4] >= 2 ** 63:  # no storage holds that many (and str() of such an int can fail)
            raise CorruptCheckpointError(f"{self._path}: storage {pid[2]!r} declares {shown(pid[4])} elements, "
                                         "more than any storage holds")
        stack.append(self._persistent_load(StorageRef(pid[2], pid[1].dtype, pid[4])))

    # --- the allowed functions -----------------------------------------------------------

    def _ordered_dict(self, *args: Any) -> _OrderedDict:
        if len(args) > 1:
            raise CorruptCheckpointError(f"{self._path}: OrderedDict called with {len(args)} arguments")
        out = _OrderedDict()
        for pair in args[0] if args else ():
            if type(pair) not in (tuple, list) or len(pair) != 2:
                raise CorruptCheckpointError(f"{self._path}: OrderedDict called with a non-pair")
            self._set_items(out, list(pair))
        return out

    def _rebuild_tensor_v2(self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
                           hooks: Any, metadata: Any = None) -> TensorRef:
        if not isinstance(storage, StorageRef):
            raise CorruptCheckpointError(f"{self._path}: a tensor is rebuilt from {shown(storage)}, not a storage")
        return self._tensor(storage, storage.dtype, offset, size, stride, metadata)

    def _rebuild_tensor(self, storage: Any, offset: Any, size: Any, stride: Any) -> TensorRef:
        """PyTorch 0.4's rebuild function, still in files of the legacy format."""
        return self._rebuild_tensor_v2(storage, offset, size, stride, False, None)

    def _rebuild_tensor_v3(self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
                           hooks: Any, dtype: Any, metadata: Any = None) -> TensorRef:
        if not isinstance(storage, StorageRef) or not isinstance(dtype, _ElementType):
            raise CorruptCheckpointError(f"{self._path}: a tensor is rebuilt from {shown(storage)} as {shown(dtype)}")
        return self._tensor(storage, dtype.dtype, offset, size, stride, metadata)

    def _tensor(self, storage: StorageRef, dtype: np.dtype, offset: Any, size: Any, stride: Any,
                metadata: Any) -> TensorRef:
        def ints(x: Any) -> bool:
            return type(x) in (tuple, list) and len(x) <= 64 and all(type(d) is int and d >= 0 for d in x)

        flags = {"conj": False, "neg": False}
        if metadata:  # torch's lazy views: values conjugated or negated relative to the storage
            if type(metadata) not in (dict, _OrderedDict) or not set(metadata) <= set(flags) or \
                    not all(type(v) is bool for v in metadata.values()):
                raise UnsupportedCheckpointError(f"{self._path}: a tensor carries metadata {shown(metadata)}; ckpt "
                                                 "reads plain tensors and conjugated or negated views only")
            flags.update(metadata)
            if flags["conj"] and dtype.kind != "c":
                raise CorruptCheckpointError(f"{self._path}: a {dtype} tensor is marked as a conjugate view")
        if type(offset) is not int or offset < 0 or not ints(size) or not ints(stride) or \
                len(size) != len(stride):
            raise CorruptCheckpointError(f"{self._path}: a tensor has an invalid offset, size or stride "
                                         f"({shown(offset)}, {shown(size)}, {shown(stride)})")
        return TensorRef(storage, dtype, offset, tuple(size), tuple(stride), flags["conj"], flags["neg"])

    def _rebuild_parameter(self, data: Any, requires_grad: Any, hooks: Any) -> Any:
        if not isinstance(data, TensorRef):
            raise CorruptCheckpointError(f"{self._path}: a parameter wraps {shown(data)}, not a tensor")
        return data

    def _encode(self, text: Any, encoding: Any = "utf-8") -> bytes:
        if type(text) is not str or encoding not in ("latin1", "latin-1"):
            raise UnsupportedCheckpointError(f"{self._path}: _codecs.encode is allowed only as protocol 2 "
                                             "uses it for bytes (text, 'latin1')")
        return text.encode("latin-1")


class PickleStream(Protocol):
    """What the machine reads a pickle from: a binary file, or anything with these two methods."""

    def read(self, n: int = -1, /) -> bytes: ...

    def readline(self) -> bytes: ...


def load(data: bytes | PickleStream, path: str, persistent_load: Callable[[StorageRef], StorageRef]) -> Any:
    """Interpret a pickle with the restricted machine (see the module docstring).

    ``data`` is the pickle's bytes, or a binary file positioned at its start: then the file is left
    just after its STOP opcode (the legacy torch.save format is several pickles in a row).
    """
    return Unpickler(data, path, persistent_load).load()


def shown(value: Any) -> str:
    """repr() for error messages about hostile values: an int past 4,300 digits makes repr() raise."""
    if type(value) is int and value.bit_length() >= 4096:
        return f"<int of {value.bit_length()} bits>"
    try:
        return repr(value)
    except ValueError:  # such an int inside a container
        return f"<a {type(value).__name__} holding an integer too long to print>"
