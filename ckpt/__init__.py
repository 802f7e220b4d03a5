"""ckpt: checkpoints for numpy training code.

Variables with tf.Variable's semantics, Modules that find them, a Saver that writes HDF5 or
msgpack checkpoints, and readers for looking inside any checkpoint.

Example:
    >>> import ckpt
    >>> v = ckpt.Variable([1.0, 2.0], name="v")
    >>> v.assign_add([0.5, 0.5]).numpy()
    array([1.5, 2.5], dtype=float32)
"""

import importlib as _importlib
from typing import TYPE_CHECKING, Any

# errors are light (no numpy) and every caller needs them; the rest loads on first use, so that
# `ckpt --version` or `import ckpt.errors` does not pay for numpy, ml_dtypes and the formats
from .errors import CheckpointError as CheckpointError
from .errors import CheckpointNotFoundError as CheckpointNotFoundError
from .errors import CheckpointWriteError as CheckpointWriteError
from .errors import CorruptCheckpointError as CorruptCheckpointError
from .errors import InvalidMetadataError as InvalidMetadataError
from .errors import InvalidURLError as InvalidURLError
from .errors import KeyNotFoundError as KeyNotFoundError
from .errors import MismatchError as MismatchError
from .errors import ReplacedWriteError as ReplacedWriteError
from .errors import StateFileWarning as StateFileWarning
from .errors import StorageError as StorageError
from .errors import UninitializedVariableError as UninitializedVariableError
from .errors import UnsupportedCheckpointError as UnsupportedCheckpointError

__version__ = "0.1.0"

#: public name -> the module defining it (a module itself when the name is the module's)
_LAZY = {
    "dtypes": ".dtypes",
    "initializers": ".initializers",
    "random": ".random",
    "SaveFuture": ".async_save",
    "Format": ".formats.base",
    "WritableFormat": ".formats.base",
    "register_format": ".formats.base",
    "unregister_format": ".formats.base",
    "decline": ".formats.base",
    "Comparison": ".comparison",
    "MetadataChange": ".comparison",
    "TensorChange": ".comparison",
    "ValueDiff": ".comparison",
    "compare": ".comparison",
    "compare_values": ".comparison",
    "Conversion": ".conversion",
    "convert": ".conversion",
    "scope_renames": ".conversion",
    "writable_format": ".conversion",
    "load_file": ".files",
    "save_file": ".files",
    "inspect_lines": ".inspect",
    "inspect_report": ".inspect",
    "print_tensors_in_checkpoint_file": ".inspect",
    "ListedCheckpoint": ".listing",
    "list_checkpoints": ".listing",
    "ReadableBlob": ".storage",
    "Module": ".module",
    "CheckpointReader": ".reader",
    "list_variables": ".reader",
    "load_checkpoint": ".reader",
    "load_variable": ".reader",
    "RestoreResult": ".restore",
    "init_from_checkpoint": ".restore",
    "Saver": ".saver",
    "deferred_init": ".scopes",
    "device": ".scopes",
    "name_scope": ".scopes",
    "Shard": ".shard",
    "latest_checkpoint": "._locations",
    "TensorStats": ".stats",
    "array_stats": ".stats",
    "tensor_stats": ".stats",
    "Variable": ".variables",
    "global_variables": ".variables",
    "initialize_all_variables": ".variables",
    "initialize_variables": ".variables",
    "report_uninitialized_variables": ".variables",
    "trainable_variables": ".variables",
    "Verification": ".verification",
    "verify": ".verification",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt' has no attribute {name!r}")
    value: Any = _importlib.import_module(module, __name__)
    if module != f".{name}":  # a name defined in the module, not the module itself
        value = getattr(value, name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # the same names, for type checkers and readers
    from . import dtypes as dtypes
    from . import initializers as initializers
    from . import random as random
    from .async_save import SaveFuture as SaveFuture
    from .comparison import Comparison as Comparison
    from .comparison import MetadataChange as MetadataChange
    from .comparison import TensorChange as TensorChange
    from .comparison import ValueDiff as ValueDiff
    from .comparison import compare as compare
    from .comparison import compare_values as compare_values
    from .conversion import Conversion as Conversion
    from .conversion import convert as convert
    from .conversion import scope_renames as scope_renames
    from .conversion import writable_format as writable_format
    from .files import load_file as load_file
    from .formats.base import Format as Format
    from .formats.base import WritableFormat as WritableFormat
    from .formats.base import register_format as register_format
    from .formats.base import unregister_format as unregister_format
    from .formats.base import decline as decline
    from .files import save_file as save_file
    from .inspect import inspect_lines as inspect_lines
    from .inspect import inspect_report as inspect_report
    from .inspect import print_tensors_in_checkpoint_file as print_tensors_in_checkpoint_file
    from .listing import ListedCheckpoint as ListedCheckpoint
    from .listing import list_checkpoints as list_checkpoints
    from .storage import ReadableBlob as ReadableBlob
    from .module import Module as Module
    from .reader import CheckpointReader as CheckpointReader
    from .reader import list_variables as list_variables
    from .reader import load_checkpoint as load_checkpoint
    from .reader import load_variable as load_variable
    from .restore import RestoreResult as RestoreResult
    from .restore import init_from_checkpoint as init_from_checkpoint
    from .saver import Saver as Saver
    from .scopes import deferred_init as deferred_init
    from .scopes import device as device
    from .scopes import name_scope as name_scope
    from .shard import Shard as Shard
    from ._locations import latest_checkpoint as latest_checkpoint
    from .stats import TensorStats as TensorStats
    from .stats import array_stats as array_stats
    from .stats import tensor_stats as tensor_stats
    from .variables import Variable as Variable
    from .variables import global_variables as global_variables
    from .variables import initialize_all_variables as initialize_all_variables
    from .variables import initialize_variables as initialize_variables
    from .variables import report_uninitialized_variables as report_uninitialized_variables
    from .variables import trainable_variables as trainable_variables
    from .verification import Verification as Verification
    from .verification import verify as verify
