"""save_file / load_file: plain ``{name: numpy array}`` dicts in and out, as safetensors does.

No Variables, no Saver and no state file: one file, written atomically with a checksum per
tensor like every ckpt save, in the format of its extension; read back from any format ckpt
reads.

Example:
    >>> import ckpt, numpy as np, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "weights", "model.msgpack")
    >>> _ = ckpt.save_file({"w": np.eye(2, dtype=np.float32), "step": np.int64(7)}, path)
    >>> loaded = ckpt.load_file(path)
    >>> sorted(loaded), loaded["step"]
    (['step', 'w'], array(7))
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ckpt.storage.atomic import replace_atomically
from ckpt.storage.localfile import LocalSink
from ckpt import dtypes
from ckpt.runtime.casting import as_array
from ckpt.formats import base  # the format registry; importing it registers the built-ins
from ckpt.saving.reader import open_checkpoint, read_in_batches
from ckpt.saving.locations import save_target

__all__ = ["save_file", "load_file"]



def save_file(tensors: Mapping[str, Any], path: str | os.PathLike[str],
              metadata: Mapping[str, Any] | None = None, compression: str | None = None) -> str:
    """Write ``{key: array}`` to one checkpoint file, atomically and checksummed.

    Args:
        tensors: keys ("/"-separated) to numpy arrays (or values numpy can make arrays of, with
            numpy's types as safetensors users expect: Python floats become float64 and ints
            int64; only ``ckpt.Variable`` keeps TensorFlow's float32/int32 defaults).
        path: the file; its extension picks the format (.h5/.hdf5, .msgpack, .safetensors).
            Missing directories are created.
        metadata: a JSON-like dict stored with the tensors.
        compression: "zstd" stores numeric tensors as losslessly compressed byte planes
            (.msgpack only; docs/formats.md). Reading them needs nothing beyond ckpt.

    Returns:
        The path written.

    Raises:
        UnsupportedCheckpointError: a directory, or an extension no format writes (a ValueError).
        ValueError: an invalid key.
        InvalidMetadataError: metadata that is not JSON-like (a ValueError too).
        TypeError: a value of a dtype no checkpoint holds.
        CheckpointWriteError: the file could not be written; a previous file is untouched.
        UnsupportedCheckpointError: a compression the file's format does not offer (.h5 offers none).
    """
    path, fmt = save_target(path)
    if not isinstance(fmt, base.WritableFormat):  # save_target returns writable formats only
        raise TypeError(f"{path}: format {fmt.name} cannot write")
    base.check_compression(fmt, compression, path)
    if not isinstance(tensors, Mapping):
        raise TypeError(f"{path}: tensors must be a dict of key -> array, got {type(tensors).__name__}")
    base.validate_keys(tensors, path)
    arrays = []
    for key, value in tensors.items():
        try:
            arrays.append((key, _numpy_array(value)))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{path}: tensor {key!r}: {exc}") from None
    normalized = base.normalize_metadata(metadata, path)
    with replace_atomically(path) as tmp, LocalSink(tmp) as blob:
        # (not ``write``: the keys and metadata are checked above)
        base.write_with(fmt, blob, arrays, normalized, compression)
    return path


def _numpy_array(value: Any) -> np.ndarray:
    """``value`` as numpy types it (0.1 stays exactly float64's 0.1; 1e300 is no float32 inf)."""
    arr, _ = as_array(value)
    dtypes.as_dtype(arr.dtype)  # a TypeError for dtypes no checkpoint holds (datetime, structured...)
    return arr


def load_file(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Read every tensor of a checkpoint (any format ckpt reads) into new numpy arrays.

    Args:
        path: a checkpoint file, or a directory (its latest checkpoint).

    Returns:
        ``{key: array}`` in the file's order; every checksum is verified.

    Raises:
        CheckpointNotFoundError, UnsupportedCheckpointError, CorruptCheckpointError.
    """
    with open_checkpoint(path) as reader:
        out = {key: np.empty(info.shape, dtype=info.dtype) for key, info in reader.tensors.items()}
        read_in_batches(reader, out.items())
        return out
