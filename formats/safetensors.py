"""safetensors files (.safetensors), read and written without the safetensors package.

Layout: an 8-byte little-endian header length N; N bytes of JSON, starting with "{" and
maybe padded with spaces: ``{"__metadata__": {str: str}, key: {"dtype": "F32", "shape": [2, 3],
"data_offsets": [begin, end]}, ...}``; then the data buffer, offsets relative to its start.
The reader enforces the format's rules: N at most 100 MB and inside the file, every
tensor's size equal to dtype size x shape, the tensors covering the buffer exactly (no
holes, no overlaps, nothing after the last), no duplicate keys.

Files carry no checksums. ckpt adds them when it writes: ``__metadata__`` then holds
"ckpt_crc32c" (a JSON map key -> crc32c of the tensor's bytes, verified on every read),
"ckpt_metadata" (the checkpoint's metadata as JSON) and "ckpt_header_crc32c" (the crc32c of
the header's meaning: every key, dtype, shape and data_offsets, every ``__metadata__`` entry
but this one, and the header length; verified on open), next to "format": "np". A file with
any "ckpt_" field in ``__metadata__`` is ckpt's own: if any of the three is missing or wrong,
it is damaged, never read as an unchecksummed foreign file.

Example:
    >>> import numpy as np, tempfile, os
    >>> from ckpt.formats.builtin import SafetensorsFormat
    >>> path = os.path.join(tempfile.mkdtemp(), "t.safetensors")
    >>> open(path, "wb").close()
    >>> SafetensorsFormat().write(path, [("fc1.weight", np.ones((2, 3), np.float32))], {"step": 3})
    >>> with SafetensorsFormat().open(path) as r:
    ...     r.read("fc1.weight").shape, r.metadata, r.checksummed
    ((2, 3), {'step': 3}, True)
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ckpt import dtypes
from ckpt.errors import CorruptCheckpointError, UnsupportedCheckpointError, checksum_error
from ckpt.storage import WritableBlob

from . import _blocks, _io
from ._foreign import NUMPY_DTYPES, check_key, json_int
from ._writing import checked_checksums
from .base import FileReader, TensorInfo, materialize, source_chunks, unique_pairs

#: The reference implementation's limit on the header length.
MAX_HEADER = 100_000_000
_N = struct.Struct("<Q")
_MAX_CRC = 2 ** 32 - 1  # the widest checksum, for planning the header's size
#: ckpt's fields in ``__metadata__``: all present in a file ckpt wrote.
_CKPT_FIELDS = ("ckpt_metadata", "ckpt_crc32c", "ckpt_header_crc32c")
#: safetensors dtype codes, in the order of the format's Dtype enum (increasing alignment):
#: the writer orders tensors by it, as safetensors does, so every tensor stays aligned.
_CODES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "F8_E5M2": NUMPY_DTYPES["float8_e5m2"], "F8_E4M3": NUMPY_DTYPES["float8_e4m3fn"],
    "F8_E8M0": NUMPY_DTYPES["float8_e8m0fnu"], "F8_E4M3FNUZ": NUMPY_DTYPES["float8_e4m3fnuz"],
    "F8_E5M2FNUZ": NUMPY_DTYPES["float8_e5m2fnuz"], "I16": np.dtype(np.int16),
    "U16": np.dtype(np.uint16), "F16": np.dtype(np.float16), "BF16": dtypes.bfloat16,
    "I32": np.dtype(np.int32), "U32": np.dtype(np.uint32), "F32": np.dtype(np.float32),
    "C64": np.dtype(np.complex64), "F64": np.dtype(np.float64), "I64": np.dtype(np.int64),
    "U64": np.dtype(np.uint64),
}
_RANK = {code: i for i, code in enumerate(_CODES)}
_CODE_OF = {dt: code for code, dt in _CODES.items()}
#: Element types narrower than a byte, which numpy cannot hold packed.
_SUB_BYTE = ("F4", "F6_E2M3", "F6_E3M2")


def write_safetensors(blob: WritableBlob, tensors: Sequence[tuple[str, Any]], metadata: Mapping[str, Any]) -> None:
    """Write the header, then every tensor's bytes straight from its buffer (lazy sources one at
    a time); the checksums, known only then, go into the header, padded to its planned size.
    The header's place is reserved by the first write (the blob's head), filled in last. Keys
    and metadata come validated (``WritableFormat.write_blob``)."""
    path = blob.name
    plans = []
    for key, source in tensors:
        dtype = np.dtype(source.dtype)
        code = _CODE_OF.get(dtype)
        if code is None:
            raise UnsupportedCheckpointError(
                f"{path}: tensor {key!r} is {dtypes.dt_name_or_none(dtype) or dtype}, which "
                f"safetensors cannot store (it stores {', '.join(_CODES)})")
        plans.append((code, key, dtype, tuple(source.shape), source))
    plans.sort(key=lambda p: (-_RANK[p[0]], p[1]))
    layout: dict[str, Any] = {}
    pos = 0
    for code, key, dtype, shape, _ in plans:
        nbytes = _io.expected_nbytes(dtype, shape)
        layout[key] = {"dtype": code, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes

    def header(crcs: dict[str, int], length: int | None) -> bytes:
        meta = {"format": "np", "ckpt_metadata": json.dumps(metadata), "ckpt_crc32c": json.dumps(crcs)}
        head = {"__metadata__": meta, **layout}
        meta["ckpt_header_crc32c"] = str(_MAX_CRC if length is None else _header_crc(head, length))
        return json.dumps(head, separators=(",", ":")).encode("utf-8")

    size = len(header({key: _MAX_CRC for _, key, *_ in plans}, None))  # the widest checksums
    size += -(size + _N.size) % 8  # data starts 8-byte aligned
    crcs = {}
    pos = _N.size + size  # the header is written last, into the head reserved here
    blob.write_at(bytes(pos), 0)
    runs = _io.Runs(blob)  # small tensors back to back: one pwritev per run
    for _, key, dtype, shape, source in plans:
        stream = source_chunks(source)
        if stream is not None:  # a streaming source: its bytes pass through in chunks
            runs.flush()  # chunks come from reused buffers: written at once, after what precedes them
            nbytes = _io.expected_nbytes(dtype, shape)
            running, done = _blocks.RunningChecksums(max(1, nbytes)), 0  # one block: the tensor's crc32c
            known = checked_checksums(source, max(1, nbytes))  # a converted tensor's, checked as it streams
            for view in stream:
                if known is None:
                    _io.write_checked(blob, view, pos + done, running.update)
                else:
                    blob.write_at(view, pos + done)
                done += len(view)
            if done != _io.expected_nbytes(dtype, shape):
                raise ValueError(f"{path}: tensor {key!r} gave {done} bytes; its dtype and shape hold "
                                 f"{_io.expected_nbytes(dtype, shape)}")
            crcs[key] = (running.result() if known is None else known)[0]
            pos += done
            continue
        if not isinstance(source, np.ndarray):
            runs.flush()  # earlier tensors are written before a lazy source is read
        arr = _io.c_contiguous(materialize(source))
        if arr.dtype != dtype or arr.shape != shape:
            raise ValueError(f"{path}: tensor {key!r} gave {arr.dtype} {arr.shape}, it declared "
                             f"{dtype} {shape}")
        view = _io.byte_view(arr)
        checksum = _io.checksum_async(view)  # overlaps with the write below
        runs.write(view, pos, arr is source)  # the caller's own array is lent to the blob
        pos += len(view)
        crcs[key] = checksum()
    runs.flush()
    blob.write_at(_N.pack(size) + header(crcs, size).ljust(size), 0)  # safetensors pads headers with spaces


class SafetensorsReader(FileReader):
    """Reads the header on open; tensors on request, straight into the caller's buffer."""

    format_name = "safetensors"

    def _open(self) -> None:
        path, size = self.path, self._source.size
        if size < _N.size:
            raise CorruptCheckpointError(f"{path}: {size} bytes is too short for a safetensors file")
        (n,) = _N.unpack(_io.pread(self._source, 0, _N.size, "the header length"))
        if n > MAX_HEADER:
            raise CorruptCheckpointError(f"{path}: the header length is {n} bytes; safetensors allows at "
                                         f"most {MAX_HEADER}")
        if _N.size + n > size:
            raise CorruptCheckpointError(f"{path}: the header length is {n} bytes but the file has only "
                                         f"{size - _N.size} after it: it is truncated")
        raw = _io.pread(self._source, _N.size, n, "the header")
        header = _parse_header(raw, path)
        meta = header.get("__metadata__")
        if meta is not None and (not isinstance(meta, dict) or
                                 not all(isinstance(v, str) for v in meta.values())):
            raise CorruptCheckpointError(f"{path}: __metadata__ must map strings to strings")
        if meta is not None and any(k.startswith("ckpt_") for k in meta):  # ckpt wrote it: check first
            _check_header_crc(header, meta, n, path)
        header.pop("__metadata__", None)
        self._data_start = _N.size + n
        self._tensors = {}
        for key, spec in header.items():
            self._tensors[key] = _parse_entry(check_key(key, path), spec, path)
        _check_coverage(self._tensors, size - self._data_start, path)
        self._metadata, self._crcs = _ckpt_fields(meta or {}, self._tensors, path)
        self.checksummed = self._crcs is not None

    def data_extents(self, key: str) -> list[tuple[int, int]] | None:
        info = self.info(key)
        return [(self._data_start + info.extra, info.nbytes)]

    def stored_crc32c(self, key: str) -> int | None:
        self.info(key)  # a KeyNotFoundError for a key it does not hold
        return None if self._crcs is None else self._crcs[key]

    def _read_into(self, info: TensorInfo, out: np.ndarray) -> None:
        view = _io.byte_view(out)
        self._source.read_into(view, self._data_start + info.extra, f"tensor {info.key!r}")
        if self._crcs is not None:
            self._check(info.key, _io.crc32c(view))

    def _check(self, key: str, got: int) -> None:
        expected = self._crcs[key] if self._crcs is not None else got
        if got != expected:
            raise checksum_error(self.path, f"tensor {key!r}", got, expected, key=key)

    def verify(self, progress: Callable[[int], None] | None = None) -> list[str]:
        if self._crcs is None:
            return super().verify(progress)
        problems = []
        for key, info in self._tensors.items():
            try:
                self._check(key, _io.checksum_range(self._source, self._data_start + info.extra, info.nbytes,
                                                    f"tensor {key!r}"))
            except CorruptCheckpointError as exc:
                problems.append(str(exc))
            if progress is not None:
                progress(info.nbytes)
        return problems



def _parse_header(raw: bytes, path: str) -> dict[str, Any]:
    if not raw.startswith(b"{"):
        raise CorruptCheckpointError(f"{path}: the header does not start with '{{': not a safetensors file")

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_pairs, parse_constant=no_constant,
                            parse_int=json_int)
    except (ValueError, RecursionError) as exc:  # includes UnicodeDecodeError and JSONDecodeError
        raise CorruptCheckpointError(f"{path}: the header is not valid: {exc}") from exc
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: the header is not a JSON object")
    return header


def _parse_entry(key: str, spec: Any, path: str) -> TensorInfo:
    if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= spec.keys():
        raise CorruptCheckpointError(f"{path}: tensor {key!r} needs dtype, shape and data_offsets")
    code, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if code in _SUB_BYTE:
        raise UnsupportedCheckpointError(f"{path}: tensor {key!r} is {code}, packed narrower than a "
                                         "byte; ckpt reads byte-sized element types only")
    if code not in _CODES:
        raise CorruptCheckpointError(f"{path}: tensor {key!r} has unknown dtype {code!r}")
    if not isinstance(shape, list) or len(shape) > 64 or \
            not all(type(d) is int and 0 <= d < 2 ** 63 for d in shape):
        raise CorruptCheckpointError(f"{path}: tensor {key!r} has an invalid shape {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or \
            not all(type(x) is int and 0 <= x for x in offsets) or offsets[0] > offsets[1]:
        raise CorruptCheckpointError(f"{path}: tensor {key!r} has invalid data_offsets {offsets!r}")
    dtype = _CODES[code]
    nbytes = _io.expected_nbytes(dtype, tuple(shape))
    if offsets[1] - offsets[0] != nbytes:
        raise CorruptCheckpointError(
            f"{path}: tensor {key!r}: {code} {shape} needs {nbytes} bytes, its data_offsets "
            f"{offsets} hold {offsets[1] - offsets[0]}")
    return TensorInfo(key, dtype, tuple(shape), nbytes, offsets[0])


def _check_coverage(tensors: dict[str, TensorInfo], data_size: int, path: str) -> None:
    """The tensors must tile the data buffer exactly, as the format requires."""
    pos, previous = 0, None
    for info in sorted(tensors.values(), key=lambda i: (i.extra, i.nbytes)):
        if info.extra != pos:
            what = (f"overlaps {previous!r}" if info.extra < pos else
                    f"leaves a hole of {info.extra - pos} bytes after {previous!r}" if previous else
                    f"starts at {info.extra}, not at 0")
            raise CorruptCheckpointError(f"{path}: tensor {info.key!r} {what}: the data_offsets are "
                                         "not contiguous")
        pos, previous = pos + info.nbytes, info.key
    if pos != data_size:
        raise CorruptCheckpointError(
            f"{path}: the tensors cover {pos} bytes but the file holds {data_size} bytes of data: it is "
            f"{'truncated' if pos > data_size else 'followed by unindexed bytes'}")


def _header_crc(header: dict[str, Any], length: int) -> int:
    """crc32c of what a header means: its entries and ``__metadata__`` but the crc itself, and
    its length, in one canonical JSON form (key order and padding do not matter)."""
    meta = {k: v for k, v in header.get("__metadata__", {}).items() if k != "ckpt_header_crc32c"}
    canonical = json.dumps([length, {**header, "__metadata__": meta}], sort_keys=True, separators=(",", ":"))
    return _io.crc32c(canonical.encode("utf-8"))


def _check_header_crc(header: dict[str, Any], meta: dict[str, str], length: int, path: str) -> None:
    """A header carrying ckpt's marks must carry all of them, and its meaning must match its crc."""
    missing = [k for k in _CKPT_FIELDS if k not in meta]
    if missing:
        raise CorruptCheckpointError(
            f"{path}: __metadata__ has ckpt's fields but lacks {', '.join(missing)}: the header was "
            "damaged or edited after ckpt wrote it")
    stored, got = meta["ckpt_header_crc32c"], _header_crc(header, length)
    if stored != str(got):
        expected = int(stored) if stored.isdigit() and len(stored) < 11 else repr(stored)
        raise checksum_error(path, "the header", got, expected,
                             cause="names, dtypes, shapes, offsets or metadata were damaged or edited after ckpt "
                                   "wrote it")


def _ckpt_fields(meta: dict[str, str], tensors: dict[str, TensorInfo], path: str,
                 ) -> tuple[dict[str, Any], dict[str, int] | None]:
    """(metadata, checksums): ckpt's own fields when ckpt wrote the file, else the string map."""
    if "ckpt_crc32c" not in meta:
        return dict(meta), None
    try:
        crcs = json.loads(meta["ckpt_crc32c"])
        metadata = json.loads(meta["ckpt_metadata"])
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{path}: ckpt's checksums or metadata in __metadata__ are not "
                                     "JSON") from exc
    if not isinstance(metadata, dict) or not isinstance(crcs, dict) or crcs.keys() != tensors.keys() or \
            not all(type(c) is int and 0 <= c < 2 ** 32 for c in crcs.values()):
        raise CorruptCheckpointError(f"{path}: ckpt's checksums in __metadata__ do not match the tensors")
    return metadata, crcs
