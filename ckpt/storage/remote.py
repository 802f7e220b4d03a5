"""Checkpoints in object stores: the commit protocol, the state file, retention and cleanup
(internal; ``Saver``, ``latest_checkpoint`` and the readers call it for URLs).

An object store has no rename, so a save to ``<dir>/<name>`` goes (docs/formats.md, "Object
stores"):

1. the format writes the checkpoint into a blob that uploads it to the data object
   ``<dir>/.ckpt-data/<name>/<token>`` (a unique name), create-only, invisible until complete:
   on S3 one PUT of up to 512 MiB whose body is read out of the writer's (lent) buffers, or a
   multipart upload whose parts go up while later ones are written (the first part, which
   holds the head the format fills in last, goes last) (``ckpt.storage.uploads.S3Upload``; other
   stores: a local temporary file uploaded at the end);
2. optionally the uploaded data object is read back and checked (``ckpt.convert``);
3. the commit record ``<dir>/<name>`` (small JSON naming the data object) is written with a
   create-only conditional write: from this moment the checkpoint exists, whole; a late or
   duplicate writer of the same name is refused by the store;
4. the state file ``<dir>/checkpoint`` is updated by compare-and-swap on its version,
   retried, so racing savers never lose each other's entries. A save (``commit``) writes it
   twice: before step 3 with the checkpoint pending (naming its data object), after step 3 with
   it recorded and retention applied; a reader counts a pending entry whose commit record names
   that data object, so a save killed between 3 and 4 still leaves its checkpoint the latest.

Data objects no commit record names (a save killed between 2 and 3) are deleted by a later
save once they are older than ``ORPHAN_GRACE_S`` (their token starts with the save's start
time); retention deletes a dropped checkpoint's commit record, then its data object.

A sharded checkpoint (``Saver(comm=)``, ckpt/distributed/save.py) uses a data *prefix*
``.ckpt-data/<name>/<token>/``: the ranks' shard files, then its ``COMMIT``, which the commit
record names; deleting it (retention, a failed save, orphan cleanup) deletes the whole prefix.

Example:
    >>> from ckpt.storage import remote as _remote
    >>> _remote.is_commit_record(_remote.commit_record(".ckpt-data/m.msgpack/abc", 10))
    True
"""

from __future__ import annotations

import random
import time
import warnings
from contextlib import closing
from typing import Any, TypeVar
from collections.abc import Callable, Mapping, Sequence

from ckpt.checksums import crc32c
from ckpt.storage import urls as _urls
from ckpt.storage.backends import object_store
from ckpt.storage.commits import (
    SHARDED_COMMIT,
    COMMIT_LIMIT,
    DATA_DIR,
    Commit,
    commit_record,
    is_commit_record,
    parse_commit,
    token_age,
    unique_token,
)
from ckpt.storage.objstore import ObjectStore
from ckpt.storage.uploads import OPEN_HEAD, OPEN_TAIL
from ckpt.storage.workers import checksum_async
from ckpt.storage.recovery import is_candidate, recover_state
from ckpt.errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError, CorruptCheckpointError
from ckpt.storage.state import (
    STATE_FILE,
    CheckpointEntry,
    CheckpointState,
    dump_state,
    parse_state,
    settle,
    with_pending,
)
from ckpt.storage import FILES_ONLY, Catalog, Listed, ReadableBlob, StateChange, WritableBlob

split_url = _urls.split

__all__ = ["RemoteDirectory", "split_url", "commit_record", "is_commit_record", "parse_commit", "Commit", "DATA_DIR",
           "ORPHAN_GRACE_S", "HEAD_BYTES", "OPEN_HEAD", "OPEN_TAIL"]

#: A checkpoint's first ranged GET: enough for a commit record (with its copies of the data
#: object's head and tail, base64), or a plain checkpoint's header.
HEAD_BYTES = 128 << 10
#: Seconds after which an uncommitted data object counts as abandoned (no live save takes that
#: long between finishing its upload and writing its commit record).
ORPHAN_GRACE_S = 3600.0
_CAS_ATTEMPTS = 50

T = TypeVar("T")


class RemoteDirectory:
    """One checkpoint directory in an object store (``s3://bucket/run``); ``catalog`` says which
    names are checkpoints and verifies them (the format registry, ``ckpt.saving.stores.REGISTRY``;
    without it the damaged-state fallback finds nothing)."""

    def __init__(self, url: str, storage_options: _urls.StorageOptions | None = None,
                 store: ObjectStore | None = None, catalog: Catalog = FILES_ONLY) -> None:
        self.url = _urls.check(url).rstrip("/")
        self.store = store if store is not None else object_store(self.url, storage_options)
        self.catalog = catalog

    @property
    def location(self) -> str:
        return self.url

    def join(self, name: str) -> str:
        return _urls.join(self.url, name)

    def open(self, name: str) -> RemoteFile:
        return RemoteFile(self.join(name), self)

    def list_names(self) -> list[str]:
        names = (str(item["name"]) for item in self.store.list(self.url))
        return sorted(n for n in names if "/" not in n and n != DATA_DIR)

    # -- checkpoints --------------------------------------------------------------------------

    def locate(self, name: str) -> tuple[str, int, list[tuple[int, bytes]]]:
        """``(data object URL, size, [(offset, bytes of it already fetched)])`` for the
        checkpoint ``name``: through its commit record (which copies the data object's head and
        tail), or the object itself when it is a plain checkpoint (uploaded by hand).

        Raises:
            CheckpointNotFoundError: no such checkpoint.
        """
        url = self.join(name)
        found = self._read(url)
        if found is None:
            raise CheckpointNotFoundError(f"{url}: no such checkpoint")
        if isinstance(found, Commit):
            return self.join(found.data), found.size, found.copies
        data, size = found
        return url, size, [(0, data)] if data else []

    def _read(self, url: str) -> Commit | tuple[bytes, int] | None:
        """The commit record at ``url`` (parsed and checked), or a plain object's first bytes and
        size; None when there is no such object. One GET (two for an overlong record)."""
        head = self.store.read_small_or_head(url, HEAD_BYTES, "the checkpoint")
        if head is None or not is_commit_record(head[0]):
            return head
        data, size = head
        if size > len(data):  # longer than one GET: not written by ckpt, but read it whole (bounded)
            data = self.store.read_small(url, COMMIT_LIMIT, "the commit record") or b""
        return parse_commit(data, url)

    def exists(self, name: str) -> bool:
        return self.store.exists(self.join(name))

    def copy_problems(self, name: str) -> list[str]:
        """Compare the data object of checkpoint ``name`` with its commit record's copies of its
        head and tail (readers use the copies, so damage there is seen by plain msgpack/h5py
        users of the object only): one line per difference; none for a plain object."""
        data_url, size, copies = self.locate(name)
        if data_url == self.join(name) or not copies:
            return []
        got = [bytearray(len(copy)) for _, copy in copies]
        try:
            self.store.read_into(data_url, [(offset, memoryview(b)) for (offset, _), b in zip(copies, got)],
                                 lambda i: "the bytes the commit record copies", size)
        except CorruptCheckpointError as exc:
            return [str(exc)]
        return [f"{data_url}: bytes {offset}-{offset + len(copy) - 1} ({'its head' if not offset else 'its tail'}) "
                "differ from the commit record's copy of them: the data object is damaged (ckpt reads the copy; a "
                "plain msgpack or h5py reader of the object reads the damage)"
                for (offset, copy), b in zip(copies, got) if bytes(b) != copy]

    def size_of(self, name: str) -> int:
        """The bytes of checkpoint ``name``'s data: its data object, or every object under a
        sharded checkpoint's data prefix (its shard files and COMMIT; one LIST)."""
        data, size, _ = self.locate(name)
        prefix, _, last = data.rpartition("/")
        if last != SHARDED_COMMIT or data == self.join(name):
            return size
        return sum(int(e.get("size") or 0) for e in self.store.list(prefix, recursive=True))

    def new_data(self, name: str) -> str:
        """A unique data-object name for a save of ``name``, relative to the directory (a sharded
        save puts its shard files and their commit record under it, as a prefix)."""
        return f"{DATA_DIR}/{name}/{unique_token()}"

    def write_checkpoint(self, name: str, write: Callable[[WritableBlob], None],
                         check: Callable[[ReadableBlob], None] | None = None, step: int | None = None) -> None:
        """Upload with ``write(blob)`` (streamed to the store in parts as it is written), ``check``
        the uploaded data object (by its URL) if asked, then commit ``name`` (at ``step``) create-only.

        Raises:
            CheckpointWriteError: the store refused or failed; nothing was committed (the
                data object, if uploaded, is deleted again, or left to the next cleanup).
        """
        relative = self.new_data(name)
        size, head, tail = self._upload(relative, write, check)
        self.publish(name, relative, size, head, tail, step)

    def write_file(self, name: str, write: Callable[[WritableBlob], None],
                   check: Callable[[ReadableBlob], None] | None = None) -> int:
        """Upload the object ``name`` create-only with ``write(blob)``, no commit record (a
        sharded save's shard files, under its data prefix); ``check`` it by URL if asked."""
        return self._upload(name, write, check)[0]

    def _upload(self, name: str, write: Callable[[WritableBlob], None],
                check: Callable[[ReadableBlob], None] | None) -> tuple[int, bytes, bytes]:
        """Write, finish and optionally check the object ``name``; return its size, head and tail.
        If ``write`` or ``check`` fails, nothing is left (the upload aborted or the object deleted)."""
        url = self.join(name)
        blob = self.store.open_upload(url, create_only=True)
        try:
            write(blob)
        except BaseException:
            blob.abort()
            raise
        size, head, tail = blob.finish()
        if check is not None:
            try:
                parent, _ = _urls.split(url)
                with closing(RemoteFile(url, RemoteDirectory(parent, store=self.store))) as written:
                    check(written)
            except BaseException:
                self._delete_data(url, quietly=True)
                raise
        return size, head, tail

    def under(self, relative: str) -> RemoteDirectory:
        """The directory ``relative`` inside this one (a data prefix), sharing its ObjectStore."""
        return RemoteDirectory(self.join(relative), store=self.store, catalog=self.catalog)

    def publish_bytes(self, name: str, relative: str, data: bytes, step: int | None = None) -> None:
        """``publish`` the uploaded data object ``relative``, whose bytes are ``data``."""
        head = data[:OPEN_HEAD]
        self.publish(name, relative, len(data), head, data[max(len(head), len(data) - OPEN_TAIL):], step)

    def publish(self, name: str, relative: str, size: int, head: bytes, tail: bytes, step: int | None = None) -> None:
        """Write the commit record of ``name`` (``step``; create-only) naming the uploaded data object
        ``relative`` (``size`` bytes, its first bytes ``head`` and last ``tail``); if that fails,
        delete the data again (a sharded checkpoint's whole prefix) and raise."""
        try:
            self.store.put(self.join(name), commit_record(relative, size, head, tail, name, step), create_only=True)
        except BaseException:
            self._delete_data(self.join(relative), quietly=True)
            raise

    def commit(self, name: str, write: Callable[[WritableBlob], None], change: StateChange,
               step: int | None = None, metrics: Mapping[str, float] | None = None,
               ready: Callable[[], None] | None = None) -> CheckpointState:
        """Clean orphans, upload ``name``'s data, name it pending in the state file (``intend``),
        call ``ready()`` (a last check that may raise: nothing is committed then), write its commit
        record (``step`` goes into it), then record it (``record``)."""
        self.clean_orphans()
        relative = self.new_data(name)
        size, head, tail = self._upload(relative, write, None)
        try:
            self.intend(name, step, relative, metrics)
            if ready is not None:
                ready()
        except BaseException:
            self._delete_data(self.join(relative), quietly=True)
            raise
        self.publish(name, relative, size, head, tail, step)
        return self.record(name, change)

    def intend(self, name: str, step: int | None, relative: str, metrics: Mapping[str, float] | None = None) -> None:
        """Name ``name`` pending in the state file, committed once a commit record names the data
        object ``relative`` (written next)."""
        def change(state: CheckpointState | None) -> tuple[CheckpointState, None]:
            state = state or CheckpointState()
            if state.written_by != "ckpt":
                raise CheckpointWriteError(f"{self.join(STATE_FILE)}: a {state.written_by} state file; ckpt will "
                                           "not rewrite it")
            entry = CheckpointEntry(name, time.time(), step, relative, None if metrics is None else dict(metrics))
            return with_pending(settle(state, self._committed), entry), None

        try:
            self.update_state(change)
        except CheckpointError as exc:
            raise CheckpointWriteError(f"{self.join(name)}: not saved, the state file cannot be written ({exc}); "
                                       "the previous checkpoint is still the latest") from exc

    def _committed(self, entry: CheckpointEntry) -> bool:
        """True when the pending ``entry``'s commit record exists (and names its data object)."""
        try:
            if entry.commit is None:
                return self.exists(entry.path)
            return self.locate(entry.path)[0] == self.join(entry.commit)
        except (CheckpointNotFoundError, CorruptCheckpointError):
            return False  # not there, or not a commit this save could have written

    def effective_state(self) -> CheckpointState | None:
        """The state readers go by: pending entries settled; for a damaged state file, the
        directory's verified checkpoints (with a StateFileWarning)."""
        url = self.join(STATE_FILE)
        raw = self.store.read_small(url, 16 << 20, "the state file")
        return None if raw is None else settle(self._parsed(raw, url), self._committed)

    def _parsed(self, raw: bytes, url: str) -> CheckpointState:
        try:
            return parse_state(raw, url)
        except CorruptCheckpointError as exc:
            return self._recovered(exc)

    def _recovered(self, problem: CorruptCheckpointError) -> CheckpointState:
        found = []
        for item in self.store.list(self.url):
            name = str(item["name"])
            if "/" not in name and is_candidate(name, self.catalog):
                modified: Any = item.get("LastModified") or item.get("mtime")
                found.append((name, float(modified.timestamp()) if hasattr(modified, "timestamp") else 0.0))
        return recover_state(problem, found, self._verifies, self.catalog)

    def _verifies(self, name: str) -> bool:
        url = self.join(name)
        try:
            return self.catalog.verifies(url, RemoteFile(url, self))
        except CorruptCheckpointError:
            return False
        except CheckpointNotFoundError:
            return False

    def record(self, name: str, change: StateChange) -> CheckpointState:
        """Record the committed ``name`` in the state file (compare-and-swap) and delete what
        ``change`` dropped. A checkpoint that cannot be recorded is deleted again."""
        try:
            state, doomed = self.update_state(
                lambda state: _pair(change(None if state is None else settle(state, self._committed, name))))
        except CheckpointError as exc:
            try:
                self.delete_checkpoints([name])
            except CheckpointError:
                pass  # the store is failing: the next save's cleanup takes the data object
            raise CheckpointWriteError(f"{self.join(name)}: the checkpoint was written but could not be recorded "
                                       f"in the state file ({exc}); it was removed, and the previous "
                                       "checkpoint is still the latest") from exc
        try:
            self.delete_checkpoints(doomed)
        except CheckpointError as exc:
            warnings.warn(f"could not delete old checkpoints {doomed}: {exc}", stacklevel=4)
        return state

    def latest(self) -> str | None:
        return self._latest_in(self.effective_state())

    def _latest_in(self, state: CheckpointState | None) -> str | None:
        for entry in reversed(state.all_entries() if state is not None else []):
            if self.holds(entry.path, entry.step):
                return self.join(entry.path)
        return None

    def holds(self, name: str, step: int | None = None) -> bool:
        """Whether checkpoint ``name`` exists (one GET of its first bytes, as a HEAD would cost),
        checked to be committed as ``name`` and, when both are known, as ``step``.

        Raises:
            CorruptCheckpointError: its commit record commits another checkpoint or step.
        """
        url = self.join(name)
        found = self._read(url)
        if isinstance(found, Commit) and None not in (step, found.step) and found.step != step:
            raise CorruptCheckpointError(f"{url}: the commit record commits step {found.step}; the "
                                         f"'{STATE_FILE}' state file lists this name at step {step}")
        return found is not None

    def listing(self) -> list[Listed]:
        """``(name, step, time, size, note)`` for each checkpoint: the state file's entries (note
        "latest", "preserved", "missing" or ""), then committed checkpoints the state file does not
        list. Sizes come from the commit records (a sharded checkpoint's: the objects under its data
        prefix)."""
        state = self.effective_state()
        found = self._latest_in(state)
        rows: list[Listed] = []
        known = {STATE_FILE}
        for entry in state.all_entries() if state is not None else []:
            known.add(entry.path)
            try:
                size: int | None = self.size_of(entry.path)
            except CheckpointNotFoundError:
                size = None
            note = "latest" if self.join(entry.path) == found else "missing" if size is None else \
                "preserved" if state is not None and entry in state.preserved else ""
            rows.append((entry.path, entry.step, entry.time, size, note, entry.metrics))
        for item in self.store.list(self.location):
            name = str(item["name"])
            if name not in known and "/" not in name and self.catalog.extension(name) is not None:
                rows.append((name, None, None, self.size_of(name), f"not in the '{STATE_FILE}' state file", None))
        return rows

    def delete_checkpoints(self, names: Sequence[str]) -> None:
        """Delete each checkpoint: its commit record first (it stops existing), then its data."""
        for name in names:
            url = self.join(name)
            try:
                data, _, _ = self.locate(name)
            except CheckpointNotFoundError:
                continue
            self.store.delete([url])
            if data != url:
                self._delete_data(data)

    def _delete_data(self, data_url: str, quietly: bool = False) -> None:
        """Delete a data object; a sharded checkpoint's (its "COMMIT") with every object under its prefix."""
        try:
            prefix, _, last = data_url.rpartition("/")
            urls = [data_url]
            if last == SHARDED_COMMIT:  # the shard files first, the record naming them last
                urls = [_urls.join(prefix, str(e["name"])) for e in self.store.list(prefix, recursive=True)
                        if str(e["name"]) != SHARDED_COMMIT] + urls
            self.store.delete(urls)
        except CheckpointError:
            if not quietly:
                raise  # else: left for clean_orphans

    def clean_orphans(self, grace_s: float = ORPHAN_GRACE_S) -> list[str]:
        """Delete data objects of saves that never committed (older than ``grace_s`` seconds), and abort
        their unfinished uploads (S3: a save killed mid-upload); return their names. Costs one LIST
        when there are none (and on S3 one listing of unfinished uploads)."""
        removed = []
        for url, upload_id in self.store.unfinished_uploads(self.join(DATA_DIR)):
            relative = url.rpartition(f"/{DATA_DIR}/")[2]  # "<name>/<token>[/<file>]": the token dates it
            age = token_age(relative.split("/")[1] if relative.count("/") else "")
            if age is not None and age >= grace_s:
                try:
                    self.store.abort_upload(url, upload_id)
                    removed.append(relative)
                except CheckpointError:
                    pass  # the next save tries again
        commits: dict[str, str | None] = {}
        for entry in self.store.list(self.join(DATA_DIR), recursive=True):
            # "<name>/<token>", or "<name>/<token>/<file>" under a sharded save's prefix
            name, _, rest = str(entry["name"]).partition("/")
            token = rest.partition("/")[0]
            age = token_age(token)
            if not name or age is None or age < grace_s:
                continue
            if name not in commits:
                try:
                    commits[name] = self.locate(name)[0]
                except CheckpointNotFoundError:
                    commits[name] = None
                except CorruptCheckpointError:
                    continue  # a damaged commit record: leave its data for a person to look at
            data_url = self.join(f"{DATA_DIR}/{entry['name']}")
            committed = commits[name]
            if committed != data_url and not (committed or "").startswith(self.join(f"{DATA_DIR}/{name}/{token}/")):
                self._delete_quietly([data_url])
                removed.append(str(entry["name"]))
        return removed

    def _delete_quietly(self, urls: list[str]) -> None:
        try:
            self.store.delete(urls)
        except CheckpointError:
            pass  # left for clean_orphans

    # -- the state file ---------------------------------------------------------------------

    def read_state(self) -> CheckpointState | None:
        url = self.join(STATE_FILE)
        raw = self.store.read_small(url, 16 << 20, "the state file")
        return None if raw is None else parse_state(raw, url)

    def update_state(self, change: Callable[[CheckpointState | None], tuple[CheckpointState, T]]) -> T:
        """Apply ``change`` to the current state and write the result if nobody wrote in between;
        otherwise re-read and apply again (compare-and-swap on the state file's version).

        Raises:
            CheckpointWriteError: still conflicting after many attempts, or the store failed.
        """
        url = self.join(STATE_FILE)
        for attempt in range(_CAS_ATTEMPTS):
            raw, version = self.store.get_versioned(url)
            state, result = change(None if raw is None else self._parsed(raw, url))
            if self.store.put_if(url, dump_state(state), version):
                return result
            time.sleep(random.uniform(0, min(1.0, 0.01 * 2 ** attempt)))  # back off, jittered
        raise CheckpointWriteError(f"{url}: the state file kept changing under {_CAS_ATTEMPTS} attempts "
                                   "to update it")


class RemoteFile:
    """A committed checkpoint's data object opened for ranged reads: the
    :class:`ckpt.storage.ReadableBlob` formats read an object-store checkpoint through. The
    first and last bytes are known on open (copied in the commit record, or fetched side by side),
    so sniffing, headers, footers and small indexes cost no further request.

    ``size``: the object is a data object of this many bytes (a sharded checkpoint's shard file,
    which its record lists): no commit record is looked for, and its head and tail are fetched
    side by side (a store answering with another size is a CorruptCheckpointError).

    ``parent``: the directory it is in, whose store reads it; without one, a directory of the
    URL's parent opened with ``storage_options``. ``directory`` is that RemoteDirectory: formats
    open sibling objects (a sharded checkpoint's shard files) through its store, so they are read
    with the same options."""

    def __init__(self, url: str, parent: RemoteDirectory | None = None, size: int | None = None,
                 storage_options: _urls.StorageOptions | None = None) -> None:
        self.url = url
        parent_url, name = _urls.split(url)
        self.directory = parent if parent is not None else RemoteDirectory(parent_url, storage_options)
        if size is None:
            self.data_url, self.size, self._cache = self.directory.locate(name)
        else:
            self.data_url, self.size, self._cache = url, size, []
        first = next((len(data) for offset, data in self._cache if offset == 0), 0)
        wanted = []
        if first < min(OPEN_HEAD, self.size):
            wanted.append((0, min(OPEN_HEAD, self.size)))
        tail = max(first, self.size - OPEN_TAIL)
        if wanted and tail <= OPEN_HEAD:
            wanted = [(0, self.size)]  # a small object: one GET for all of it
        elif tail < self.size and self._cached(tail, self.size - tail) is None:
            wanted.append((tail, self.size - tail))
        if wanted:  # a plain object, or a commit record without copies (written before they existed)
            buffers = [bytearray(n) for _, n in wanted]
            self.directory.store.read_into(self.data_url, [(o, memoryview(b)) for (o, _), b in zip(wanted, buffers)],
                                           lambda i: "the checkpoint's header and index", self.size)
            self._cache += [(o, bytes(b)) for (o, _), b in zip(wanted, buffers)]
        self.head = next((data for offset, data in self._cache if offset == 0), b"")

    def _cached(self, offset: int, n: int) -> bytes | None:
        for start, data in self._cache:
            if start <= offset and offset + n <= start + len(data):
                return data[offset - start:offset - start + n]
        return None

    @property
    def name(self) -> str:
        return self.url

    def read_into(self, view: memoryview, offset: int, what: str) -> None:
        if offset + len(view) > self.size:
            raise CorruptCheckpointError(f"{self.url}: the object ends in the middle of {what} (offset "
                                         f"{self.size}): it is truncated")
        cached = self._cached(offset, len(view))
        if cached is not None:
            view[:] = cached
        else:
            self.directory.store.read_into(self.data_url, [(offset, view)], lambda i: what, self.size)

    def read_spans(self, spans: Sequence[tuple[int, memoryview]], name: Callable[[int], str]) -> list[int]:
        """Fill every span (several ranged GETs in flight) and return each one's crc32c (a big
        span's computed on the I/O pool as soon as it is filled, while the next ones arrive)."""
        fetch = []
        for i, (offset, view) in enumerate(spans):
            cached = self._cached(offset, len(view))
            if cached is not None:
                view[:] = cached
            elif offset + len(view) > self.size:
                raise CorruptCheckpointError(f"{self.url}: the object ends in the middle of {name(i)}: it is "
                                             "truncated")
            else:
                fetch.append(i)
        started: dict[int, Callable[[], int]] = {}  # checksums begun while later bytes still arrive

        def done(j: int) -> None:
            started[fetch[j]] = checksum_async(spans[fetch[j]][1])

        self.directory.store.read_into(self.data_url, [spans[i] for i in fetch], lambda j: name(fetch[j]), self.size,
                                       done)
        return [started[i]() if i in started else crc32c(view) for i, (_, view) in enumerate(spans)]

    def close(self) -> None:
        self._cache.clear()


def _pair(change: tuple[CheckpointState, list[str]]) -> tuple[CheckpointState, tuple[CheckpointState, list[str]]]:
    """``update_state``'s change result for a StateChange: the state to write, and both back."""
    return change[0], change
