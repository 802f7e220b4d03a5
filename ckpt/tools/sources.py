"""What the whole-checkpoint functions (compare, convert, tensor_stats) were asked to read:
a checkpoint given as a path or an open reader, and which of its keys.

Example:
    >>> select_keys(["enc/w", "enc/b", "head/w"], "^enc/", "m.h5")
    ['enc/w', 'enc/b']
    >>> select_keys(["enc/w", "enc/b"], ["enc/b"], "m.h5")
    ['enc/b']
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeAlias

from ckpt.storage.urls import StorageOptions
from ckpt.errors import KeyNotFoundError, closest_hint
from ckpt.saving.reader import CheckpointReader, load_checkpoint

__all__ = ["Checkpoint", "Keys", "opened", "select_keys"]

#: A checkpoint to read: a path or URL (a directory means its latest checkpoint), or an open reader.
Checkpoint: TypeAlias = "str | os.PathLike[str] | CheckpointReader"
#: Which keys: None for every key, a regular expression (``re.search``), or the keys themselves.
Keys: TypeAlias = "str | Iterable[str] | None"


@contextmanager
def opened(checkpoint: Checkpoint, storage_options: StorageOptions | None = None) -> Iterator[CheckpointReader]:
    """Yield ``checkpoint`` as an open reader; one opened here is closed again, one given is not."""
    if isinstance(checkpoint, CheckpointReader):
        yield checkpoint
        return
    with load_checkpoint(checkpoint, storage_options) as reader:
        yield reader


def select_keys(available: Iterable[str], keys: Keys, path: str) -> list[str]:
    """The keys of ``available`` that ``keys`` asks for, in ``available``'s order.

    Raises:
        KeyNotFoundError: a regular expression matching nothing, or a listed key that is not
            there (naming the closest keys).
        ValueError: ``keys`` is not a valid regular expression.
    """
    names = list(available)
    if keys is None:
        return names
    if isinstance(keys, str):
        try:
            pattern = re.compile(keys)
        except re.error as exc:
            raise ValueError(f"{keys!r} is not a regular expression: {exc}") from exc
        chosen = [k for k in names if pattern.search(k)]
        if not chosen:
            raise KeyNotFoundError(f"{path}: no tensor key matches {keys!r}", path=str(path))
        return chosen
    wanted = list(dict.fromkeys(keys))
    present = set(names)
    for key in wanted:
        if key not in present:
            raise KeyNotFoundError(f"{path}: tensor {key!r} not found in checkpoint{closest_hint(key, names)}",
                                   path=str(path), key=key)
    wanted_set = set(wanted)
    return [k for k in names if k in wanted_set]
