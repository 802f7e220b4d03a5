"""Checkpoint formats, installed as ``ckpt.formats``: one module per on-disk format.

Importing this package registers the built-in formats through
:func:`ckpt.formats.base.register_format`, the same function a plugin calls: ckpt's own
formats first, then the readers of other frameworks' files (docs/foreign.md). Each is
registered as a :class:`~ckpt.formats.base.LazyFormat`: its module is imported the first
time the format is needed (recognising a ckpt HDF5 file imports the HDF5 format only), and
format modules import h5py and msgpack only when a file is read or written.
"""

import os
from typing import Any

from . import h5plain
from .base import lazy_format, register_format


def _is_dir(path: str) -> bool:
    return os.path.isdir(path)


def _sharded_may_claim(path: str) -> bool:  # formats/sharded.py: a directory or an index file's name
    return os.path.isdir(path) or path.endswith((".index.json", ".weights.json"))


def _tensorflow_may_claim(path: str) -> bool:  # formats/tensorflow.py's prefix_of: an index, a data file, a prefix
    return path.endswith(".index") or ".data-" in path or not os.path.exists(path)


_PACKAGE = __name__
for _name, _extensions, _writable, _target, _may_claim in [
        ("hdf5", (".h5", ".hdf5"), True, "hdf5:Hdf5Format", None),
        ("msgpack", (".msgpack",), True, "msgpack:MsgpackFormat", None),
        ("ckpt-sharded", (), False, "ckpt_sharded:CkptShardedFormat", _is_dir),
        ("safetensors", (".safetensors",), True, "safetensors:SafetensorsFormat", None),
        ("pytorch", (".pt", ".pth", ".bin"), False, "torch:TorchFormat", None),
        ("keras", (".keras",), False, "keras:KerasFormat", None),
        ("flax", (".msgpack",), False, "flax:FlaxFormat", None),
        ("tensorflow", (".index",), False, "tensorflow:TensorFlowFormat", _tensorflow_may_claim),
        ("sharded", (".index.json", ".weights.json"), False, "sharded:ShardedFormat", _sharded_may_claim),
        ("orbax", (), False, "orbax:OrbaxFormat", _is_dir)]:
    register_format(lazy_format(_name, _extensions, _writable, f"{_PACKAGE}.{_target}", _may_claim))


def _adopt_keras(reader: Any) -> Any:
    """Keras's HDF5 files reach the reader through the hdf5 format (formats/keras.py's adopt)."""
    from .keras import adopt

    return adopt(reader)


h5plain.LAYOUTS.append(_adopt_keras)
