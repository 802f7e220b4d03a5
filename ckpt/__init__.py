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

from ._sourcetree import install_if_source_tree as _install_if_source_tree

# errors are light (no numpy) and every caller needs them; the rest loads on first use, so that
# `ckpt --version` or `import ckpt.errors` does not pay for numpy, ml_dtypes and the formats
from .errors import CheckpointError as CheckpointError
from .errors import CheckpointNotFoundError as CheckpointNotFoundError
from .errors import CheckpointWriteError as CheckpointWriteError
from .errors import CorruptCheckpointError as CorruptCheckpointError
from .errors import InvalidMetadataError as InvalidMetadataError
from .errors import InvalidMetricsError as InvalidMetricsError
from .errors import InvalidURLError as InvalidURLError
from .errors import KeyNotFoundError as KeyNotFoundError
from .errors import MismatchError as MismatchError
from .errors import ReplacedWriteError as ReplacedWriteError
from .errors import StateFileWarning as StateFileWarning
from .errors import StorageError as StorageError
from .errors import UninitializedVariableError as UninitializedVariableError
from .errors import UnsupportedCheckpointError as UnsupportedCheckpointError

# registered now, before any handler of the user's: an atexit save that loads h5py late exits cleanly
from . import hdf5exit as _hdf5exit  # noqa: F401

# Python started in a clone's root imports this folder, not the installed package: formats/ and cli/
# beside it then serve as ckpt.formats and ckpt.cli (ckpt/_sourcetree.py)
_install_if_source_tree(__path__[0])

__version__ = "0.1.0"

#: public name -> the module defining it (a module itself when the name is the module's)
_LAZY = {
    "dtypes": ".dtypes",
    "initializers": ".runtime.initializers",
    "random": ".runtime.random",
    "SaveFuture": ".saving.async_save",
    "Format": ".formats.base",
    "WritableFormat": ".formats.base",
    "register_format": ".formats.base",
    "unregister_format": ".formats.base",
    "decline": ".formats.base",
    "Comparison": ".tools.comparison",
    "MetadataChange": ".tools.comparison",
    "TensorChange": ".tools.comparison",
    "ValueDiff": ".tools.comparison",
    "compare": ".tools.comparison",
    "compare_values": ".tools.comparison",
    "Conversion": ".tools.conversion",
    "convert": ".tools.conversion",
    "average_checkpoints": ".tools.averaging",
    "scope_renames": ".tools.conversion",
    "writable_format": ".tools.conversion",
    "load_file": ".saving.files",
    "save_file": ".saving.files",
    "inspect_lines": ".tools.inspect",
    "inspect_report": ".tools.inspect",
    "print_tensors_in_checkpoint_file": ".tools.inspect",
    "ListedCheckpoint": ".tools.listing",
    "list_checkpoints": ".tools.listing",
    "ReadableBlob": ".storage",
    "Module": ".runtime.module",
    "ExponentialMovingAverage": ".runtime.moving_average",
    "CheckpointReader": ".saving.reader",
    "list_variables": ".saving.reader",
    "load_checkpoint": ".saving.reader",
    "load_variable": ".saving.reader",
    "RestoreResult": ".saving.restore",
    "init_from_checkpoint": ".saving.restore",
    "Saver": ".saving.saver",
    "PreemptionGuard": ".saving.preemption",
    "deferred_init": ".runtime.scopes",
    "device": ".runtime.scopes",
    "name_scope": ".runtime.scopes",
    "Shard": ".runtime.shard",
    "latest_checkpoint": ".saving.locations",
    "best_checkpoint": ".saving.locations",
    "all_steps": ".saving.locations",
    "latest_step": ".saving.locations",
    "checkpoints_iterator": ".saving.locations",
    "TensorStats": ".tools.stats",
    "array_stats": ".tools.stats",
    "tensor_stats": ".tools.stats",
    "Variable": ".runtime.variables",
    "global_variables": ".runtime.variables",
    "initialize_all_variables": ".runtime.variables",
    "initialize_variables": ".runtime.variables",
    "report_uninitialized_variables": ".runtime.variables",
    "trainable_variables": ".runtime.variables",
    "Verification": ".tools.verification",
    "verify": ".tools.verification",
    "verify_directory": ".tools.verification",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt' has no attribute {name!r}")
    value: Any = _importlib.import_module(module, __name__)
    if not module.endswith(f".{name}"):  # a name defined in the module, not the module itself
        value = getattr(value, name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # the same names, for type checkers and readers
    from . import dtypes as dtypes
    from .runtime import initializers as initializers
    from .runtime import random as random
    from .saving.async_save import SaveFuture as SaveFuture
    from .tools.comparison import Comparison as Comparison
    from .tools.comparison import MetadataChange as MetadataChange
    from .tools.comparison import TensorChange as TensorChange
    from .tools.comparison import ValueDiff as ValueDiff
    from .tools.comparison import compare as compare
    from .tools.comparison import compare_values as compare_values
    from .tools.conversion import Conversion as Conversion
    from .tools.conversion import convert as convert
    from .tools.averaging import average_checkpoints as average_checkpoints
    from .tools.conversion import scope_renames as scope_renames
    from .tools.conversion import writable_format as writable_format
    from .saving.files import load_file as load_file
    from .formats.base import Format as Format
    from .formats.base import WritableFormat as WritableFormat
    from .formats.base import register_format as register_format
    from .formats.base import unregister_format as unregister_format
    from .formats.base import decline as decline
    from .saving.files import save_file as save_file
    from .tools.inspect import inspect_lines as inspect_lines
    from .tools.inspect import inspect_report as inspect_report
    from .tools.inspect import print_tensors_in_checkpoint_file as print_tensors_in_checkpoint_file
    from .tools.listing import ListedCheckpoint as ListedCheckpoint
    from .tools.listing import list_checkpoints as list_checkpoints
    from .storage import ReadableBlob as ReadableBlob
    from .runtime.module import Module as Module
    from .runtime.moving_average import ExponentialMovingAverage as ExponentialMovingAverage
    from .saving.reader import CheckpointReader as CheckpointReader
    from .saving.reader import list_variables as list_variables
    from .saving.reader import load_checkpoint as load_checkpoint
    from .saving.reader import load_variable as load_variable
    from .saving.restore import RestoreResult as RestoreResult
    from .saving.restore import init_from_checkpoint as init_from_checkpoint
    from .saving.saver import Saver as Saver
    from .saving.preemption import PreemptionGuard as PreemptionGuard
    from .runtime.scopes import deferred_init as deferred_init
    from .runtime.scopes import device as device
    from .runtime.scopes import name_scope as name_scope
    from .runtime.shard import Shard as Shard
    from .saving.locations import latest_checkpoint as latest_checkpoint
    from .saving.locations import best_checkpoint as best_checkpoint
    from .saving.locations import all_steps as all_steps
    from .saving.locations import latest_step as latest_step
    from .saving.locations import checkpoints_iterator as checkpoints_iterator
    from .tools.stats import TensorStats as TensorStats
    from .tools.stats import array_stats as array_stats
    from .tools.stats import tensor_stats as tensor_stats
    from .runtime.variables import Variable as Variable
    from .runtime.variables import global_variables as global_variables
    from .runtime.variables import initialize_all_variables as initialize_all_variables
    from .runtime.variables import initialize_variables as initialize_variables
    from .runtime.variables import report_uninitialized_variables as report_uninitialized_variables
    from .runtime.variables import trainable_variables as trainable_variables
    from .tools.verification import Verification as Verification
    from .tools.verification import verify as verify
    from .tools.verification import verify_directory as verify_directory
