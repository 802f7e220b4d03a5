"""Checkpoint formats, installed as ``ckpt.formats``: one module per on-disk format.

Importing this package registers the built-in formats through
:func:`ckpt.formats.base.register_format`, the same function a plugin calls: ckpt's own
formats first, then the readers of other frameworks' files (docs/foreign.md). Each is
registered as a :class:`~ckpt.formats.base.LazyFormat`: its module is imported the first
time the format is needed (recognising a ckpt HDF5 file imports the HDF5 format only), and
format modules import h5py and msgpack only when a file is read or written.
"""

import os

from . import _h5head
from ._zip import ZIP_MAGIC
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
        ("flax", (".msgpack",), False, "flax:FlaxFormat", None),
        ("tensorflow", (".index",), False, "tensorflow:TensorFlowFormat", _tensorflow_may_claim),
        ("sharded", (".index.json", ".weights.json"), False, "sharded:ShardedFormat", _sharded_may_claim),
        ("orbax", (), False, "orbax:OrbaxFormat", _is_dir)]:
    register_format(lazy_format(_name, _extensions, _writable, f"{_PACKAGE}.{_target}", _may_claim))

# Keras's weights files are HDF5 files (or zips): the keras format is asked before hdf5 and declines an
# HDF5 file without Keras's layout (base.decline), so hdf5 reads it; it loads only for a foreign HDF5
# file or a zip (may_sniff), never for ckpt's own files.
register_format(lazy_format("keras", (".keras",), False, f"{_PACKAGE}.keras:KerasFormat", None,
                            lambda head: head.startswith(ZIP_MAGIC) or _h5head.foreign_hdf5(head)), before="hdf5")
