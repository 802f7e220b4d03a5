"""The built-in formats, one :class:`~ckpt.formats.base.Format` class each: its name, extensions,
recognition (``claims``, ``sniff``) and the entry points of its module (``open``, ``write_blob``).

The classes live here, apart from their readers and writers, so that recognising a file
costs no format module: a format's module is imported when one of its files is opened or
written (reading a ckpt HDF5 file imports ``ckpt.formats.hdf5`` only; ``tests/project/test_imports.py``).
``ckpt.formats`` registers them with :func:`~ckpt.formats.base.register_format`, the call a
plugin makes for its own format.

Example:
    >>> from ckpt.formats import builtin
    >>> builtin.MsgpackFormat().sniff(b"not msgpack"), builtin.Hdf5Format().extensions
    (False, ('.h5', '.hdf5'))
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ckpt.storage import ReadableBlob, WritableBlob

from . import _h5head, _zip
from ._blocks import BLOCK_BYTES
from ._contract import ChunkedFormat, Format, WritableFormat
from ._readers import Reader

#: The members a .keras zip starts with.
_KERAS_ZIP_MEMBERS = ("metadata.json", "config.json", "model.weights.h5")


def _block_size(block_bytes: int) -> int:
    """``block_bytes`` if it can size checksum blocks (a positive int), else ValueError."""
    if type(block_bytes) is not int or block_bytes < 1:
        raise ValueError(f"block_bytes must be a positive int, got {block_bytes!r}")
    return block_bytes


def _unused(blob: ReadableBlob | None) -> None:
    """Close the sniffed blob of a format whose reader opens its checkpoint by path."""
    if blob is not None:
        blob.close()


class Hdf5Format(WritableFormat):
    """The ckpt HDF5 format (``formats/_h5write.py`` writes it, ``formats/hdf5.py`` reads it); also reads HDF5
    files other tools wrote.

    ``block_bytes``: the size of the checksum blocks of the files it writes (readers take the size
    a file records; small blocks make small test files with many blocks).
    """

    name = "hdf5"
    extensions = (".h5", ".hdf5")
    block_bytes: int = BLOCK_BYTES  # (also what a subclass that does not call __init__ writes)

    def __init__(self, *, block_bytes: int = BLOCK_BYTES) -> None:
        self.block_bytes = _block_size(block_bytes)

    def sniff(self, head: bytes) -> bool:
        return _h5head.ckpt_head(head) or _h5head.hdf5_signature(head)

    def open(self, path: str, blob: ReadableBlob | None = None, declined: Reader | None = None) -> Reader:
        from . import hdf5  # lazy: a format module loads on use

        return hdf5.open_hdf5(path, blob, declined)

    def write_blob(self, blob: WritableBlob, tensors: Sequence[tuple[str, Any]],
                   metadata: Mapping[str, Any], *, compression: str | None = None) -> None:
        from . import _h5write  # lazy: a format module loads on use

        _h5write.write_hdf5(blob, tensors, metadata, self.block_bytes)


class MsgpackFormat(WritableFormat):
    """The ckpt msgpack format (``formats/msgpack.py``).

    ``block_bytes``: the size of the checksum blocks of the files it writes; ``max_bin``: the
    largest bin object it writes (msgpack's limit, 4 GiB - 1, by default: larger tensors are split).
    Readers take what a file records; small sizes make small test files that use them.
    """

    name = "msgpack"
    extensions = (".msgpack",)
    compressions = ("zstd",)
    block_bytes: int = BLOCK_BYTES  # (also what a subclass that does not call __init__ writes)
    max_bin: int | None = None

    def __init__(self, *, block_bytes: int = BLOCK_BYTES, max_bin: int | None = None) -> None:
        self.block_bytes = _block_size(block_bytes)
        if max_bin is not None and (type(max_bin) is not int or not 1 <= max_bin < 1 << 32):
            raise ValueError(f"max_bin must be an int from 1 to 2**32 - 1, got {max_bin!r}")
        self.max_bin = max_bin

    def sniff(self, head: bytes) -> bool:
        from . import msgpack  # lazy: a format module loads on use

        return msgpack.is_ckpt_msgpack(head)

    def open(self, path: str, blob: ReadableBlob | None = None, declined: Reader | None = None) -> Reader:
        from . import msgpack  # lazy: a format module loads on use

        return msgpack.MsgpackReader(path, blob)

    def write_blob(self, blob: WritableBlob, tensors: Sequence[tuple[str, Any]],
                   metadata: Mapping[str, Any], *, compression: str | None = None) -> None:
        from . import _mpwrite, msgpack  # lazy: a format module loads on use

        _mpwrite.write_msgpack(blob, tensors, metadata, self.block_bytes,
                               msgpack.MAX_BIN if self.max_bin is None else self.max_bin, compression)


class IncrementalFormat(ChunkedFormat):
    """ckpt's incremental checkpoints: an index file whose tensors are chunks in the directory's
    chunk store (``formats/incremental.py``); written by a Saver with ``incremental=True``."""

    name = "ckpt-incremental"
    extensions: tuple[str, ...] = ()
    chunk_dir = ".ckpt-chunks"

    def sniff(self, head: bytes) -> bool:
        from . import incremental  # lazy: a format module loads on use

        return incremental.is_incremental(head)

    def open(self, path: str, blob: ReadableBlob | None = None, declined: Reader | None = None) -> Reader:
        from . import incremental  # lazy: a format module loads on use

        return incremental.IncrementalReader(path, blob)

    def tensor_entry(self, array: Any, chunk_bytes: int, put: Callable[[bytes, bytes | memoryview], None], *,
                     previous: list[Any] | None = None, exists: Callable[[bytes], bool] | None = None,
                     get: Callable[[bytes, int], bytes] | None = None, compression: str | None = None,
                     max_chain: int = 0, recall: dict[bytes, Any] | None = None,
                     note: dict[bytes, Any] | None = None, turn: int | None = None) -> list[Any]:
        from . import _chunkcodec, incremental  # lazy: a format module loads on use

        encoding = _chunkcodec.ChunkEncoding(exists or (lambda name: False), get, compression, max_chain, recall,
                                             turn)
        return incremental.tensor_entry(array, chunk_bytes, put, encoding, previous, note)

    def pack_index(self, metadata: dict[str, Any], chunk_bytes: int, entries: dict[str, list[Any]],
                   nested: bool = False, packs: dict[bytes, tuple[bytes, int, int]] | None = None) -> bytes:
        from . import incremental  # lazy: a format module loads on use

        return incremental.pack_index(metadata, chunk_bytes, entries, nested, packs)

    def locations(self, path: str) -> dict[bytes, tuple[bytes, int, int]]:
        from . import incremental  # lazy: a format module loads on use

        return incremental.chunk_locations(path)

    def references(self, path: str, blob: ReadableBlob | None = None) -> set[bytes]:
        from . import incremental  # lazy: a format module loads on use

        return incremental.referenced_chunks(path, blob)

    def entry_files(self, entry: list[Any], dtype: Any, shape: tuple[int, ...], chunk_bytes: int) -> \
            tuple[int, list[bytes]] | None:
        from . import incremental  # lazy: a format module loads on use

        return incremental.entry_files(entry, dtype, shape, chunk_bytes)


class CkptShardedFormat(Format):
    """ckpt's sharded checkpoints: directories with a commit record (``formats/ckpt_sharded.py``).

    It has no extension of its own (the shard files' extension names the checkpoint) and is
    written by a Saver with ``comm=``, not through the registry.
    """

    name = "ckpt-sharded"
    extensions: tuple[str, ...] = ()

    def claims(self, path: str) -> bool:
        if not os.path.isdir(path):  # (checked first: the module loads only for a directory)
            return False
        from . import ckpt_sharded  # lazy: a format module loads on use

        return ckpt_sharded.is_sharded(path)

    def sniff(self, head: bytes) -> bool:
        from . import ckpt_sharded  # lazy: a format module loads on use

        return head.startswith(ckpt_sharded.HEADER[:-1])  # a commit record: what an object-store URL leads to

    def open(self, path: str, blob: ReadableBlob | None = None, declined: Reader | None = None) -> Reader:
        from . import ckpt_sharded  # lazy: a format module loads on use

        return ckpt_sharded.ShardedReader(path, blob=blob)  # an object's record: its store opens the shards


class SafetensorsFormat(WritableFormat):
    """safetensors: reads any .safetensors file, writes them with per-tensor checksums."""

    name = "safetensors"
    extensions = (".safetensors",)

    def sniff(self, head: bytes) -> bool:
        # a plausible header length (below 2**40), then the JSON's opening brace
        return len(head) >= 9 and head[5:8] == b"\x00\x00\x00" and head[8:9] == b"{"

    def open(self, path: str, blob: ReadableBlob | None = None, declined: Reader | None = None) -> Reader:
        from . import safetensors  # lazy: a format module loads on use

        return safetensors.SafetensorsReader(path, blob)

    def write_blob(self, blob: WritableBlob, tensors: Sequence[tuple[str, Any]],
                   metadata: Mapping[str, Any], *, compression: str | None = None) -> None:
        from . import safetensors  # lazy: a format module loads on use

        safetensors.write_safetensors(blob, tensors, metadata)


class TorchFormat(Format):
    """torch.save's zip format and its legacy pickle format (read-only)."""

    name = "pytorch"
    extensions = (".pt", ".pth", ".bin")

    def sniff(self, head: bytes) -> bool:
        from . import torch  # lazy: a format module loads on use

        first = _zip.first_member_name(head)
        return head.startswith(torch.LEGACY_MAGIC) or (first is not None and first.endswith("data.pkl"))

    def open(self, path: str, blob: ReadableBlob | None = None, declined: Reader | None = None) -> Reader:
        from . import torch  # lazy: a format module loads on use

        return torch.TorchReader(path, blob)


class FlaxFormat(Format):
    """Flax's msgpack serialization (read-only)."""

    name = "flax"
    extensions = (".msgpack",)

    def sniff(self, head: bytes) -> bool:
        from . import msgpack  # lazy: a format module loads on use

        # a map whose first key is a string; ckpt's own msgpack files start with a map too
        if not head or msgpack.is_ckpt_msgpack(head):
            return False
        if head == b"\x80":  # an empty state dict
            return True
        first = head[0]
        key_at = 1 if 0x80 < first <= 0x8F else {0xDE: 3, 0xDF: 5}.get(first)
        return key_at is not None and len(head) > key_at and \
            (0xA0 <= head[key_at] <= 0xBF or head[key_at] in (0xD9, 0xDA, 0xDB))

    def open(self, path: str, blob: ReadableBlob | None = None, declined: Reader | None = None) -> Reader:
        from . import flax  # lazy: a format module loads on use

        return flax.FlaxReader(path, blob)


class TensorFlowFormat(Format):
    """TensorFlow's tensor bundles, as written by tf.train.Saver and tf.train.Checkpoint."""

    name = "tensorflow"
    extensions = (".index",)

    def claims(self, path: str) -> bool:
        # only an index, a data file or a prefix with no file of its own can name a bundle
        if not (path.endswith(".index") or ".data-" in path or not os.path.exists(path)):
            return False
        from . import tensorflow  # lazy: a format module loads on use

        return tensorflow.prefix_of(path) is not None

    def sniff(self, head: bytes) -> bool:
        return False  # an index has no header; claims() recognises it by its footer

    def open(self, path: str, blob: ReadableBlob | None = None, declined: Reader | None = None) -> Reader:
        from . import tensorflow  # lazy: a format module loads on use

        _unused(blob)
        return tensorflow.open_tensorflow(path)


class ShardedFormat(Format):
    """Hugging Face index files and model directories, Keras 3 ``.weights.json`` (read-only)."""

    name = "sharded"
    extensions = (".index.json", ".weights.json")

    def claims(self, path: str) -> bool:
        if os.path.isdir(path):
            from . import sharded  # lazy: a format module loads on use

            return any(os.path.isfile(os.path.join(path, name)) for name in sharded.HF_FILES)
        return path.endswith(self.extensions) and os.path.isfile(path)

    def sniff(self, head: bytes) -> bool:
        return False  # JSON says nothing about itself; claims() goes by the file name

    def open(self, path: str, blob: ReadableBlob | None = None, declined: Reader | None = None) -> Reader:
        from . import sharded  # lazy: a format module loads on use

        _unused(blob)
        return sharded.open_sharded(path)


class OrbaxFormat(Format):
    """orbax-checkpoint directories saved without OCDBT, and CheckpointManager roots (read-only)."""

    name = "orbax"
    extensions: tuple[str, ...] = ()

    def claims(self, path: str) -> bool:
        if not os.path.isdir(path):  # (checked first: the module loads only for a directory)
            return False
        from . import orbax  # lazy: a format module loads on use

        return orbax.is_orbax(path)

    def sniff(self, head: bytes) -> bool:
        return False  # a directory; claims() recognises it

    def open(self, path: str, blob: ReadableBlob | None = None, declined: Reader | None = None) -> Reader:
        from . import orbax  # lazy: a format module loads on use

        _unused(blob)
        return orbax.open_orbax(path)


class KerasFormat(Format):
    """Keras weights: the .keras zip, and HDF5 files with Keras's layout.

    Registered before the hdf5 format: it sniffs every HDF5 file ckpt did not write, opens it
    and, when the file has no Keras layout, declines, handing its open reader on to the hdf5
    format (``base.decline``), so libhdf5 opens the file once.
    """

    name = "keras"
    extensions = (".keras",)

    def sniff(self, head: bytes) -> bool:
        return _zip.first_member_name(head) in _KERAS_ZIP_MEMBERS or _h5head.foreign_hdf5(head)

    def open(self, path: str, blob: ReadableBlob | None = None, declined: Reader | None = None) -> Reader:
        from . import keras  # lazy: a format module loads on use

        return keras.open_keras(path, blob)


#: In the order they are asked; keras is registered before hdf5 (``ckpt.formats``).
FORMATS: tuple[Format, ...] = (Hdf5Format(), MsgpackFormat(), IncrementalFormat(), CkptShardedFormat(),
                               SafetensorsFormat(), TorchFormat(), FlaxFormat(), TensorFlowFormat(), ShardedFormat(),
                               OrbaxFormat())
