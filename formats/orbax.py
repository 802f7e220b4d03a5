"""orbax-checkpoint directories (JAX's checkpointer), read without jax, orbax or tensorstore.

A ``PyTreeCheckpointHandler`` / ``StandardCheckpointer`` save is a directory: ``_METADATA``
(JSON: each leaf's pytree path and value type) and one zarr v2 array per leaf, named by the path
joined with "." ("params.dense.kernel": ``.zarray`` plus chunks "0.0", "0.1", ...). With OCDBT
(orbax's default) those arrays live as keys in tensorstore's OCDBT database (``manifest.ocdbt``,
``d/`` and ``ocdbt.process_N/d/`` data files; :mod:`ckpt.formats._ocdbt`); without it
(``use_ocdbt=False``) as files. A ``CheckpointManager`` directory holds one directory per step
("1", "2", ...), each holding its items ("default", or the names given to ``Composite``); opening
it opens the latest finished step.

Keys are the pytree paths joined with "/": "params/dense/kernel", "layers/0". Chunks are
decompressed with zstd (orbax's default; the optional ``zstandard`` package, ``pip install
"ckpt-numpy[orbax]"``) or zlib/gzip, or read as they are; each chunk's decompressed size must be exactly
the chunk's, and memory never exceeds one chunk beyond the result.

Example:
    >>> import ckpt
    >>> ckpt.list_variables("run/checkpoints")  # doctest: +SKIP
    [('flag', [2]), ('ids', [6]), ('params/dense/bias', [4]), ...]
"""

from __future__ import annotations

import itertools
import os
import re
import zlib
from typing import Any
from collections.abc import Callable, Sequence

import numpy as np

from ckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedCheckpointError

from ._foreign import MAX_JSON, NUMPY_DTYPES, parse_json, read_json
from ._slicing import check_box
from ._zstd import zstd_bytes
from .base import BaseReader, TensorInfo, check_shape, key_problem

METADATA = "_METADATA"
MANIFEST = "manifest.ocdbt"
#: A chunk may decompress to at most this many times its stored size (zstd's best is ~43000:1).
MAX_RATIO = 1 << 16
_STEP = re.compile(r"\d+")
#: zarr v2 dtype strings -> dtypes ("<f4", "|b1", "bfloat16", "float8_e4m3fn", ...)
_ZARR_DTYPES: dict[str, np.dtype] = {}
for _name, _dtype in NUMPY_DTYPES.items():
    if _dtype.kind in "biufc" and not _name.startswith(("bfloat16", "float8")):
        _ZARR_DTYPES[_dtype.str] = _dtype
        _ZARR_DTYPES["<" + _dtype.str[1:]] = _dtype  # 1-byte types are also written "<i1"
        _ZARR_DTYPES["|" + _dtype.str[1:]] = _dtype
    else:
        _ZARR_DTYPES[_name] = _dtype


def is_orbax(path: str) -> bool:
    return os.path.isdir(path) and (_is_item(path) or _items(path) != [] or _latest_step(path) is not None)


def open_orbax(path: str) -> OrbaxReader:
    step = path
    if not _is_item(path) and not _items(path):
        latest = _latest_step(path)
        if latest is None:
            raise CheckpointNotFoundError(f"{path}: no finished orbax checkpoint step in this directory")
        step = os.path.join(path, latest)
    items = [step] if _is_item(step) else _items(step)
    if not items:
        raise CheckpointNotFoundError(f"{step}: no orbax checkpoint ({METADATA}) in this directory")
    return OrbaxReader(step, items)


def _is_item(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA))


def _items(step: str) -> list[str]:
    """A step directory's pytree items ("default", or Composite's names), sorted."""
    try:
        names = sorted(os.listdir(step))
    except OSError:
        return []
    return [os.path.join(step, n) for n in names if _is_item(os.path.join(step, n))]


def _latest_step(root: str) -> str | None:
    """The highest-numbered finished step ("7"), skipping orbax's temporary directories."""
    try:
        names = os.listdir(root)
    except OSError:
        return None
    steps = [n for n in names if _STEP.fullmatch(n) and (_is_item(os.path.join(root, n)) or
                                                         _items(os.path.join(root, n)))]
    return max(steps, key=int) if steps else None


class OrbaxReader(BaseReader):
    """Reads ``_METADATA`` and every leaf's ``.zarray`` on open; chunks on request."""

    format_name = "orbax"
    partial_reads = True  # read_box_into reads only the chunks a block overlaps
    checksummed = False

    def __init__(self, path: str, items: list[str]) -> None:
        self.path = path
        self._tensors: dict[str, TensorInfo] = {}
        self._arrays: dict[str, Any] = {}
        self._stores: list[Any] = []
        notes: dict[str, str] = {}
        try:
            for item in items:
                prefix = "" if len(items) == 1 else os.path.basename(item) + "/"  # Composite: "<item>/..."
                self._read_item(item, prefix, notes)
        except BaseException:
            self.close()
            raise
        self._metadata = {"non_tensors": notes} if notes else {}

    def _read_item(self, item: str, prefix: str, notes: dict[str, str]) -> None:
        store: _DirStore | _OcdbtStore = (_OcdbtStore(item) if os.path.exists(os.path.join(item, MANIFEST))
                                          else _DirStore(item))
        self._stores.append(store)
        meta = read_json(os.path.join(item, METADATA))
        tree = meta.get("tree_metadata") if isinstance(meta, dict) else None
        if not isinstance(tree, dict):
            raise CorruptCheckpointError(f"{item}/{METADATA}: no \"tree_metadata\" object")
        if meta.get("use_zarr3"):
            raise UnsupportedCheckpointError(f"{item}: saved as zarr v3 arrays; ckpt reads orbax's zarr v2 arrays")
        for entry in tree.values():
            parts = _key_parts(entry, item)
            key = prefix + "/".join(parts)
            problem = key_problem(key)
            if problem:
                raise UnsupportedCheckpointError(f"{item}: the pytree path {key!r} cannot be a ckpt key ({problem})")
            if key in self._tensors or key in notes:
                raise CorruptCheckpointError(f"{item}/{METADATA}: the pytree path {key!r} appears twice")
            value = entry.get("value_metadata") if isinstance(entry.get("value_metadata"), dict) else {}
            kind = value.get("value_type")
            if kind not in ("np.ndarray", "jax.Array", "scalar") or value.get("skip_deserialize"):
                notes[key] = f"an orbax {kind!r} value, not an array ckpt reads"
                continue
            array = ".".join(parts)
            info, spec = _zarray(store, array, key)
            self._tensors[key] = info
            self._arrays[key] = (store, array, spec)

    def _read_into(self, info: TensorInfo, out: np.ndarray) -> None:
        self._read_box(info, [(0, d) for d in info.shape], out)

    def read_box_into(self, key: str, offset: Sequence[int], out: np.ndarray) -> None:
        """Read the block ``[offset, offset + out.shape)`` of tensor ``key`` into ``out``, from just
        the chunks it overlaps (what a sharded restore asks for)."""
        info = self.info(key)
        self._read_box(info, check_box(info, offset, out.shape, self.path), out)

    def _read_box(self, info: TensorInfo, bounds: list[tuple[int, int]], out: np.ndarray) -> None:
        store, array, spec = self._arrays[info.key]
        chunks, separator = spec["chunks"], spec["separator"]
        if out.size == 0:
            return
        ranges = [range(a // c, (b - 1) // c + 1) for (a, b), c in zip(bounds, chunks)]
        for index in itertools.product(*ranges):
            name = separator.join(str(i) for i in index) if index else "0"
            chunk = _chunk(store, f"{array}/{name}", spec, info.key)
            region = [(i * c, min((i + 1) * c, d)) for i, c, d in zip(index, chunks, info.shape)]
            overlap = [(max(a, lo), min(b, hi)) for (a, b), (lo, hi) in zip(bounds, region)]
            out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(overlap, bounds))] = \
                chunk[tuple(slice(lo - r, hi - r) for (lo, hi), (r, _) in zip(overlap, region))]

    def verify(self, progress: Callable[[int], None] | None = None) -> list[str]:
        return super().verify(progress)  # every chunk read (OCDBT: every node's crc32c checked on open)

    def close(self) -> None:
        for store in self._stores:
            store.close()


class _DirStore:
    """Orbax's zarr arrays as files: "params.dense.kernel/0.0" under the item directory."""

    def __init__(self, root: str) -> None:
        self.root = root

    def size(self, name: str) -> int | None:
        try:
            return os.stat(os.path.join(self.root, name)).st_size
        except OSError:
            return None

    def get(self, name: str) -> bytes | None:
        try:
            with open(os.path.join(self.root, name), "rb") as f:
                return f.read(os.fstat(f.fileno()).st_size)  # read(n) allocates n up front: ask for what is there
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CorruptCheckpointError(f"{self.root}/{name}: cannot read: {exc.strerror or exc}") from exc

    def count(self, array: str) -> int:
        try:
            return len(os.listdir(os.path.join(self.root, array)))
        except OSError:
            return 0

    def where(self, name: str) -> str:
        return os.path.join(self.root, name)

    def close(self) -> None:
        pass


class _OcdbtStore:
    """The same keys in tensorstore's OCDBT database (manifest.ocdbt and its data files)."""

    def __init__(self, root: str) -> None:
        from ._ocdbt import open_store  # lazy: only OCDBT checkpoints load the database reader

        self.root = root
        self._store = open_store(root)
        self._counts: dict[str, int] = {}
        for key in self._store.values:
            head = key.split(b"/", 1)[0].decode("utf-8", "replace")
            self._counts[head] = self._counts.get(head, 0) + 1

    def size(self, name: str) -> int | None:
        value = self._store.values.get(name.encode())
        return None if value is None else len(value) if isinstance(value, bytes) else int(value[2])

    def get(self, name: str) -> bytes | None:
        return self._store.get(name.encode())

    def count(self, array: str) -> int:
        return self._counts.get(array, 0)

    def where(self, name: str) -> str:
        return f"{self.root} (OCDBT) key {name!r}"

    def close(self) -> None:
        self._store.close()


def _chunk(store: Any, name: str, spec: dict[str, Any], key: str) -> np.ndarray:
    """One chunk, decompressed into the chunk's full shape (zarr v2 stores edge chunks whole)."""
    dtype, chunks = spec["dtype"], spec["chunks"]
    nbytes = dtype.itemsize
    for c in chunks:
        nbytes *= c
    where = store.where(name)
    size = store.size(name)
    if size is None:
        raise CorruptCheckpointError(f"{where}: chunk of {key!r} is missing")
    if size > nbytes * MAX_RATIO:  # no codec makes a chunk bigger than this
        raise CorruptCheckpointError(f"{where}: a {size}-byte chunk for a {nbytes}-byte chunk of {key!r}")
    if size * MAX_RATIO < nbytes:
        raise CorruptCheckpointError(f"{where}: {size} bytes cannot decompress to the {nbytes}-byte "
                                     f"chunk {key!r} declares")
    stored = store.get(name)
    if stored is None:
        raise CorruptCheckpointError(f"{where}: chunk of {key!r} is missing")
    raw = _decompress(stored, spec["compressor"], nbytes + 1, where, key)
    if len(raw) != nbytes:
        raise CorruptCheckpointError(f"{where}: chunk of {key!r} holds {len(raw)} bytes, expected {nbytes}")
    chunk: np.ndarray = np.frombuffer(raw, dtype).reshape(chunks)
    return chunk


def _key_parts(entry: Any, item: str) -> list[str]:
    """A leaf's pytree path as strings; each must be a safe directory-name component."""
    parts = entry.get("key_metadata") if isinstance(entry, dict) else None
    if type(parts) is not list or not parts or not all(isinstance(p, dict) for p in parts):
        raise CorruptCheckpointError(f"{item}/{METADATA}: a leaf without its \"key_metadata\" path")
    out = []
    for part in parts:
        name = part.get("key")
        if type(name) is int:
            name = str(name)
        if type(name) is not str or not name or "/" in name or "\\" in name or "\x00" in name or \
                name in (".", ".."):
            raise UnsupportedCheckpointError(f"{item}/{METADATA}: the pytree key {name!r} cannot name an "
                                             "array directory")
        out.append(name)
    return out


def _zarray(store: Any, array: str, key: str) -> tuple[TensorInfo, dict[str, Any]]:
    """A zarr v2 array's ``.zarray``: checked, and refused where ckpt does not read it."""
    path = store.where(f"{array}/.zarray")
    size = store.size(f"{array}/.zarray")
    if size is None:
        raise CorruptCheckpointError(f"{store.where(array)}: the array of {key!r} is missing (no .zarray)")
    if size > MAX_JSON:
        raise CorruptCheckpointError(f"{path}: larger than {MAX_JSON} bytes")
    meta = parse_json(store.get(f"{array}/.zarray") or b"", path)
    if not isinstance(meta, dict) or meta.get("zarr_format") != 2:
        raise CorruptCheckpointError(f"{path}: not zarr v2 array metadata")
    shape = check_shape(meta.get("shape"), path, key)
    chunks = meta.get("chunks")
    if type(chunks) is not list or len(chunks) != len(shape) or not all(type(c) is int and c > 0 for c in chunks):
        raise CorruptCheckpointError(f"{path}: the chunks {chunks!r} do not fit the shape {list(shape)}")
    code = meta.get("dtype")
    dtype = _ZARR_DTYPES.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise UnsupportedCheckpointError(f"{path}: {key!r} has zarr dtype {meta.get('dtype')!r}, which ckpt "
                                         "does not read (little-endian numbers, bool, bfloat16, float8)")
    if meta.get("order", "C") != "C" or meta.get("filters") not in (None, []):
        raise UnsupportedCheckpointError(f"{path}: {key!r} uses order {meta.get('order')!r} / filters "
                                         f"{meta.get('filters')!r}; ckpt reads C-order arrays without filters")
    separator = meta.get("dimension_separator", ".")
    if separator not in (".", "/"):
        raise CorruptCheckpointError(f"{path}: dimension_separator {separator!r}")
    compressor = meta.get("compressor")
    codec = compressor.get("id") if isinstance(compressor, dict) else compressor
    if codec not in (None, "zstd", "zlib", "gzip"):
        raise UnsupportedCheckpointError(f"{path}: {key!r} is compressed with {codec!r}; ckpt reads zstd, "
                                         "zlib and gzip chunks")
    grid = 1
    for d, c in zip(shape, chunks):
        grid *= -(-d // c)
    if grid > store.count(array):  # every chunk is stored (orbax writes them all): bound the grid
        raise CorruptCheckpointError(f"{store.where(array)}: {key!r} needs {grid} chunk files, the store holds "
                                     "fewer")
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    return TensorInfo(key, dtype, shape, nbytes), {"chunks": tuple(chunks), "dtype": dtype,
                                                   "compressor": codec, "separator": separator}


def _decompress(data: bytes, codec: str | None, limit: int, path: str, key: str) -> bytes:
    """Decompress at most ``limit`` bytes (a bomb stops there)."""
    try:
        if codec is None:
            return data
        if codec in ("zlib", "gzip"):
            inflate = zlib.decompressobj(zlib.MAX_WBITS | (16 if codec == "gzip" else 0))
            return inflate.decompress(data, limit)
        return zstd_bytes(data, limit)
    except (zlib.error, ValueError, EOFError) as exc:
        raise CorruptCheckpointError(f"{path}: chunk of {key!r} does not decompress ({codec}): {exc}") from exc
