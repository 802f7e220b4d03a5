"""Pack files: the chunks one incremental save writes, back to back in one file of the chunk store.

A local incremental save appends every chunk it writes to one new pack file,
``.ckpt-chunks/<pack id hex>`` (a random 16-byte id), instead of a file per chunk: a kept step's
chunks are then read as large sequential reads of a few big files, as a self-contained checkpoint
is (the kernel reads a small file afresh in small requests, a big one ahead in large ones). The
index's ``packs`` table says where each chunk it references lives; a chunk it does not list is a
file of its own, ``.ckpt-chunks/<name hex>`` (what versions 1 and 2 wrote, and what object-store
saves write)::

    "packs": [[pack id, [[chunk name, offset, stored length], ...]], ...]

Example:
    >>> table = pack_table({b"n" * 32: (b"p" * 16, 0, 5)})
    >>> read_pack_table(table, "m.msgpack", 8) == {b"n" * 32: (b"p" * 16, 0, 5)}
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ckpt.errors import CorruptCheckpointError
from ckpt.storage import Folder

__all__ = ["PACK_ID_BYTES", "Location", "PackedFolder", "pack_table", "read_pack_table"]

#: A pack's id: its file is ``<id hex>`` in the chunk store.
PACK_ID_BYTES = 16
#: Chunk names: a whole chunk's SHA-256, or a delta's (the chunk's then its base's).
_NAME_BYTES = (32, 64)
#: Where a chunk is stored: (pack id, offset in the pack, stored length).
Location = tuple[bytes, int, int]


def pack_table(located: Mapping[bytes, Location]) -> list[Any]:
    """The index's ``packs`` table of the chunks ``located`` (name -> location), each pack's
    members in file order."""
    by_pack: dict[bytes, list[Any]] = {}
    for name, (pack, offset, length) in sorted(located.items(), key=lambda item: item[1]):
        by_pack.setdefault(pack, []).append([name, offset, length])
    return [[pack, members] for pack, members in by_pack.items()]


def read_pack_table(table: Any, path: str, chunk_bytes: int) -> dict[bytes, Location]:
    """The locations a ``packs`` table gives (name -> location), checked for shape: a stored chunk
    is never longer than ``chunk_bytes``.

    Raises:
        CorruptCheckpointError: naming ``path``, for a malformed table.
    """
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: the index's pack table is malformed: {what}", path=path)

    if type(table) is not list:
        raise bad(f"a {type(table).__name__}, not a list")
    located: dict[bytes, Location] = {}
    for pack_entry in table:
        if type(pack_entry) is not list or len(pack_entry) != 2 or type(pack_entry[0]) is not bytes \
                or len(pack_entry[0]) != PACK_ID_BYTES or type(pack_entry[1]) is not list:
            raise bad(f"a pack entry is not [{PACK_ID_BYTES}-byte id, members]")
        pack = pack_entry[0]
        for member in pack_entry[1]:
            if type(member) is not list or len(member) != 3 or type(member[0]) is not bytes \
                    or len(member[0]) not in _NAME_BYTES or type(member[1]) is not int or type(member[2]) is not int:
                raise bad(f"a member of pack {pack.hex()} is not [chunk name, offset, length]")
            name, offset, length = member
            if offset < 0 or not 0 < length <= chunk_bytes:
                raise bad(f"chunk {name.hex()} at offset {offset}, {length} bytes long in pack {pack.hex()} "
                          f"(a stored chunk holds 1 to {chunk_bytes} bytes)")
            if located.setdefault(name, (pack, offset, length)) != (pack, offset, length):
                raise bad(f"chunk {name.hex()} is placed twice")
    return located


class PackedFolder:
    """A chunk store's :class:`ckpt.storage.Folder` as one index sees it: the chunks its pack
    table locates are read as byte ranges of their packs (``Folder.read_ranges``: neighbouring
    chunks in one request), the others as files of their own through ``inner``."""

    def __init__(self, inner: Folder, located: Mapping[bytes, Location]) -> None:
        self._inner = inner
        self._located = {name.hex(): (pack.hex(), offset, length) for name, (pack, offset, length) in located.items()}

    @property
    def location(self) -> str:
        return self._inner.location

    def where(self, name: str) -> str:
        if name in self._located:
            pack, offset, length = self._located[name]
            return f"{name} (bytes {offset}-{offset + length} of the pack {self._inner.where(pack)})"
        return self._inner.where(name)

    def read_objects(self, items: Sequence[tuple[str, memoryview]]) -> list[str | bytes | None]:
        return [answer for answer, _ in self._read(items, checked=False)]

    def read_checked(self, items: Sequence[tuple[str, memoryview]]) -> list[tuple[str | bytes | None, int | None]]:
        """``read_objects``, each answer with the crc32c of the view it filled where the folder
        computes it (None where not)."""
        return self._read(items, checked=True)

    def _read(self, items: Sequence[tuple[str, memoryview]],
              checked: bool) -> list[tuple[str | bytes | None, int | None]]:
        answers: list[tuple[str | bytes | None, int | None]] = [(None, None)] * len(items)
        alone = [i for i, (name, _) in enumerate(items) if name not in self._located]
        if alone:
            asked = [items[i] for i in alone]
            inner_checked = getattr(self._inner, "read_checked", None) if checked else None
            got = inner_checked(asked) if inner_checked is not None else \
                [(answer, None) for answer in self._inner.read_objects(asked)]
            for i, answer in zip(alone, got):
                answers[i] = answer
        ranges, targets = [], []
        for i, (name, view) in enumerate(items):
            if name not in self._located:
                continue
            pack, offset, length = self._located[name]
            if length > len(view):
                answers[i] = (f"holds more than {len(view)} bytes", None)
                continue
            buf = None if length == len(view) else bytearray(length)  # shorter: an encoded chunk
            ranges.append((pack, offset, view if buf is None else memoryview(buf)))
            targets.append((i, buf))
        for (i, buf), (problem, crc) in zip(targets, self._inner.read_ranges(ranges)):
            answers[i] = (problem, None) if problem is not None else (None, crc) if buf is None else (bytes(buf), None)
        return answers

    def read_whole(self, names: Sequence[str], limit: int) -> list[bytes | str]:
        answers: list[bytes | str] = [""] * len(names)
        alone = [i for i, name in enumerate(names) if name not in self._located]
        for i, answer in zip(alone, self._inner.read_whole([names[i] for i in alone], limit) if alone else []):
            answers[i] = answer
        ranges, targets = [], []
        for i, name in enumerate(names):
            if name not in self._located:
                continue
            pack, offset, length = self._located[name]
            if length > limit:
                answers[i] = f"holds more than {limit} bytes"
                continue
            buf = bytearray(length)
            ranges.append((pack, offset, memoryview(buf)))
            targets.append((i, buf))
        for (i, buf), (problem, _) in zip(targets, self._inner.read_ranges(ranges) if ranges else []):
            answers[i] = problem if problem is not None else bytes(buf)
        return answers

    def prefetch(self, names: Sequence[str]) -> None:
        """Ask the store to read these chunks ahead, where it takes such hints (a local folder)."""
        ranges = [self._located[name] for name in names if name in self._located]
        hint_ranges = getattr(self._inner, "prefetch_ranges", None)
        if ranges and hint_ranges is not None:
            hint_ranges(ranges)
        hint = getattr(self._inner, "prefetch", None)
        alone = [name for name in names if name not in self._located]
        if alone and hint is not None:
            hint(alone)

    def read_ranges(self, items: Sequence[tuple[str, int, memoryview]]) -> list[tuple[str | None, int | None]]:
        return self._inner.read_ranges(items)

    def sizes(self) -> dict[str, int]:
        return self._inner.sizes()

    def close(self) -> None:
        """Release what the folder holds open (a local folder's pack descriptors)."""
        close = getattr(self._inner, "close", None)
        if close is not None:
            close()
