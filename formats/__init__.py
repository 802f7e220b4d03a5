"""Checkpoint formats, installed as ``ckpt.formats``: one module per on-disk format.

Importing this package registers the built-in formats through
:func:`ckpt.formats.base.register_format`, the same function a plugin calls.
Format modules import h5py and msgpack only when a file is read or written.
"""

from .base import register_format
from .hdf5 import Hdf5Format
from .msgpack import MsgpackFormat

register_format(Hdf5Format())
register_format(MsgpackFormat())
