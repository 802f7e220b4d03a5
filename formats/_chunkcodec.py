"""How an incremental checkpoint's chunk files are stored: a chunk named by its SHA-256, whole
(raw, or byte planes + zstd when that is smaller) or as the XOR with its previous version, and the
delta chains that rebuild it (docs/formats.md, "Incremental checkpoints").

Example:
    >>> import numpy as np
    >>> piece = memoryview(np.zeros(1024, np.float32).tobytes())
    >>> stored = encode_whole(piece, 4)
    >>> out = memoryview(bytearray(len(piece)))
    >>> decode_into(memoryview(stored), out, "a chunk")
    >>> bytes(out) == bytes(piece), len(stored) < len(piece)
    (True, True)
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np

from ckpt.errors import CorruptCheckpointError

from . import _io
from ._planes import decode_chunk, encode_chunk

__all__ = ["ChunkEncoding", "PARALLEL_BYTES", "RETRY_AFTER", "assemble", "chain_of", "decode_into", "digest",
           "encode_whole", "links", "restarts"]


def digest(data: memoryview | bytes) -> bytes:
    """The content hash naming a chunk."""
    return hashlib.sha256(data).digest()


#: After a delta against a chunk did not pay (a chunk rewritten wholesale, such as a trained
#: head), its successors are written whole without trying for this many saves.
RETRY_AFTER = 4
#: Tensors at least this big have their chunks hashed, encoded and written side by side.
PARALLEL_BYTES = 4 << 20


class ChunkEncoding:
    """How a save encodes the chunks it writes (the store callbacks and the options).

    ``exists(name)`` tells whether the store holds the chunk file ``name.hex()`` and ``get(name,
    limit)`` returns its stored bytes, at most ``limit`` (the caller holds the directory's lock, so
    neither changes under it); ``compression`` ("zstd" or None) encodes whole chunks as byte planes; a changed chunk
    is stored as its XOR with its previous version while that chain is shorter than
    ``max_chain`` (0: never) and its turn to restart whole has not come (``restarts``: ``turn``
    plus the chunk's index in its tensor; None: chains restart only at ``max_chain``).

    ``recall`` holds what the previous save of the same Saver noted about the chunks it wrote, by
    digest: the chunk's bytes (hashed to that digest in this process: a delta against it needs
    no read-back) or, after a delta did not pay, how many more saves to write its successors
    whole. Each note is taken (popped) when used; ``chunk`` returns this save's note.
    """

    def __init__(self, exists: Callable[[bytes], bool] = lambda name: False,
                 get: Callable[[bytes, int], bytes] | None = None, compression: str | None = None,
                 max_chain: int = 0, recall: dict[bytes, Any] | None = None, turn: int | None = None) -> None:
        self.exists, self.get, self.compression, self.max_chain = exists, get, compression, max_chain
        self.turn = turn
        self.recall: dict[bytes, Any] = {} if recall is None else recall

    def chunk(self, piece: memoryview, itemsize: int, base: Any, put: Callable[[bytes, bytes | memoryview], None],
              index: int = 0) -> tuple[Any, int | None, Any]:
        """The reference of the chunk ``piece`` (the ``index``-th of its tensor), its crc32c (None
        when unchanged since the previous save: the caller may not need it) and the note for the
        next save, writing what the store lacks."""
        deltas = base is not None and self.get is not None and self.max_chain > 0
        old = self.recall.pop(chain_of(base)[0], None) if deltas else None
        # a chunk that changed last time likely changes again: hash a private copy, kept as the
        # next delta's base (hashed here, so its digest names exactly these bytes)
        own = bytes(piece) if isinstance(old, bytes) else None
        data = memoryview(own) if own is not None else piece
        x = digest(data)
        same = base is not None and chain_of(base)[0] == x
        if same and all(map(self.exists, links(base))):
            return base, None, None  # unchanged since the previous save: the same chain
        crc = _io.crc32c(data)
        if self.exists(x):
            return x, crc, None
        turn = None if self.turn is None else self.turn + index
        # unchanged, but a file of its chain is gone (or its pack is being compacted): stored whole again
        if deltas and not same and not restarts(len(chain_of(base)) - 1, turn, self.max_chain):
            if isinstance(old, int):  # a recent delta did not pay: skip the encoding
                put(x, encode_whole(data, itemsize) if self.compression else data)
                return x, crc, old - 1 or None
            delta = self._delta(data, itemsize, base, old)
            if delta is not None:
                put(x + chain_of(base)[0], delta)
                return [x, *chain_of(base)], crc, own or _private(data, x)
            put(x, encode_whole(data, itemsize) if self.compression else data)
            return x, crc, RETRY_AFTER
        put(x, encode_whole(data, itemsize) if self.compression else data)
        return x, crc, (own or _private(data, x)) if deltas else None

    def _delta(self, piece: memoryview, itemsize: int, base: Any, old: Any) -> bytes | None:
        """``piece`` XOR its previous version (``old``, its bytes, or None: read back from the
        store), encoded, when that pays (under half the chunk); None when not, or when the
        previous version cannot be read back exactly."""
        new = np.frombuffer(piece, np.uint8)
        if isinstance(old, bytes) and len(old) == len(piece):
            xor = np.bitwise_xor(new, np.frombuffer(old, np.uint8))
        else:
            back = self._read_back(len(piece), base)
            if back is None:
                return None
            xor = np.frombuffer(back, np.uint8)
            np.bitwise_xor(new, xor, out=xor)
        stored = encode_whole(xor.data, itemsize)
        return bytes(stored) if len(stored) * 2 <= len(piece) else None

    def _read_back(self, size: int, base: Any) -> bytearray | None:
        """The previous version rebuilt from the store, or None when a file of its chain is
        missing or does not rebuild to the digest the chain names (never encode against bytes
        that are not the base the chain names)."""
        assert self.get is not None
        if not all(map(self.exists, links(base))):
            return None
        old = bytearray(size)
        try:
            assemble(lambda name: memoryview(self.get(name, size)), base, memoryview(old), "the previous version")  # type: ignore[misc]
        except (OSError, CorruptCheckpointError):
            return None
        return old if digest(memoryview(old)) == chain_of(base)[0] else None


def _private(data: memoryview, name: bytes) -> bytes | None:
    """A copy of ``data`` known to hash to ``name`` (None when the bytes changed under the save:
    a note must never hold bytes its digest does not name)."""
    copy = bytes(data)
    return copy if digest(copy) == name else None


def chain_of(ref: bytes | list[bytes]) -> list[bytes]:
    """The digests of a chunk reference: [the chunk, its base, the base's base, ... a whole chunk]."""
    return [ref] if isinstance(ref, bytes) else ref


def links(ref: bytes | list[bytes]) -> list[bytes]:
    """The chunk files a reference reads (names; a file is ``name.hex()``): one per delta (the
    chunk's digest then its base's), then the whole chunk the chain ends on."""
    chain = chain_of(ref)
    return [chain[i] + chain[i + 1] for i in range(len(chain) - 1)] + [chain[-1]]


def restarts(deltas: int, turn: int | None, max_chain: int) -> bool:
    """Whether a changed chunk whose chain holds ``deltas`` deltas is written whole rather than as
    one more delta: when the chain is ``max_chain`` long (a restore's bound), or when it is the
    chunk's turn (``turn``, the Saver's save count plus the chunk's place, is a multiple of
    ``max_chain``) and its chain holds a delta. The chunks of a table whose chains all started in
    one save thus restart in turn, 1/``max_chain`` of them per save from the second save on, each
    every ``max_chain`` saves while it changes every save (a bound drawn per chain bunched the
    first restarts; drawn from [1, max_chain] it would restart twice as often)."""
    return deltas >= max_chain or (turn is not None and deltas > 0 and turn % max_chain == 0)


def encode_whole(piece: memoryview, itemsize: int) -> bytes | memoryview:
    """A chunk's stored bytes: byte planes + zstd behind a small header, or the raw bytes when
    that is not smaller (a stored file shorter than its chunk is encoded, one as long is raw)."""
    planes = itemsize if itemsize > 1 and len(piece) % itemsize == 0 else 1
    if len(piece) <= 1 + 4 * planes:
        return piece
    packed, sizes = encode_chunk(piece, planes)
    head = bytes([planes]) + np.asarray(sizes, "<u4").tobytes()
    return head + packed if len(head) + len(packed) < len(piece) else piece


def decode_into(stored: memoryview, out: memoryview, what: str) -> None:
    """Fill ``out`` (the chunk's bytes) from a chunk file's stored bytes (``what`` names it)."""
    if len(stored) == len(out):
        out[:] = stored
        return
    planes = stored[0] if len(stored) else 0
    sizes = np.frombuffer(stored[1:1 + 4 * planes], "<u4").tolist() if len(stored) >= 1 + 4 * planes else []
    if len(stored) > len(out) or not planes or len(out) % planes or 1 + 4 * planes + sum(sizes) != len(stored):
        raise CorruptCheckpointError(f"{what}: holds {len(stored)} bytes, neither the chunk's {len(out)} "
                                     "nor an encoded chunk")
    decode_chunk(stored[1 + 4 * planes:], sizes, planes, out, what)


def assemble(load: Callable[[bytes], memoryview], ref: bytes | list[bytes], out: memoryview, what: str) -> None:
    """Fill ``out`` with the chunk ``ref``: its whole base, then every delta XORed in."""
    names = links(ref)
    decode_into(load(names[-1]), out, f"{what}: chunk {names[-1].hex()}")
    if len(names) > 1:
        acc, tmp = np.frombuffer(out, np.uint8), bytearray(len(out))
        for name in names[:-1]:
            decode_into(load(name), memoryview(tmp), f"{what}: chunk {name.hex()}")
            np.bitwise_xor(acc, np.frombuffer(tmp, np.uint8), out=acc)
