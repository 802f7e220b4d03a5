"""Incremental saves and chunk collection in any Store: a local directory (under its lock,
``ckpt.saving.incremental``) or an object-store directory (under leases,
``ckpt.saving.incremental_remote``, loaded only for URLs)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ckpt.saving.incremental import Encoding, IncrementalStats, collect_chunks, commit_incremental
from ckpt.storage import StateChange, Store
from ckpt.storage.local import LocalStore
from ckpt.storage.state import CheckpointState, state_lock

__all__ = ["save_chunked", "collect"]


def save_chunked(store: Store, name: str, tensors: Sequence[tuple[str, Any]], metadata: Mapping[str, Any],
                 chunk_bytes: int, change: StateChange, step: int | None, metrics: Mapping[str, float] | None,
                 encoding: Encoding | None = None) -> tuple[CheckpointState, IncrementalStats] | None:
    """An incremental save of ``name`` into ``store``, recorded and followed by chunk collection;
    None when nothing was written because an object store's collection held the chunk store (the
    caller saves self-contained instead)."""
    if isinstance(store, LocalStore):
        return commit_incremental(store, name, tensors, metadata, chunk_bytes, change, step, metrics, encoding)
    from ckpt.saving.incremental_remote import commit_incremental_remote  # lazy: object stores only
    from ckpt.storage.remote import RemoteDirectory

    assert isinstance(store, RemoteDirectory)
    return commit_incremental_remote(store, name, tensors, metadata, chunk_bytes, change, step, metrics,
                                     encoding)


def collect(store: Store) -> int:
    """Delete the chunks no checkpoint of ``store``'s directory references (after a self-contained
    save's retention); returns how many."""
    if isinstance(store, LocalStore):
        with state_lock(store.location):
            return collect_chunks(store)
    from ckpt.saving.incremental_remote import collect_remote  # lazy: object stores only
    from ckpt.storage.remote import RemoteDirectory

    assert isinstance(store, RemoteDirectory)
    return collect_remote(store)
