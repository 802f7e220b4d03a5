"""Leases on an object-store chunk store (internal): who may rely on its chunks, who may delete.

An object store has no lock, so the chunk store of incremental checkpoints in one
(``<dir>/.ckpt-chunks/``) is guarded by a small JSON object beside the chunks,
``.ckpt-chunks/leases``, changed only by compare-and-swap (``get_versioned``/``put_if``)::

    {"holds": {"<token>": <time>, ...}, "collect": ["<token>", <time>] or null}

It is a readers-writer lock with expiry. A save takes a *hold* before it looks at which chunks
exist and keeps it until its index is committed; a collection takes the *collect* lease, which
is granted only while no live hold exists, and no hold is granted while a live collect lease
exists. A lease is live for ``grace`` seconds (the storage option ``ckpt_grace``, 3600) after it
was taken or renewed; every write drops expired ones. Whoever holds a lease acts on it only
while ``fresh`` (less than half the grace since its last renewal): a paused save or collection
that wakes up later gives up instead of acting on a lease that may have expired. So no chunk is
ever deleted while a save that may reference it holds its lease (docs/incremental.md argues it).

Example:
    >>> from ckpt.storage.objstore import MemoryStore
    >>> leases = ChunkLeases(MemoryStore("memory://doc-leases"), "memory://doc-leases/.ckpt-chunks")
    >>> leases.hold("a"), leases.release("b", collect=True), leases.release("a", collect=True)
    (True, False, True)
    >>> leases.hold("c")  # a collection holds the store
    False
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar
from collections.abc import Callable

from ckpt.errors import CheckpointWriteError
from ckpt.storage import urls as _urls
from ckpt.storage.objstore import ObjectStore

__all__ = ["ChunkLeases", "LEASE_FILE"]

#: The lease object's name inside the chunk folder (never a chunk: chunks are named by 64 hex digits).
LEASE_FILE = "leases"
_ATTEMPTS = 50
T = TypeVar("T")


@dataclass
class _Leases:
    holds: dict[str, float] = field(default_factory=dict)
    collect: tuple[str, float] | None = None


class ChunkLeases:
    """The leases of the chunk folder ``folder_url`` in ``store`` (whose ``grace`` they expire by)."""

    def __init__(self, store: ObjectStore, folder_url: str) -> None:
        self.store = store
        self.url = _urls.join(folder_url.rstrip("/"), LEASE_FILE)
        self.grace = store.grace

    def fresh(self, since: float) -> bool:
        """True while a lease taken or renewed at ``since`` may still be acted on (half the grace)."""
        return time.time() - since < self.grace / 2

    def hold(self, token: str) -> bool:
        """Take a hold for the save ``token``; False while a live collection holds the store."""
        def change(leases: _Leases, now: float) -> tuple[_Leases, bool]:
            if leases.collect is not None:
                return leases, False
            leases.holds[token] = now
            return leases, True

        return self._update(change)

    def renew(self, token: str) -> bool:
        """Renew the hold of ``token``; False when it expired (a collection may have run since)."""
        def change(leases: _Leases, now: float) -> tuple[_Leases, bool]:
            if token not in leases.holds:
                return leases, False
            leases.holds[token] = now
            return leases, True

        return self._update(change)

    def release(self, token: str, collect: bool) -> bool:
        """Drop the hold of ``token``; with ``collect``, take the collect lease for it if no live
        hold or collection is left (True: the caller may collect, then ``end_collection``)."""
        def change(leases: _Leases, now: float) -> tuple[_Leases, bool]:
            leases.holds.pop(token, None)
            if not collect or leases.holds or leases.collect is not None:
                return leases, False
            leases.collect = (token, now)
            return leases, True

        return self._update(change)

    def end_collection(self, token: str) -> None:
        """Give up the collect lease of ``token`` (if it still has it)."""
        def change(leases: _Leases, now: float) -> tuple[_Leases, None]:
            if leases.collect is not None and leases.collect[0] == token:
                leases.collect = None
            return leases, None

        self._update(change)

    def _update(self, change: Callable[[_Leases, float], tuple[_Leases, T]]) -> T:
        for attempt in range(_ATTEMPTS):
            raw, version = self.store.get_versioned(self.url, 1 << 20)
            now = time.time()
            leases = self._live(_parse(raw, self.url), now)
            new, result = change(leases, now)
            if self.store.put_if(self.url, _dump(new), version):
                return result
            time.sleep(random.uniform(0, min(1.0, 0.01 * 2 ** attempt)))  # back off, jittered
        raise CheckpointWriteError(f"{self.url}: the chunk store's leases kept changing under {_ATTEMPTS} attempts "
                                   "to update them")

    def _live(self, leases: _Leases, now: float) -> _Leases:
        leases.holds = {t: at for t, at in leases.holds.items() if now - at < self.grace}
        if leases.collect is not None and now - leases.collect[1] >= self.grace:
            leases.collect = None
        return leases


def _parse(raw: bytes | None, url: str) -> _Leases:
    if raw is None:
        return _Leases()
    try:
        doc: Any = json.loads(raw)
        holds = {str(t): float(at) for t, at in doc["holds"].items()}
        collect = doc["collect"]
        return _Leases(holds, None if collect is None else (str(collect[0]), float(collect[1])))
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        # refuse rather than guess: a lease taken for damaged would let a collection run beside a save
        raise CheckpointWriteError(f"{url}: the chunk store's lease object is damaged; delete it once no save "
                                   "or collection of this directory runs") from None


def _dump(leases: _Leases) -> bytes:
    collect = None if leases.collect is None else list(leases.collect)
    return json.dumps({"holds": leases.holds, "collect": collect}).encode()
