"""Checkpoint locations, read side: the one place in the core that tells a local path from an
object-store URL (internal; the public names are ``ckpt.latest_checkpoint`` and the readers).

A directory of checkpoints is a :class:`ckpt.storage.Store` (``ckpt.saving.stores.open_store``
picks ``LocalStore`` or ``_remote.RemoteDirectory``); what differs between the two beyond the
Store methods is decided here once: how a location resolves to a checkpoint (storage options
are passed in, for the store of a URL). ``reader.py``, ``listing.py`` and the collective restore ask here instead of
branching on URLs themselves.

Example:
    >>> import tempfile
    >>> from ckpt.saving import locations as _locations
    >>> _locations.latest_checkpoint(tempfile.mkdtemp()) is None
    True
"""

from __future__ import annotations

import os
import time
from typing import Any
from collections.abc import Callable, Iterator, Mapping

from ckpt.storage import urls as _urls
from ckpt.errors import CheckpointNotFoundError, UnsupportedCheckpointError
from ckpt.formats.base import Format, format_for_path, formats  # the registry: checkpoint names
from ckpt.saving.retention import BEST_MODES, best_entries
from ckpt.saving.stores import REGISTRY, open_store
from ckpt.storage.state import STATE_FILE

__all__ = ["latest_checkpoint", "best_checkpoint", "listed_beside", "resolve_checkpoint", "save_target", "all_steps",
           "latest_step", "checkpoint_at_step", "checkpoints_iterator"]


def latest_checkpoint(directory: str | os.PathLike[str],
                      storage_options: Mapping[str, Any] | None = None) -> str | None:
    """Return the path of the newest checkpoint in ``directory`` that exists, or None.

    ``directory`` may be an object-store URL ("s3://bucket/run"); ``storage_options`` go to
    its fsspec filesystem (credentials and endpoints otherwise come from the environment).

    Example:
        >>> import ckpt, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> saver = ckpt.Saver({"v": ckpt.Variable(1.0)})
        >>> path = saver.save(os.path.join(d, "model.h5"), global_step=7)
        >>> ckpt.latest_checkpoint(d) == path
        True
    """
    return open_store(os.fspath(directory), storage_options).latest()


def _stepped(directory: str | os.PathLike[str], storage_options: Mapping[str, Any] | None) -> dict[int, str]:
    """{step: path} of the directory's existing checkpoints saved with a step (the newest of a step wins)."""
    store = open_store(os.fspath(directory), storage_options)
    state = store.effective_state()
    found: dict[int, str] = {}
    for entry in state.all_entries() if state is not None else []:
        if entry.step is not None and store.exists(entry.path):  # listed but deleted by hand: gone
            found[entry.step] = store.join(entry.path)
    return found


def all_steps(directory: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> list[int]:
    """The steps of the directory's existing checkpoints, ascending (orbax's ``all_steps``).

    Checkpoints saved without ``global_step`` have no step and are not listed.

    Example:
        >>> import ckpt, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> saver = ckpt.Saver({"v": ckpt.Variable(1.0)})
        >>> for step in (10, 20):
        ...     _ = saver.save(os.path.join(d, "model.h5"), global_step=step)
        >>> ckpt.all_steps(d), ckpt.latest_step(d)
        ([10, 20], 20)
    """
    return sorted(_stepped(directory, storage_options))


def latest_step(directory: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> int | None:
    """The highest step of the directory's existing checkpoints, or None when none has a step."""
    steps = all_steps(directory, storage_options)
    return steps[-1] if steps else None


def checkpoint_at_step(directory: str | os.PathLike[str], step: Any,
                       storage_options: Mapping[str, Any] | None = None) -> str:
    """The path of the directory's checkpoint saved with ``step``.

    Raises:
        CheckpointNotFoundError: no existing checkpoint of the directory has that step (the
            message lists the steps it has).
        TypeError: ``step`` is not an int.
    """
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int (the global_step a checkpoint was saved with), got {step!r}")
    where = os.fspath(directory)
    found = _stepped(where, storage_options)
    if step not in found:
        have = ", ".join(map(str, sorted(found))) or "none"
        raise CheckpointNotFoundError(f"{where}: no checkpoint of step {step}; steps saved: {have}", path=where)
    return found[step]


def checkpoints_iterator(directory: str | os.PathLike[str], min_interval_secs: float = 0.0,
                         timeout: float | None = None, timeout_fn: Callable[[], bool] | None = None,
                         storage_options: Mapping[str, Any] | None = None) -> Iterator[str]:
    """Yield each new latest checkpoint of ``directory`` as it appears (TF's ``checkpoints_iterator``),
    for evaluation jobs that follow a training run.

    Args:
        directory: a local directory or an object-store URL.
        min_interval_secs: at least this many seconds between two yields (and between polls).
        timeout: seconds to wait for a new checkpoint; None waits forever.
        timeout_fn: called when ``timeout`` passes without a new checkpoint: True ends the
            iteration, False waits again. Without it, a timeout ends the iteration.

    Example:
        >>> import ckpt, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> _ = ckpt.Saver({"v": ckpt.Variable(1.0)}).save(os.path.join(d, "model.h5"), global_step=1)
        >>> [os.path.basename(p) for p in ckpt.checkpoints_iterator(d, timeout=0)]
        ['model-1.h5']
    """
    if min_interval_secs < 0 or (timeout is not None and timeout < 0):
        raise ValueError(f"min_interval_secs and timeout must be non-negative, got {min_interval_secs!r}, {timeout!r}")
    last: str | None = None
    while True:
        found = _wait_for_new(directory, last, min_interval_secs, timeout, storage_options)
        if found is None:
            if timeout_fn is None or timeout_fn():
                return
            continue
        start = time.monotonic()
        yield found
        last = found
        time.sleep(max(0.0, min_interval_secs - (time.monotonic() - start)))


def _wait_for_new(directory: str | os.PathLike[str], last: str | None, interval: float, timeout: float | None,
                  storage_options: Mapping[str, Any] | None) -> str | None:
    """The directory's latest checkpoint once it differs from ``last``; None after ``timeout`` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        found = latest_checkpoint(directory, storage_options)
        if found is not None and found != last:
            return found
        if deadline is not None and time.monotonic() >= deadline:
            return None
        pause = max(interval, 0.1)  # poll the state file, not spin on it
        time.sleep(pause if deadline is None else min(pause, max(0.0, deadline - time.monotonic())))


def best_checkpoint(directory: str | os.PathLike[str], metric: str, mode: str = "min",
                    storage_options: Mapping[str, Any] | None = None) -> str | None:
    """Return the path of the directory's best kept checkpoint by ``metric``, or None when no
    existing checkpoint was saved with that metric (``save(..., metrics=)``).

    Args:
        directory: a local directory or an object-store URL.
        metric: the metric's name.
        mode: "min" (lower is better) or "max". Of equal values the newer checkpoint wins.

    Example:
        >>> import ckpt, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> saver = ckpt.Saver({"v": ckpt.Variable(1.0)})
        >>> for step, loss in [(1, 0.5), (2, 0.2), (3, 0.4)]:
        ...     _ = saver.save(os.path.join(d, "model.h5"), global_step=step, metrics={"val_loss": loss})
        >>> os.path.basename(ckpt.best_checkpoint(d, metric="val_loss", mode="min"))
        'model-2.h5'
    """
    if mode not in BEST_MODES:
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    store = open_store(os.fspath(directory), storage_options)
    state = store.effective_state()
    for entry in best_entries(state.all_entries() if state is not None else [], metric, mode):
        if store.exists(entry.path):  # listed but deleted by hand: the next best
            return store.join(entry.path)
    return None


def resolve_checkpoint(path: str | os.PathLike[str], storage_options: _urls.StorageOptions | None = None) -> str:
    """A checkpoint file as is; a directory -> its latest checkpoint, or itself when a format reads
    whole directories (a Hugging Face model directory without a state file). A URL ending in a
    checkpoint extension is a checkpoint (no request spent on looking for a state file); other
    URLs are looked up in their store, opened with ``storage_options``.

    Raises:
        CheckpointNotFoundError: nothing at ``path``, or a directory without checkpoints.
    """
    path = os.fspath(path)
    if _urls.is_url(path):
        return _resolve_url(path, storage_options)
    if os.path.isdir(path):
        latest = open_store(path).latest()
        if latest is None and REGISTRY.claims(path):  # a Hugging Face model directory, say
            return path
        if latest is None:
            raise CheckpointNotFoundError(f"{path}: no checkpoint in this directory{_why_none(path)}", path=path)
        return latest
    if not os.path.lexists(path) and not REGISTRY.claims(path):  # claims: a TensorFlow prefix, say
        return _by_prefix(path)
    return path


def _by_prefix(path: str) -> str:
    """TensorFlow's habit: a checkpoint named without its extension ("run/model-1" for
    run/model-1.h5) is that checkpoint when exactly one has the name; several, or numbered
    ones ("run/model" beside model-1.h5, model-2.h5), are named in the error."""
    directory, base = os.path.split(path)
    try:
        names = os.listdir(directory or ".")
    except OSError:
        return path  # the reader's not-found error names the path
    checkpoints = sorted(n for n in names if format_for_path(n) is not None)
    found = [n for n in checkpoints if n.startswith(base + ".")]
    if len(found) == 1:
        return os.path.join(directory, found[0])
    if found:
        raise CheckpointNotFoundError(f"{path}: no such checkpoint file; it is the prefix of {', '.join(found)}: "
                                      "name one", path=path)
    steps = [n for n in checkpoints if n.startswith(base + "-")]
    if steps:
        raise CheckpointNotFoundError(f"{path}: no such checkpoint file; {directory or '.'} holds "
                                      f"{', '.join(steps)} (restore the directory for its latest)", path=path)
    return path


def save_target(path: str | os.PathLike[str], default: Format | None = None) -> tuple[str, Format]:
    """The file a save writes for ``path``, and its format: the one rule of Saver.save and save_file.

    A directory (an existing one, or a path ending in "/") is refused: a save names a file in it.
    A writable format's extension picks that format; a name without an extension gets ``default``'s
    (the Saver's format; save_file has none and refuses); any other extension is refused.

    Raises:
        UnsupportedCheckpointError: a directory, or an extension no format writes (a ValueError).
    """
    name = os.fspath(path)
    writable = ", ".join(e for f in formats() if f.can_write for e in f.extensions)
    if name.endswith(("/", os.sep)) or (not _urls.is_url(name) and os.path.isdir(name)):
        example = os.path.join(name, "model" + (default.extensions[0] if default is not None else ".h5"))
        raise UnsupportedCheckpointError(f"{name}: a directory; a save names a file in it, e.g. {example} "
                                         "(restores and latest_checkpoint take the directory)", path=name)
    fmt = format_for_path(name)
    if fmt is not None and fmt.can_write:
        return name, fmt
    suffix = os.path.splitext(name.rstrip("/").rsplit("/", 1)[-1])[1]
    has_extension = fmt is not None or any(c.isalpha() for c in suffix)  # "model-1.5" has none
    if has_extension or default is None:
        what = f"'{suffix}' files" + (f" ({fmt.name} is read only)" if fmt is not None else "") \
            if has_extension else "files without an extension"
        bare = ", or no extension for the Saver's format" if default is not None else ""
        raise UnsupportedCheckpointError(f"{name}: ckpt writes no {what}; use {writable}{bare}", path=name)
    return name + default.extensions[0], default


def _resolve_url(url: str, storage_options: _urls.StorageOptions | None) -> str:
    """``resolve_checkpoint`` of a URL."""
    if format_for_path(url) is not None:
        return url
    found = open_store(url, storage_options).latest()
    if found is not None:
        return found
    parent, name = _urls.split(url)
    if name and open_store(parent, storage_options).exists(name):
        return url  # a checkpoint object without a known extension
    raise CheckpointNotFoundError(f"{url}: no checkpoint in this directory (no '{STATE_FILE}' state file "
                                  "naming an existing checkpoint)")


def _why_none(directory: str) -> str:
    """What the state file of a directory without checkpoints names (a copied TensorFlow
    directory's state file names the old machine's absolute paths)."""
    state = open_store(directory).read_state()
    entries = state.all_entries() if state is not None else []
    if not entries:
        return f" (no '{STATE_FILE}' state file naming an existing checkpoint)"
    missing = os.path.join(directory, entries[-1].path)  # an absolute path stays as recorded
    what = "is not a checkpoint file" if os.path.lexists(missing) else "does not exist"  # a FIFO, say
    earlier = f"; nor do the {len(entries) - 1} earlier ones it lists" if len(entries) > 1 else ""
    return f": its '{STATE_FILE}' state file names {missing}, which {what}{earlier}"


def listed_beside(path: str) -> list[str]:
    """The checkpoints the state file of ``path``'s directory lists, if it lists ``path``
    (TF1 users expect ``last_checkpoints`` to show a run they resume)."""
    directory = os.path.dirname(path)
    try:  # pending entries count where their save committed; a damaged file: what verifies
        state = open_store(directory or ".").effective_state()
    except (OSError, ValueError):
        return []  # an unreadable state file lists nothing; restores and saves report it
    if state is None or not any(e.path == os.path.basename(path) for e in state.all_entries()):
        return []
    return [os.path.join(directory, e.path) for e in state.checkpoints]
