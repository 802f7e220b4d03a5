"""A damaged state file: the directory's checkpoints found by name and verified instead
(internal; ``LocalStore`` and ``RemoteDirectory`` call it when their state file is empty, not
JSON or malformed).

Which names are checkpoints the Store's :class:`ckpt.storage.Catalog` says (the format
registry; storage does not import it). Only names a writable format claims ("model-3.h5", a
sharded checkpoint's directory) are candidates; each is opened and verified, and one that does
not verify is never used. The newest step (from the name, "<prefix>-<step><ext>") comes last,
as in a state file, so it is the latest; names without a step come before the stepped ones,
oldest first.

Example:
    >>> from ckpt.saving.stores import REGISTRY
    >>> from ckpt.storage.recovery import step_in_name
    >>> step_in_name("model-1000.h5", REGISTRY), step_in_name("model.h5", REGISTRY)
    (1000, None)
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence

from ckpt.errors import StateFileWarning
from ckpt.storage import Catalog
from ckpt.storage.state import CheckpointEntry, CheckpointState

__all__ = ["step_in_name", "is_candidate", "recover_state"]

_STEP = re.compile(r"-(-?\d{1,30})$")  # bounded: a step is an int, not 5,000 digits


def step_in_name(name: str, catalog: Catalog) -> int | None:
    """The global step a Saver put in ``name`` ("model-1000.h5" -> 1000), or None."""
    ext = catalog.extension(name)
    if ext is None:
        return None
    found = _STEP.search(name[:len(name) - len(ext)])
    return int(found.group(1)) if found else None


def is_candidate(name: str, catalog: Catalog) -> bool:
    """True for a name a Saver could have written (a writable format's extension)."""
    return catalog.writable(name) and not name.startswith(".")


def recover_state(problem: Exception, found: Sequence[tuple[str, float]],
                  verifies: Callable[[str], bool], catalog: Catalog) -> CheckpointState:
    """The state of a directory whose state file is damaged (``problem``, which names it): the candidates
    ``found`` (name, modification time) that ``verifies``, oldest step first, with a
    StateFileWarning saying what was found."""
    steps = {name: step_in_name(name, catalog) for name, _ in found}
    ordered = sorted(found, key=lambda c: (steps[c[0]] is not None, steps[c[0]] or 0, c[1], c[0]))
    entries: list[CheckpointEntry] = []
    rejected: list[str] = []
    last = 0.0
    for name, mtime in ordered:
        if not verifies(name):
            rejected.append(name)
            continue
        last = max(last, mtime)  # times follow the order: the newest step is the latest
        entries.append(CheckpointEntry(name, last, steps[name]))
    found_text = (f"{len(entries)} checkpoint(s) that verify, newest {entries[-1].path!r}" if entries
                  else "no checkpoint that verifies")
    skipped = f"; skipped as damaged: {', '.join(rejected)}" if rejected else ""
    warnings.warn(f"{problem}; going by the checkpoints in the directory instead: found {found_text}"
                  f"{skipped}; the next save rewrites the state file", StateFileWarning, stacklevel=4)
    return CheckpointState(entries)
