"""Checkpoint formats, installed as ``ckpt.formats``: one module per on-disk format.

Importing this package registers the built-in formats through
:func:`ckpt.formats.base.register_format`, the same function a plugin calls: ckpt's own
formats first, then the readers of other frameworks' files (docs/foreign.md). Format
modules import h5py and msgpack only when a file is read or written.
"""

from . import h5plain
from .base import register_format
from .flax import FlaxFormat
from .hdf5 import Hdf5Format
from .keras import KerasFormat
from .keras import adopt as adopt_keras
from .msgpack import MsgpackFormat
from .orbax import OrbaxFormat
from .safetensors import SafetensorsFormat
from .ckpt_sharded import CkptShardedFormat
from .sharded import ShardedFormat
from .tensorflow import TensorFlowFormat
from .torch import TorchFormat

register_format(Hdf5Format())
register_format(MsgpackFormat())
register_format(CkptShardedFormat())
register_format(SafetensorsFormat())
register_format(TorchFormat())
register_format(KerasFormat())
register_format(FlaxFormat())
register_format(TensorFlowFormat())
register_format(ShardedFormat())
register_format(OrbaxFormat())
h5plain.LAYOUTS.append(adopt_keras)  # Keras's HDF5 files reach the reader through the hdf5 format
