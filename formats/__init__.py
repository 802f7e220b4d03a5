"""Checkpoint formats, installed as ``ckpt.formats``: one module per on-disk format.

Importing this package registers the built-in formats (``formats/builtin.py``: one Format
class each) through :func:`ckpt.formats.base.register_format`, the same function a plugin
calls: ckpt's own formats first, then the readers of other frameworks' files
(docs/foreign.md). A format's module is imported the first time one of its files is opened
or written, and format modules import h5py and msgpack only when a file is read or written.
"""

from .base import register_format
from .builtin import FORMATS, KerasFormat

for _fmt in FORMATS:
    register_format(_fmt)
# Keras's weights files are HDF5 files (or zips): the keras format is asked before hdf5 and declines an
# HDF5 file without Keras's layout (base.decline), so hdf5 reads it through the reader keras opened.
register_format(KerasFormat(), before="hdf5")
