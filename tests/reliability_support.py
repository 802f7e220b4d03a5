"""Shared helpers for the reliability tests (tests/test_reliability_*.py) and their child processes.

Imported by the tests (pytest puts tests/ on sys.path) and by tests/reliability_child.py,
which runs as a script in child processes. Everything here is deterministic: tensors are
built from fixed values or seeded generators, never from the clock.
"""

from __future__ import annotations

import os
import signal
import struct
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import numpy as np

import ckpt
from ckpt.formats import _io
from ckpt.formats import hdf5 as hdf5_format
from ckpt.formats import msgpack as msgpack_format
from ckpt.formats.base import open_reader

#: Environment variable multiplying every count (kills, flips, fuzz examples) for long runs;
#: tests/conftest.py sets it from ``--reliability-scale`` so child processes see it too.
SCALE_ENV = "CKPT_FUZZ_SCALE"

Tensors = list[tuple[str, np.ndarray]]


def scale() -> int:
    """The count multiplier (1 unless CKPT_FUZZ_SCALE or --reliability-scale says otherwise)."""
    try:
        return max(1, int(os.environ.get(SCALE_ENV, "1")))
    except ValueError:
        return 1


# --- tensors ------------------------------------------------------------------------------------
def small_tensors() -> Tensors:
    """A small checkpoint's worth of tensors: several dtypes, 0-d, empty, strings with NULs."""
    rng = np.random.default_rng(1234)
    return [
        ("dense/kernel", rng.standard_normal((3, 4)).astype(np.float32)),
        ("dense/bias", np.array([0.5, -1.25, 3.0, 1e-7], dtype=np.float32)),
        ("step", np.array(1234567, dtype=np.int64)),
        ("emb/bf16", np.array([1.5, -2.0, np.inf, 0.0078125], dtype=ckpt.dtypes.bfloat16)),
        ("mask", np.array([True, False, True], dtype=np.bool_)),
        ("empty", np.zeros((0, 3), dtype=np.float64)),
        ("vocab", np.array([b"alpha", b"", b"nul\x00end"], dtype=object)),
        ("z", (np.arange(2) + 1j).astype(np.complex64)),
    ]


def large_tensors() -> Tensors:
    """A larger checkpoint (about 600 KB) for truncation at random offsets."""
    rng = np.random.default_rng(99)
    out: Tensors = [(f"layers/{i}/kernel", rng.standard_normal((128, 128)).astype(np.float32))
                    for i in range(8)]
    out += [(f"layers/{i}/bias", rng.standard_normal(128).astype(np.float64)) for i in range(8)]
    out.append(("tokens", np.array([b"tok%05d" % i for i in range(500)], dtype=object)))
    return out


def step_tensors(step: int, writer: int = 0) -> dict[str, np.ndarray]:
    """Tensors whose every element encodes (writer, step): a torn checkpoint cannot hide."""
    value = writer * 1_000_000 + step
    return {
        "model/kernel": np.full((48, 64), value, dtype=np.float64),
        "model/bias": np.full(64, value, dtype=np.int64),
        "model/scale": np.array(float(value), dtype=np.float64),
        "meta/name": np.array([b"w%d-s%d" % (writer, step)] * 3, dtype=object),
    }


def step_of(values: dict[str, np.ndarray], writer: int = 0) -> int:
    """The step every tensor of ``values`` agrees on; AssertionError if they disagree."""
    step = int(values["model/bias"].reshape(-1)[0]) - writer * 1_000_000
    for key, expected in step_tensors(step, writer).items():
        if not equal_tensors(expected, values[key]):
            raise AssertionError(f"torn checkpoint: {key} = {values[key].reshape(-1)[:3]!r} disagrees "
                                 f"with model/bias (writer {writer}, step {step})")
    return step


def equal_tensors(expected: np.ndarray, actual: np.ndarray) -> bool:
    """Bit-exact equality: same dtype, shape and bytes (strings: same bytes objects)."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return False
    if expected.dtype.kind == "O":
        return actual.tolist() == expected.tolist() and \
            all(type(x) is bytes for x in actual.reshape(-1))
    return expected.tobytes() == actual.tobytes()


def sentinel_like(value: np.ndarray) -> np.ndarray:
    """A value of the same dtype and shape that differs from ``value`` wherever it can."""
    if value.dtype.kind == "O":
        return np.full(value.shape, b"sentinel", dtype=object)
    raw = value.copy()
    flat = raw.reshape(-1).view(np.uint8)
    flat ^= 0x01 if value.dtype.kind == "b" else 0x5A  # bools stay 0/1
    return raw


# --- outcomes of reading a damaged file -----------------------------------------------------------
def read_outcome(path: str, expected: Tensors) -> tuple[str, str]:
    """Open ``path``, read every expected tensor, verify; classify what happened.

    Returns (kind, detail), kind one of:
      "open-error"   a CheckpointError when opening (nothing read);
      "read-error"   a CheckpointError reading a tensor (detail starts with the key);
      "verify-error" every value equal, but verify() reports the damage;
      "equal"        every value equal and verify() clean;
      "WRONG"        a value differs from what was saved (silently wrong data).
    Any other exception propagates: it is a bug.
    """
    try:
        reader = open_reader(path)
    except ckpt.CheckpointError as exc:
        return "open-error", f"{type(exc).__name__}: {exc}"
    with reader:
        for key, value in expected:
            try:
                got = reader.read(key)
            except ckpt.CheckpointError as exc:
                return "read-error", f"{key}: {type(exc).__name__}: {exc}"
            if not equal_tensors(value, got):
                return "WRONG", f"{key}: saved {value!r}, read {got!r}"
        problems = reader.verify()
    return ("verify-error", problems[0]) if problems else ("equal", "")


def restore_outcome(path: str, expected: Tensors) -> tuple[str, str]:
    """Restore ``path`` into variables holding sentinels; check the all-or-nothing rule.

    Returns ("restored", "") when every variable got its saved value, ("unchanged", error)
    when the restore failed before touching anything, ("partial", error) when it failed
    mid-way and the touched variables are uninitialized, ("WRONG", why) otherwise.
    """
    variables = {key: ckpt.Variable(sentinel_like(value)) for key, value in expected}
    sentinels = {key: sentinel_like(value) for key, value in expected}
    try:
        ckpt.Saver(variables).restore(path)
    except ckpt.CheckpointError as exc:
        uninitialized = []
        for key, var in variables.items():
            if not var.is_initialized():
                uninitialized.append(key)
            elif not equal_tensors(sentinels[key], np.asarray(var.value())):
                return "WRONG", f"{key}: changed by a failed restore ({exc})"
        return ("partial" if uninitialized else "unchanged"), f"{type(exc).__name__}: {exc}"
    for key, value in expected:
        if not equal_tensors(value, np.asarray(variables[key].value())):
            return "WRONG", f"{key}: restored {variables[key].value()!r}, saved {value!r}"
    return "restored", ""


def data_extents(path: str) -> dict[str, list[tuple[int, int]]]:
    """key -> [(offset, nbytes)] of each tensor's checksummed bytes in an intact ckpt file."""
    with open_reader(path) as reader:
        out = {}
        for key, info in reader.tensors.items():
            if reader.format_name == "msgpack":
                out[key] = [(o, n) for o, n in info.extra[0] if n]
            else:
                out[key] = [(info.extra[0], info.nbytes)] if info.nbytes else []
        return out


def reaches_libhdf5(data: bytes) -> bool:
    """True when ckpt would hand these bytes to libhdf5 (an HDF5 file without ckpt's index).

    libhdf5 may crash or hang on damaged input, so such cases run in a child process.
    """
    return not data.startswith(hdf5_format.MAGIC) and \
        hdf5_format.Hdf5Format().sniff(data[:4096]) and not data.startswith(msgpack_format.HEADER_PREFIX)


class Hang(Exception):
    """A guarded operation ran past its time limit."""


@contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Fail with Hang if the block runs longer than ``seconds`` (pure-Python code, main thread)."""
    def expire(signum: int, frame: Any) -> None:
        raise Hang(f"{what}: still running after {seconds} s (a hang)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# --- editing files with their checksums fixed up ------------------------------------------------
def packb(obj: Any) -> bytes:
    """msgpack bytes the way ckpt writes them."""
    import msgpack

    return msgpack.packb(obj, use_bin_type=True)


def unpackb(raw: bytes) -> Any:
    import msgpack

    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


def splice(packed: bytes, placeholder: str, raw: bytes) -> bytes:
    """Replace the msgpack encoding of the string ``placeholder`` with arbitrary bytes ``raw``.

    Lets a test put what no msgpack packer would write (invalid UTF-8, absurd lengths,
    deep nesting) at a chosen place in an otherwise normal index.
    """
    token = packb(placeholder)
    assert packed.count(token) == 1, placeholder
    return packed.replace(token, raw)


def msgpack_split(raw: bytes) -> tuple[int, dict[str, Any]]:
    """(index offset, decoded index) of an intact ckpt msgpack file."""
    fields = msgpack_format._FOOTER.unpack(raw[-msgpack_format.FOOTER_SIZE:])
    offset, length = fields[4], fields[6]
    return offset, unpackb(raw[offset:offset + length])


def msgpack_rebuild(raw: bytes, index: bytes, *, offset: int | None = None, length: int | None = None,
                    crc: int | None = None) -> bytes:
    """A msgpack checkpoint with the payload of ``raw`` and a new index (valid footer by default)."""
    start, _ = msgpack_split(raw)
    footer = msgpack_format._FOOTER.pack(
        0x94, b"\xc4\x08", msgpack_format.FOOTER_MAGIC, 0xCF, start if offset is None else offset,
        0xCF, len(index) if length is None else length, 0xCE, _io.crc32c(index) if crc is None else crc)
    return raw[:start] + index + footer


def hdf5_split(raw: bytes) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(header fields, decoded index) of an intact ckpt HDF5 file."""
    head = hdf5_format._HEADER.unpack(raw[:hdf5_format._HEADER.size])
    index_len = head[3]
    return head, unpackb(raw[hdf5_format._HEADER.size:hdf5_format._HEADER.size + index_len])


def hdf5_rebuild(raw: bytes, index: bytes, *, version: int | None = None, userblock: int | None = None,
                 index_len: int | None = None, index_crc: int | None = None,
                 header_crc: int | None = None) -> bytes:
    """A ckpt HDF5 file with a new index in its user block, header checksums fixed up by default."""
    old_head, _ = hdf5_split(raw)
    block = old_head[2]
    if hdf5_format._HEADER.size + len(index) > block:
        raise ValueError(f"an index of {len(index)} bytes does not fit the {block}-byte user block")
    head = hdf5_format._HEADER.pack(hdf5_format.MAGIC, hdf5_format.VERSION if version is None else version,
                                    block if userblock is None else userblock,
                                    len(index) if index_len is None else index_len,
                                    _io.crc32c(index) if index_crc is None else index_crc, 0)
    crc = _io.crc32c(head[:-4]) if header_crc is None else header_crc
    head = head[:-4] + struct.pack("<I", crc)
    user = (head + index).ljust(block, b"\x00")
    return user + raw[block:]


def write_checkpoint(path: str, tensors: Sequence[tuple[str, np.ndarray]],
                     metadata: dict[str, Any] | None = None) -> bytes:
    """Save ``tensors`` with a Saver at ``path`` and return the file's bytes."""
    variables = {key: ckpt.Variable(value) for key, value in tensors}
    ckpt.Saver(variables, max_to_keep=None).save(path, metadata=metadata)
    with open(path, "rb") as f:
        return f.read()
