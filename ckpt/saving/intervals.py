"""When a training run should save: the step and time intervals behind ``Saver.should_save``.

Example:
    >>> from ckpt.saving.intervals import SaveIntervals
    >>> every = SaveIntervals(steps=100, seconds=None)
    >>> every.saved(0, now=0.0)
    >>> [every.due(step, now=1.0, storage_options=None) for step in (0, 50, 100)]
    [False, False, True]
"""

from __future__ import annotations

import os
import time

from ckpt.saving.stores import store_of
from ckpt.storage.urls import StorageOptions

__all__ = ["SaveIntervals"]


class SaveIntervals:
    """``save_interval_steps`` / ``save_interval_seconds`` of a Saver, and the save they count from:
    this Saver's last save, or before its first one the checkpoint it restored (a resumed run
    goes on counting from there)."""

    def __init__(self, steps: int | None, seconds: float | None) -> None:
        if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
            raise ValueError(f"save_interval_steps must be a positive int or None, got {steps!r}")
        if seconds is not None and not seconds > 0:
            raise ValueError(f"save_interval_seconds must be positive or None, got {seconds!r}")
        self.steps, self.seconds = steps, seconds
        self._last: tuple[int | None, float] | None = None  # (step, time) of the last save; None: none yet
        self._resumed_from: str | None = None  # the checkpoint restored before the first save

    def saved(self, step: int | None, now: float | None = None) -> None:
        """Count from a save of ``step`` now (an asynchronous one from its snapshot)."""
        self._last = (step, time.time() if now is None else now)
        self._resumed_from = None

    def restored(self, path: str) -> None:
        """Count from the checkpoint at ``path`` if this Saver has not saved since it last restored."""
        if self._last is None or self._resumed_from is not None:
            self._resumed_from, self._last = path, None

    def due(self, step: int, now: float | None, storage_options: StorageOptions | None) -> bool:
        """True when either interval has passed since the save counted from (or with no interval,
        for any step not saved last); before any save or restore, True."""
        last = self._last or self._restored_save(storage_options)
        if last is None:
            return True
        last_step, last_time = last
        if last_step == step:
            return False
        if self.steps is None and self.seconds is None:
            return True
        # a last save without a step gives the step interval nothing to count from: due
        if self.steps is not None and (last_step is None or step - last_step >= self.steps):
            return True
        now = time.time() if now is None else now
        return self.seconds is not None and now - last_time >= self.seconds

    def _restored_save(self, storage_options: StorageOptions | None) -> tuple[int | None, float] | None:
        """(step, time) of the checkpoint restored, from its directory's state file."""
        if self._resumed_from is None:
            return None
        name = os.path.basename(self._resumed_from)
        try:
            state = store_of(self._resumed_from, storage_options).effective_state()
        except (OSError, ValueError):
            state = None  # an unreadable state file: the restore itself is all we know
        entry = next((e for e in (state.all_entries() if state else []) if e.path == name), None)
        self._last = (entry.step, entry.time) if entry is not None else (None, 0.0)
        return self._last
