"""Shared helpers for the reliability tests (tests/test_reliability_*.py) and their child processes.

Imported by the tests (pytest puts tests/ on sys.path) and by tests/reliability_child.py,
which runs as a script in child processes. Everything here is deterministic: tensors are
built from fixed values or seeded generators, never from the clock.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import struct
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

import ckpt
from ckpt.formats import _io
from ckpt.storage.localfile import pwrite_all
from ckpt.formats import hdf5 as hdf5_format
from ckpt.formats import msgpack as msgpack_format
from ckpt.formats.builtin import Hdf5Format
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


def frozen_tensors() -> dict[str, np.ndarray]:
    """Tensors no step changes (a frozen backbone): incremental checkpoints share their chunks."""
    rng = np.random.default_rng(2024)
    return {"frozen/table": rng.standard_normal((64, 256)).astype(np.float32)}


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


class Restorer:
    """Variables holding sentinels, restored from damaged files to check all-or-nothing.

    Reused across cases (creating variables costs more than restoring small ones).
    """

    def __init__(self, expected: Tensors) -> None:
        self.expected = expected
        self.sentinels = {key: sentinel_like(value) for key, value in expected}
        self.variables = {key: ckpt.Variable(value) for key, value in self.sentinels.items()}
        self.saver = ckpt.Saver(self.variables)

    def outcome(self, path: str) -> tuple[str, str]:
        """Restore ``path``; return ("restored", ""), ("unchanged", error), ("partial", error)
        (failed mid-way, every touched variable uninitialized) or ("WRONG", why)."""
        for key, var in self.variables.items():
            var.assign(self.sentinels[key])
        try:
            self.saver.restore(path)
        except ckpt.CheckpointError as exc:
            uninitialized = []
            for key, var in self.variables.items():
                if not var.is_initialized():
                    uninitialized.append(key)
                elif not equal_tensors(self.sentinels[key], np.asarray(var.value())):
                    return "WRONG", f"{key}: changed by a failed restore ({exc})"
            return ("partial" if uninitialized else "unchanged"), f"{type(exc).__name__}: {exc}"
        for key, value in self.expected:
            if not equal_tensors(value, np.asarray(self.variables[key].value())):
                return "WRONG", f"{key}: restored {self.variables[key].value()!r}, saved {value!r}"
        return "restored", ""


def restore_outcome(path: str, expected: Tensors) -> tuple[str, str]:
    """Restore ``path`` into fresh variables holding sentinels (see Restorer.outcome)."""
    return Restorer(expected).outcome(path)


def overwrite(path: str, data: bytes) -> None:
    """Make ``path`` hold exactly ``data`` (cheaper than truncating to zero on ext4 with discard)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        pwrite_all(fd, data, 0) if data else None
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def data_extents(raw: bytes) -> dict[str, list[tuple[int, int]]]:
    """key -> [(offset, nbytes)] of each tensor's checksummed bytes, from the documented index."""
    if raw.startswith(hdf5_format.MAGIC):
        _, index = hdf5_split(raw)
        return {e[0]: [(e[3], e[4])] if e[4] else [] for e in index["tensors"]}
    _, index = msgpack_split(raw)
    return {key: [(o, n) for o, n in entry[2] if n] for key, entry in index["tensors"].items()}


def reaches_libhdf5(data: bytes) -> bool:
    """True when ckpt would hand these bytes to libhdf5 (an HDF5 file without ckpt's index).

    libhdf5 may crash or hang on damaged input, so such cases run in a child process.
    """
    return not data.startswith(hdf5_format.MAGIC) and \
        Hdf5Format().sniff(data[:4096]) and not msgpack_format.is_ckpt_msgpack(data)


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


def safetensors_split(raw: bytes) -> tuple[int, dict[str, Any]]:
    """(header length, decoded header) of a safetensors file."""
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n])


def safetensors_rebuild(raw: bytes, header: dict[str, Any]) -> bytes:
    """``raw`` with a new JSON header, padded with spaces to the old header's length (or, when
    longer, to the next multiple of 8; data offsets count from the data, so they still hold)."""
    n, _ = safetensors_split(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    size = n if len(text) <= n else len(text) + (-len(text) % 8)
    return struct.pack("<Q", size) + text.ljust(size) + raw[8 + n:]


def write_checkpoint(path: str, tensors: Sequence[tuple[str, np.ndarray]],
                     metadata: dict[str, Any] | None = None) -> bytes:
    """Save ``tensors`` with a Saver at ``path`` and return the file's bytes."""
    variables = {key: ckpt.Variable(value) for key, value in tensors}
    ckpt.Saver(variables, max_to_keep=None).save(path, metadata=metadata)
    with open(path, "rb") as f:
        return f.read()


# --- running many damaged files -----------------------------------------------------------------
@dataclass
class Case:
    """One damaged file and what reading it may end in."""

    label: str
    data: bytes
    #: allowed read_outcome kinds ("WRONG" is never allowed)
    expect: frozenset[str]
    #: for damage inside tensor data: the tensor whose checksum must catch it
    key: str | None = None
    region: str = ""


ANY = frozenset({"open-error", "read-error", "verify-error", "equal"})
OPEN = frozenset({"open-error"})
#: which restore outcomes go with which read outcome (all-or-nothing)
RESTORE_FOR = {"open-error": {"unchanged"}, "read-error": {"unchanged", "partial"},
               "verify-error": {"restored"}, "equal": {"restored"}}
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reliability_child.py")


def check_result(case: Case, kind: str, detail: str, restored: str, why: str) -> None:
    """Raise AssertionError (naming the case) unless the outcome obeys every rule."""
    where = f"{case.label} [{case.region}]"
    assert kind != "EXCEPTION", f"{where}: not a CheckpointError: {detail}"
    assert kind in case.expect, f"{where}: {kind} ({detail}); expected one of {sorted(case.expect)}"
    assert restored in RESTORE_FOR[kind], f"{where}: reading gave {kind} but restoring gave {restored} ({why})"
    if case.key is not None:  # damage in a tensor's data is caught by that tensor's checksum
        assert detail.startswith(f"{case.key}: ") and "checksum" in detail, f"{where}: {detail}"


def run_cases(directory: str, pristine: str, expected: Tensors, cases: Sequence[Case],
              per_case_seconds: float = 10.0) -> collections.Counter:
    """Read every case (in a child process when it could reach libhdf5); check the rules.

    Returns a Counter of (region, outcome): what each part of the file did when damaged.
    """
    counts: collections.Counter = collections.Counter()
    isolated = []
    path = os.path.join(directory, "case" + os.path.splitext(pristine)[1])
    restorer = Restorer(expected)
    for case in cases:
        if reaches_libhdf5(case.data):
            isolated.append(case)
            continue
        overwrite(path, case.data)
        with time_limit(per_case_seconds, case.label):
            kind, detail = read_outcome(path, expected)
            restored, why = restorer.outcome(path)
        check_result(case, kind, detail, restored, why)
        counts[case.region, kind] += 1
    if isolated:
        for (region, kind) in run_isolated(directory, pristine, isolated, per_case_seconds):
            counts[region, kind] += 1
    return counts


def run_isolated(directory: str, pristine: str, cases: Sequence[Case],
                 per_case_seconds: float) -> list[tuple[str, str]]:
    """Run cases that reach libhdf5 in a child process: a crash or hang fails, naming the case."""
    specs = []
    for i, case in enumerate(cases):
        path = os.path.join(directory, f"isolated-{i}.h5")
        overwrite(path, case.data)
        specs.append({"path": path, "pristine": pristine})
    spec_path = os.path.join(directory, "isolated.json")
    with open(spec_path, "w") as f:
        json.dump(specs, f)
    proc = subprocess.Popen([sys.executable, CHILD, "cases", spec_path], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, cwd=os.path.dirname(CHILD))
    out, current = [], "start-up"
    try:
        lines = _lines(proc, per_case_seconds + 20)  # + the child's start-up
        for line in lines:
            if line.startswith("start "):
                current = cases[int(line.split()[1])].label
                continue
            result = json.loads(line)
            case = cases[result["i"]]
            check_result(case, result["kind"], result["detail"], result["restore"], result["restore_detail"])
            out.append((case.region, result["kind"]))
    except TimeoutError:
        proc.kill()
        raise AssertionError(f"libhdf5 child process hung reading {current!r}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
    if len(out) < len(cases):
        raise AssertionError(f"libhdf5 child process ended (code {proc.returncode}) while reading "
                             f"{current!r}: a crash")
    return out


def _lines(proc: subprocess.Popen, timeout: float) -> Iterator[str]:
    """The child's output lines; TimeoutError when none arrives within ``timeout`` seconds."""
    import select

    fd, buffer = proc.stdout.fileno(), b""
    while True:
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield line.decode()
        if not select.select([fd], [], [], timeout)[0]:
            raise TimeoutError
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return
        buffer += chunk
