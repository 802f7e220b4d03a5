"""Reading HDF5 files that ckpt did not write (or that lost ckpt's index) through h5py.

Every dataset becomes a tensor keyed by its path. libhdf5 is not safe on damaged input and such
files carry no checksums, so reading them is at the user's own risk; what can be checked is:
external links, soft links, external storage and virtual datasets are refused, names must
follow ckpt's key rules, HDF5 types no tensor can hold are refused, and every dataset's
declared size must fit the file before anything is allocated. ``open_foreign`` is the one way
formats open such a file (the keras format, registered before hdf5, opens it first and
hands the reader on when the file has no Keras layout: see ``base.decline``).

Example:
    >>> import h5py, numpy as np, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "plain.h5")
    >>> with h5py.File(path, "w") as f:
    ...     f["enc/w"] = np.arange(3.0)
    >>> with H5pyReader(path) as reader:
    ...     reader.read("enc/w")
    array([0., 1., 2.])
"""

from __future__ import annotations

import json
import os
from contextlib import closing, nullcontext
from collections.abc import Mapping
from typing import Any

import numpy as np

from ckpt import dtypes
from ckpt.errors import CheckpointError, CorruptCheckpointError, UnsupportedCheckpointError
from ckpt.storage import ReadableBlob

from . import _h5head
from ._io import LocalFile
from .base import BaseReader, TensorInfo, check_metadata, check_tensors, check_version, key_problem, open_blob
from ._codec import HDF5_VERSION as VERSION
from ._codec import decode_strings
from ._foreign import json_int

#: deflate's best case (about 1032:1): a compressed dataset cannot hold more than that.
_DEFLATE_RATIO = 1032


class H5pyReader(BaseReader):
    """Reads an HDF5 file without ckpt's index (other tools, repacked files) through h5py.

    libhdf5 is not safe on damaged input, and such files carry no checksums: reading them is
    at the user's own risk. External links, external storage and virtual datasets are refused.
    """

    format_name = "hdf5"
    _tensors: dict[str, TensorInfo]  # filled entry by entry while the file is parsed
    checksummed = False
    #: A ckpt file (its attributes) with a user block but no valid index is damaged, never read unchecked.
    _refuses_ckpt_marks = True

    def __init__(self, path: str, file: Any = None) -> None:
        """Open ``path``, or read ``file`` (a seekable binary file object) and name it ``path``."""
        import h5py  # lazy: only HDF5 files that are not ckpt's load h5py

        from . import _h5child  # lazy as h5py: its subprocess costs every ckpt HDF5 read ~3 ms of start-up

        self.path = path
        if file is None:  # unverified bytes: libhdf5 reads them in a child process first (a crash stays there)
            _h5child.probe(path)
        try:
            self._file_size = os.path.getsize(path) if file is None else file.seek(0, os.SEEK_END)
            self._h5 = h5py.File(path if file is None else file, "r")
        except OSError as exc:
            raise CorruptCheckpointError(f"{path}: HDF5 cannot open the file: {exc}") from exc
        try:
            self._open()
        except BaseException:
            self._h5.close()
            raise

    def _open(self) -> None:
        import h5py  # lazy: only HDF5 files that are not ckpt's load h5py

        path, f = self.path, self._h5
        try:
            marks = [name for name in ("ckpt_format", "ckpt_version", "ckpt_metadata") if name in f.attrs]
            if marks and f.userblock_size and self._refuses_ckpt_marks:  # ckpt's attributes, its index gone
                raise CorruptCheckpointError(
                    f"{path}: ckpt wrote this HDF5 file (attribute {marks[0]!r}) but its user block holds "
                    "no valid ckpt header: the index is damaged, so no value can be checked")
            version = f.attrs.get("ckpt_version")
            metadata = text_attr(f.attrs, "ckpt_metadata", path) or "{}"
        except (OSError, RuntimeError, KeyError, ValueError, TypeError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CorruptCheckpointError(f"{path}: HDF5 cannot read the root group's attributes: {exc}") from exc
        if version is not None:
            if not isinstance(version, (int, np.integer)):
                raise CorruptCheckpointError(f"{path}: the ckpt_version attribute is {version!r}, not a number")
            check_version(int(version), VERSION, "HDF5", path)
        try:
            self._metadata = check_metadata(json.loads(metadata, parse_int=json_int), path)
        except (TypeError, ValueError, RecursionError) as exc:
            raise CorruptCheckpointError(f"{path}: the ckpt_metadata attribute is not JSON: {str(exc)[:200]}") from exc
        self._tensors = {}
        self._datasets: dict[str, Any] = {}
        #: 2-byte opaque datasets (Keras's legacy .h5 stores bfloat16 so): no tensors until a layout
        #: names their type (resolve_opaque); those left are listed as non-tensors and refused when read
        self.opaque: dict[str, TensorInfo] = {}

        def visit(group: Any, prefix: str) -> None:
            for name in group:
                link = group.get(name, getlink=True)
                key = prefix + name
                if isinstance(link, h5py.ExternalLink):
                    raise UnsupportedCheckpointError(f"{path}: {key!r} is an external link to "
                                                     f"{link.filename}; ckpt refuses external links")
                if isinstance(link, h5py.SoftLink):
                    raise UnsupportedCheckpointError(f"{path}: {key!r} is a soft link; ckpt reads "
                                                     "only plain groups and datasets")
                obj = group[name]
                if isinstance(obj, h5py.Group):
                    visit(obj, key + "/")
                elif isinstance(obj, h5py.Dataset):
                    # a ckpt tensor whose key is also a scope lies inside its group (docs/formats.md)
                    self._add(prefix[:-1] if name == _h5head.SCOPE_TENSOR and prefix else key, obj)

        try:
            visit(f, "")
        except CheckpointError:
            raise
        except Exception as exc:  # h5py's errors: OSError, KeyError, TypeError for HDF5 types numpy lacks, ...
            raise CorruptCheckpointError(f"{path}: HDF5 cannot read the file's structure: "
                                         f"{type(exc).__name__}: {exc}") from exc
        check_tensors(self._tensors, path)

    def _add(self, key: str, ds: Any) -> None:
        problem = key_problem(key)
        if problem:
            raise UnsupportedCheckpointError(f"{self.path}: dataset {key!r} cannot be a checkpoint key: {problem}")
        if ds.is_virtual:
            raise UnsupportedCheckpointError(f"{self.path}: {key!r} is a virtual dataset; ckpt refuses them")
        if ds.id.get_create_plist().get_external_count():
            raise UnsupportedCheckpointError(f"{self.path}: {key!r} stores its data in external files; "
                                             "ckpt refuses external storage")
        opaque = ds.dtype.kind == "V" and ds.dtype.itemsize == 2 and ds.dtype.fields is None and \
            "ckpt_dtype" not in ds.attrs and "dtype" not in ds.attrs
        dtype = np.dtype(np.uint16) if opaque else self._dtype_of(key, ds)
        shape = tuple(ds.shape) if ds.shape is not None else ()
        info = TensorInfo(key, dtype, shape, int(ds.id.get_storage_size()))
        compressed = ds.id.get_create_plist().get_nfilters() > 0
        # bytes per element in the file (a variable-length string's heap reference takes 16)
        stored = ds.dtype.itemsize if ds.dtype.kind != "O" else 16
        logical = info.size * stored
        if logical > self._file_size * (_DEFLATE_RATIO if compressed else 1):  # before allocating
            raise CorruptCheckpointError(
                f"{self.path}: dataset {key!r} declares {list(shape)} x {ds.dtype} ({logical} bytes), "
                f"more than a {self._file_size}-byte file can hold")
        self._datasets[key] = ds
        if opaque:
            self.opaque[key] = info
        else:
            self._tensors[key] = info

    def resolve_opaque(self, key: str, dtype: np.dtype) -> None:
        """Make the 2-byte opaque dataset ``key`` a tensor of ``dtype`` (bfloat16: what a layout
        learned from the file itself, e.g. Keras's model config)."""
        if dtype != dtypes.bfloat16:
            raise ValueError(f"opaque 2-byte data can only be read as bfloat16, not {dtype}")
        self._tensors[key] = self.opaque.pop(key)._replace(dtype=dtype)

    @property
    def metadata(self) -> dict[str, Any]:
        notes = opaque_notes(self.opaque)
        return {**self._metadata, "non_tensors": notes} if notes else self._metadata

    def info(self, key: str) -> TensorInfo:
        if key in self.opaque:
            raise opaque_error(self.path, key)
        return super().info(key)

    def _dtype_of(self, key: str, ds: Any) -> np.dtype:
        """The tensor dtype of a dataset; HDF5 types no Variable can hold are refused."""
        import h5py  # lazy: only HDF5 files that are not ckpt's load h5py

        tag = text_attr(ds.attrs, "ckpt_dtype", self.path, key)
        if tag is None:
            tag = text_attr(ds.attrs, "dtype", self.path, key)  # Keras 3's tag for bfloat16
        if tag == "bfloat16" and ds.id.get_type().get_size() == 2:  # h5py shows ckpt's as float32
            return dtypes.bfloat16
        if ds.dtype.kind == "S" or h5py.check_string_dtype(ds.dtype) is not None:
            return dtypes.string
        if ds.dtype.kind != "O" and dtypes.dt_name_or_none(ds.dtype) is not None:
            found: np.dtype = ds.dtype
            return found
        raise UnsupportedCheckpointError(f"{self.path}: dataset {key!r} has HDF5 type {ds.dtype!r}, which no "
                                         "ckpt tensor can hold")

    def _read_into(self, info: TensorInfo, out: np.ndarray) -> None:
        ds = self._datasets[info.key]
        try:
            if info.dtype == dtypes.bfloat16:
                ds.id.read(_all(), _all(), out.view(np.uint16), mtype=ds.id.get_type())
            elif dtypes.is_string(info.dtype):
                raw = ds[()]
                if ds.dtype.kind == "O":  # variable-length strings (a scalar one reads as bytes or str)
                    flat = [raw] if isinstance(raw, (bytes, str)) else np.asarray(raw).reshape(-1)
                    items = [bytes(x) if isinstance(x, bytes) else x.encode() for x in flat]
                else:
                    raw = np.asarray(raw)
                    items = decode_strings(raw, self._lengths(info, ds, raw.dtype.itemsize))
                flat = out.reshape(-1)
                for i, item in enumerate(items):
                    flat[i] = item
            elif out.size:
                ds.read_direct(out)
        except CheckpointError:
            raise
        except Exception as exc:  # h5py's errors: OSError, TypeError for HDF5 types numpy lacks, ...
            raise CorruptCheckpointError(f"{self.path}: HDF5 cannot read tensor {info.key!r}: "
                                         f"{type(exc).__name__}: {exc}") from exc

    def _lengths(self, info: TensorInfo, ds: Any, width: int) -> list[int] | None:
        """ckpt's exact string lengths (``ckpt_lengths``): one int in [0, width] per element, or None."""
        lengths = ds.attrs.get("ckpt_lengths")
        if lengths is None:
            return None
        flat = np.asarray(lengths).reshape(-1)
        if flat.dtype.kind not in "iu" or len(flat) != info.size or (len(flat) and (
                int(flat.min()) < 0 or int(flat.max()) > width)):
            raise CorruptCheckpointError(
                f"{self.path}: tensor {info.key!r}: the ckpt_lengths attribute should hold {info.size} integers "
                f"in [0, {width}], it holds {flat.dtype} {list(flat.shape)}")
        return [int(n) for n in flat]

    def close(self) -> None:
        self._h5.close()

    @property
    def file(self) -> Any:
        """The open h5py.File (for layouts such as Keras's that read its attributes)."""
        return self._h5


def text_attr(attrs: Any, name: str, path: str, where: str = "") -> str | None:
    """An attribute that should hold one string (bytes or str), as str; None when absent.

    Anything else (a number, an array, an HDF5 type numpy lacks) is a CorruptCheckpointError
    naming the attribute, what it should be and what it is.
    """
    owner = f"dataset {where!r}:" if where else "the root group's"
    try:
        if name not in attrs:
            return None
        value = attrs[name]
    except Exception as exc:  # e.g. TypeError: an HDF5 time type has no numpy equivalent
        raise CorruptCheckpointError(f"{path}: {owner} attribute {name!r} cannot be read as a string: "
                                     f"{type(exc).__name__}: {exc}") from exc
    if isinstance(value, np.ndarray) and value.shape == () and value.dtype.kind in "OSU":
        value = value[()]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            pass
    elif isinstance(value, str):
        return value
    raise CorruptCheckpointError(f"{path}: {owner} attribute {name!r} should be a string, it is "
                                 f"{describe(value)}")


def describe(value: Any) -> str:
    """A short description of an attribute's value for error messages."""
    if isinstance(value, np.ndarray):
        return f"an array of {value.dtype} {list(value.shape)}"
    return f"{type(value).__name__} {str(value)[:40]!r}"


def open_foreign(path: str, blob: ReadableBlob | None = None, declined: Any = None) -> H5pyReader:
    """The one guarded way to open an HDF5 file ckpt did not write (used by hdf5 and keras).

    ``declined``, an H5pyReader a format asked before (keras) opened on ``path`` and handed on, is
    the reader (libhdf5 opens the file once). Else it refuses what must never reach libhdf5 (a
    URL: libhdf5 reads local files only; a ckpt file with a damaged header), looking at ``blob``
    (``path``'s bytes, opened when not given; left open), and opens the file, which ``_h5child``
    first reads in a child process.
    """
    if declined is not None and isinstance(declined, H5pyReader) and declined.path == path:
        return declined
    with nullcontext(blob) if blob is not None else closing(open_blob(path)) as source:
        if not isinstance(source, LocalFile):  # libhdf5 reads local files only
            raise UnsupportedCheckpointError(f"{path}: an HDF5 file ckpt did not write cannot be read from an "
                                             "object store; download it first")
        _h5head.refuse_damaged_ckpt_file(source)
    return H5pyReader(path)


def opaque_notes(opaque: Mapping[str, TensorInfo]) -> dict[str, str]:
    """The "non_tensors" entries for 2-byte opaque datasets no layout gave a type."""
    return {key: f"opaque 2-byte values {list(info.shape)} of unknown type (how Keras's legacy .h5 stores "
                 "bfloat16)" for key, info in opaque.items()}


def opaque_error(path: str, key: str) -> UnsupportedCheckpointError:
    """The error for reading a 2-byte opaque dataset no layout gave a type: its bytes would be a guess."""
    return UnsupportedCheckpointError(
        f"{path}: dataset {key!r} holds opaque 2-byte values (how Keras's legacy .h5 stores bfloat16) and "
        "nothing in the file says which type they are; ckpt does not guess")


def _all() -> Any:
    from h5py import h5s  # lazy: only HDF5 files that are not ckpt's load h5py

    return h5s.ALL
