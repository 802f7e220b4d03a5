"""Commit records: the small JSON object ``<dir>/<name>`` whose create-only write commits an
object-store checkpoint, naming its data object under ``.ckpt-data/<name>/<token>`` (with copies
of the data's head and tail, so opening the checkpoint costs no GET of the data); built and
parsed here only (internal; the protocol is in ``ckpt.storage.remote``).

Example:
    >>> is_commit_record(commit_record(".ckpt-data/m.msgpack/abc", 10))
    True
    >>> parse_commit(commit_record(".ckpt-data/m.msgpack/abc", 10), "s3://b/run/m.msgpack").data
    '.ckpt-data/m.msgpack/abc'
"""

from __future__ import annotations

import base64
import json
import os
import time
from typing import Any, NamedTuple

from ckpt.checksums import crc32c
from ckpt.errors import CorruptCheckpointError
from ckpt.storage import urls as _urls

__all__ = ["COMMIT_LIMIT", "DATA_DIR", "SHARDED_COMMIT", "Commit", "commit_record", "is_commit_record",
           "parse_commit", "token_age", "unique_token"]

#: The commit record's name inside a sharded checkpoint (a directory, or a data prefix): the
#: stores delete it first and look for it; its bytes are ``ckpt.formats.ckpt_sharded``'s.
SHARDED_COMMIT = "COMMIT"
#: The folder of a directory's data objects.
DATA_DIR = ".ckpt-data"
_COMMIT_FORMAT, _COMMIT_VERSION = "ckpt-commit", 1
_COMMIT_PREFIX = b'{"format": "ckpt-commit"'
#: Commit records are never longer than this (a longer object is not one).
COMMIT_LIMIT = 1 << 20


def commit_record(data: str, size: int, head: bytes = b"", tail: bytes = b"", name: str | None = None,
                  step: int | None = None) -> bytes:
    """The commit record of checkpoint ``name`` (its ``step``, if any) naming ``data`` (relative
    to the directory), ``size`` bytes long, with copies of its first bytes ``head`` and last bytes
    ``tail`` (and their crc32c). ``name`` defaults to the one in ``data`` (".ckpt-data/<name>/...")."""
    if len(head) + len(tail) > size:
        raise ValueError("the head and tail of a data object overlap")
    doc: dict[str, object] = {"format": _COMMIT_FORMAT, "version": _COMMIT_VERSION,
                              "name": name if name is not None else data.split("/")[1], "step": step,
                              "data": data, "size": size, "time": time.time()}
    if head or tail:
        doc.update(head=base64.b64encode(head).decode(), tail=base64.b64encode(tail).decode(),
                   crc32c=crc32c(head + tail))
    return json.dumps(doc).encode()


def is_commit_record(head: bytes) -> bool:
    """True when the bytes at the start of an object are a commit record."""
    return head.startswith(_COMMIT_PREFIX)


class Commit(NamedTuple):
    """A parsed commit record: its data object (relative to the directory), the data's size,
    ``[(offset, copied bytes)]`` of the data's head and tail (none in records without), and the
    step it commits (None: saved without a step, or a record written before steps were recorded)."""

    data: str
    size: int
    copies: list[tuple[int, bytes]]
    step: int | None


def parse_commit(raw: bytes, url: str) -> Commit:
    """The commit record ``raw`` read at ``url``, checked to be the one of that name: its
    ``name`` (records of ckpt < 0.2 have none) and its data object (always under
    ".ckpt-data/<name>/") must both be the name in ``url``, or the record was copied over
    another checkpoint's or edited to point at another checkpoint's data."""
    try:
        doc = json.loads(raw)
    except ValueError:
        raise CorruptCheckpointError(f"{url}: the commit record is not valid JSON") from None
    if not _well_formed(doc):
        raise CorruptCheckpointError(f"{url}: malformed commit record")
    data, size = doc["data"], doc["size"]
    if doc["version"] > _COMMIT_VERSION:
        raise CorruptCheckpointError(f"{url}: commit record version {doc['version']} is newer than this "
                                     f"ckpt reads ({_COMMIT_VERSION}): upgrade ckpt")
    _check_bound(doc, data, url)
    step = doc.get("step")
    if "head" not in doc and "tail" not in doc:
        return Commit(data, size, [], step)
    try:
        head, tail = base64.b64decode(doc["head"], validate=True), base64.b64decode(doc["tail"], validate=True)
    except (KeyError, TypeError, ValueError):
        raise CorruptCheckpointError(f"{url}: malformed commit record (its copy of the data's head and "
                                     "tail)") from None
    if len(head) + len(tail) > size or doc.get("crc32c") != crc32c(head + tail):
        raise CorruptCheckpointError(f"{url}: the commit record's copy of the data's head and tail does not "
                                     "match its crc32c (or its size): the record is damaged")
    return Commit(data, size, [(offset, copy) for offset, copy in ((0, head), (size - len(tail), tail)) if copy],
                  step)


def _well_formed(doc: Any) -> bool:
    """Whether a parsed commit record has its fields, of their types (``data`` a clean relative
    name under DATA_DIR, never a way out of the directory)."""
    if not isinstance(doc, dict):
        return False
    data, size, step = doc.get("data"), doc.get("size"), doc.get("step")
    return type(doc.get("version")) is int and isinstance(data, str) and type(size) is int and size >= 0 and \
        data.startswith(DATA_DIR + "/") and all(part not in ("", ".", "..") for part in data.split("/")) and \
        (step is None or type(step) is int) and isinstance(doc.get("name", ""), str)


def _check_bound(doc: dict[str, Any], data: str, url: str) -> None:
    """Refuse a record that commits another checkpoint than the one at ``url``."""
    name = _urls.split(url)[1]
    recorded, owner = doc.get("name", name), data.split("/")[1]
    if recorded != name or owner != name:
        other = recorded if recorded != name else owner
        raise CorruptCheckpointError(
            f"{url}: the commit record is not {name}'s: it commits {other} (data object {data}); a commit "
            "record was copied over this one or edited, and reading it would give another checkpoint's values")


def unique_token() -> str:
    """A unique data-object name that starts with the save's start time (ms, hex)."""
    return f"{int(time.time() * 1000):012x}-{os.urandom(8).hex()}"


def token_age(token: str) -> float | None:
    """Seconds since the save that made ``token`` started (None: not a token of ours)."""
    try:
        return time.time() - int(token.split("-", 1)[0], 16) / 1000
    except ValueError:
        return None
