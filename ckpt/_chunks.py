"""Reading one tensor of a checkpoint in bounded chunks, each checked as it streams.

Example:
    >>> import ckpt, numpy as np, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "m.msgpack")
    >>> _ = ckpt.Saver({"w": ckpt.Variable(np.arange(6.0))}).save(path)
    >>> with ckpt.load_checkpoint(path) as reader:
    ...     [c.tolist() for c in tensor_chunks(reader, "w", chunk_bytes=32)]
    [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0]]
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .reader import CheckpointReader

__all__ = ["CHUNK_BYTES", "tensor_chunks"]

#: Bytes of a tensor held in memory at a time.
CHUNK_BYTES = 32 << 20


def tensor_chunks(reader: CheckpointReader, key: str, chunk_bytes: int = CHUNK_BYTES) -> Iterator[np.ndarray]:
    """Yield tensor ``key``'s values as flat arrays of at most ``chunk_bytes`` bytes, in order."""
    flat = reader.get_tensor(key).reshape(-1)
    step = max(1, chunk_bytes // max(flat.dtype.itemsize, 1))
    for start in range(0, flat.size, step):
        yield flat[start:start + step]


def paired_chunks(ra: CheckpointReader, rb: CheckpointReader, key: str,
                  chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield matching flat chunks (the same elements) of tensor ``key`` of two checkpoints.

    Both tensors are read to their end, so each one's checksum is checked even when the
    other is shorter (mismatched shapes are the caller's to refuse).
    """
    ia, ib = ra.tensors[key], rb.tensors[key]
    elements = max(1, chunk_bytes // max(ia.dtype.itemsize, ib.dtype.itemsize, 1))
    chunks_b = tensor_chunks(rb, key, elements * max(ib.dtype.itemsize, 1))
    for ca in tensor_chunks(ra, key, elements * max(ia.dtype.itemsize, 1)):
        cb = next(chunks_b, None)
        if cb is None or cb.size != ca.size:
            raise ValueError(f"tensor {key!r} has {ia.size} elements in {ra.path}, {ib.size} in {rb.path}")
        yield ca, cb
    for _ in chunks_b:  # the rest of B, and its checksum
        raise ValueError(f"tensor {key!r} has {ia.size} elements in {ra.path}, {ib.size} in {rb.path}")
