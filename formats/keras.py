"""Keras weights: legacy HDF5 (.h5), Keras 3 ``.weights.h5`` and the ``.keras`` zip.

Keys are the dataset paths in the HDF5 file, as they are:

* legacy weights-only files (``save_weights("w.h5")``): root attributes ``layer_names``,
  each layer group's ``weight_names`` -> "d1/sequential/d1/kernel";
* legacy full-model files (``model.save("m.h5")``): the same under ``model_weights/`` ->
  "model_weights/d1/sequential/d1/kernel" (plus "optimizer_weights/..." when saved);
* Keras 3 (``save_weights("x.weights.h5")``, and ``model.weights.h5`` inside a ``.keras``
  zip) -> "layers/dense/vars/0", "layers/dense/vars/1", ...; the metadata's "layer_names"
  maps each vars group ("layers/dense/vars") to the layer's name in the model ("d1").

Legacy files list their weights in model order (layer_names, weight_names) and so does
the reader; Keras 3 files are listed in natural order ("vars/10" after "vars/9"). Bfloat16
weights (Keras 3 marks them with a ``dtype`` attribute) read as bfloat16; so do a legacy file's
opaque 2-byte weights when the model config in the file gives their layer the bfloat16 policy, and
their optimizer slots (otherwise they are listed as non-tensors and refused when read, naming the dataset).

HDF5 files are read through libhdf5 (ckpt's guarded H5pyReader: no external links,
external storage or virtual datasets) and carry no checksums, so a damaged .h5 file is
read at the user's own risk. Inside a ``.keras`` zip, the whole model.weights.h5 is
first checked against the CRC-32 the zip records, so libhdf5 only sees verified bytes.

Example:
    >>> import ckpt
    >>> ckpt.list_variables("keras3.weights.h5")[:2]  # doctest: +SKIP
    [('layers/batch_normalization/vars/0', [4]), ('layers/batch_normalization/vars/1', [4])]
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from ckpt import dtypes
from ckpt.errors import (CheckpointError, CorruptCheckpointError, UnsupportedCheckpointError,
                         checksum_message, checksum_error)
from ckpt.storage import ReadableBlob

from . import _io, _zip
from ._foreign import MAX_INT_DIGITS, json_int
from .base import BaseReader, TensorInfo, decline, open_blob
from .h5plain import H5pyReader, opaque_error, opaque_notes, open_foreign

WEIGHTS_MEMBER = "model.weights.h5"
#: metadata.json and config.json larger than this are not read into the metadata.
_MAX_JSON = 16 << 20
#: Where Keras 3 stores a variable: "vars/0", "layers/dense/vars/1", "optimizer/vars/12".
_KERAS3_KEY = re.compile(r"(?:[^/]+/)*vars/\d+")


def open_keras(path: str, blob: ReadableBlob | None = None) -> KerasReader:
    """A KerasReader for a .keras zip or an HDF5 file with Keras's layout; for an HDF5 file
    without it, decline, handing the H5pyReader opened on the way to the next format (hdf5) and
    leaving ``blob`` open for it."""
    source = open_blob(path) if blob is None else blob
    try:
        if _io.pread(source, 0, min(source.size, len(_zip.ZIP_MAGIC)), "the first bytes") == _zip.ZIP_MAGIC:
            return _open_zip(path, source)  # the reader reads the archive through ``source``
        inner = open_foreign(path, source)
    except BaseException:
        source.close()
        raise
    try:
        reader = _keras_reader(inner, {}, None, None, required=False)
    except BaseException:
        inner.close()
        source.close()
        raise
    if reader is None:
        if blob is None:
            source.close()
        decline(path, "an HDF5 file without Keras's layout (no layer_names; not every dataset in a vars group)", inner)
    source.close()  # libhdf5 reads the file through its own handle
    return reader


class KerasReader(BaseReader):
    """Keras weights over an open H5pyReader: Keras's order, dtypes and metadata."""

    format_name = "keras"

    def __init__(self, inner: H5pyReader, tensors: dict[str, TensorInfo], metadata: dict[str, Any],
                 archive: ReadableBlob | None = None, member: tuple[int, int, int] | None = None) -> None:
        self.path, self._inner = inner.path, inner
        self._tensors, self._metadata = tensors, metadata
        self._archive, self._member = archive, member  # the .keras file and (offset, size, crc32)
        self.checksummed = member is not None

    def info(self, key: str) -> TensorInfo:
        if key in self._inner.opaque:
            raise opaque_error(self.path, key)
        return super().info(key)

    def _read_many(self, pairs: list[tuple[TensorInfo, np.ndarray]]) -> None:
        self._inner._read_many(pairs)

    def verify(self, progress: Callable[[int], None] | None = None) -> list[str]:
        problems = []
        if self._archive is not None and self._member is not None:
            offset, size, crc = self._member
            got = _zip.crc32_range(self._archive, offset, size, WEIGHTS_MEMBER)
            if got != crc:
                problems.append(checksum_message(self.path, WEIGHTS_MEMBER, got, crc, "CRC-32"))
        return problems + super().verify(progress)

    def close(self) -> None:
        self._inner.close()
        if self._archive is not None:
            self._archive.close()


def _keras_reader(inner: H5pyReader, metadata: dict[str, Any], archive: ReadableBlob | None,
                  member: tuple[int, int, int] | None, required: bool) -> KerasReader | None:
    """Recognise the layout and list the weights; ``required``: the file must be Keras's."""
    try:
        return _recognise(inner, metadata, archive, member, required)
    except CheckpointError:
        raise
    except Exception as exc:  # h5py's errors reading attributes: TypeError for HDF5 types numpy lacks, ...
        raise CorruptCheckpointError(f"{inner.path}: cannot read the Keras layout's attributes: "
                                     f"{type(exc).__name__}: {exc}") from exc


def _recognise(inner: H5pyReader, metadata: dict[str, Any], archive: ReadableBlob | None,
               member: tuple[int, int, int] | None, required: bool) -> KerasReader | None:
    import h5py  # lazy: only an HDF5 file loads h5py (a .keras zip may hold none)

    h5 = inner.file
    if "ckpt_format" in h5.attrs and not required:
        return None
    legacy = h5 if "layer_names" in h5.attrs else h5.get("model_weights")
    if isinstance(legacy, h5py.Group) and "layer_names" in legacy.attrs:
        layers, weights = _legacy_weights(inner, legacy)
        _resolve_bfloat16(inner, h5, legacy, weights)
        order, meta = _legacy_order(inner, h5, layers, weights)
    elif _keras3_layout(inner) or required:
        order, meta = _keras3_order(inner, h5)
    else:
        return None
    tensors = {key: inner.tensors[key] for key in order}  # H5pyReader honours Keras's bfloat16 tag
    notes = opaque_notes(inner.opaque)  # what no layout typed: listed, refused when read (KerasReader.info)
    return KerasReader(inner, tensors, {**meta, **metadata, **({"non_tensors": notes} if notes else {})},
                       archive, member)


def _keras3_layout(inner: H5pyReader) -> bool:
    """Keras 3 keeps every variable at "<path>/vars/<n>" (saving_lib's H5IOStore). A shard of a
    sharded save may hold any subset of them (only optimizer/vars, say), so no group is sure to be there."""
    import h5py  # lazy: only an HDF5 file loads h5py (a .keras zip may hold none)

    h5 = inner.file
    if isinstance(h5.get("layers"), h5py.Group) or isinstance(h5.get("vars"), h5py.Group):
        return True
    keys = [*inner.tensors, *inner.opaque]
    return bool(keys) and all(_KERAS3_KEY.fullmatch(key) for key in keys)


def _resolve_bfloat16(inner: H5pyReader, h5: Any, group: Any, weights: list[tuple[str, str]]) -> None:
    """Legacy .h5 files store a bfloat16 layer's weights as opaque 2-byte data; the layer's dtype
    policy in the model config (same file) says they are bfloat16, and an optimizer slot has its
    variable's dtype. Others stay opaque (refused when read)."""
    if not inner.opaque or "model_config" not in h5.attrs:
        return
    try:
        # only dtype policies are read: an integer too long for int() (a hostile "units") stays text
        config = json.loads(_attr(h5.attrs["model_config"]), parse_int=_config_int)
    except (TypeError, ValueError, RecursionError):
        return  # no usable config: the opaque datasets stay untyped
    policies = _layer_policies(config)
    prefix = group.name.strip("/") + "/" if group.name.strip("/") else ""
    for key in list(inner.opaque):
        if key.startswith(prefix) and policies.get(key[len(prefix):].split("/", 1)[0]) == "bfloat16":
            inner.resolve_opaque(key, dtypes.bfloat16)
    _resolve_slots(inner, weights)


def _resolve_slots(inner: H5pyReader, weights: list[tuple[str, str]]) -> None:
    """Keras 3 saves an optimizer's slot for a variable as "optimizer_weights/<optimizer>/<variable path
    with "/" as "_">_<slot>" ("adam/sequential_d2_bias_momentum") with the variable's dtype: a 2-byte
    opaque slot is bfloat16 when every variable its name can belong to is bfloat16."""
    slots = [key for key in inner.opaque if key.startswith("optimizer_weights/")]
    if not slots:
        return
    variables: dict[str, list[TensorInfo | None]] = {}  # "sequential_d2_bias_" -> its variables' infos
    for weight, key in weights:
        variables.setdefault(weight.replace("/", "_") + "_", []).append(inner.tensors.get(key))
    for key in slots:
        name = key.rpartition("/")[2]
        found = [info for i, c in enumerate(name) if c == "_" for info in variables.get(name[:i + 1], [])]
        if found and all(info is not None and info.dtype == dtypes.bfloat16 for info in found):
            inner.resolve_opaque(key, dtypes.bfloat16)


def _config_int(text: str) -> int | str:
    return text if len(text) > MAX_INT_DIGITS else int(text)


def _layer_policies(config: Any) -> dict[str, str]:
    """Each layer's dtype policy name in a Keras model config ("d2" -> "bfloat16"), nested models
    included. A policy is a name or {"class_name": "DTypePolicy", "config": {"name": ...}}."""
    out: dict[str, str] = {}
    stack = [(config, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > 64:
            continue
        if isinstance(node, dict):
            inner = node.get("config")
            if isinstance(inner, dict) and isinstance(inner.get("name"), str) and "dtype" in inner:
                policy = inner["dtype"]
                if isinstance(policy, dict):
                    policy = policy.get("config", {}).get("name") if isinstance(policy.get("config"), dict) else None
                if isinstance(policy, str):
                    out.setdefault(inner["name"], policy)
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return out


def _attr(value: Any) -> Any:
    """An HDF5 attribute as plain Python (h5py returns bytes, numpy strings and arrays)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.ndarray):
        return [_attr(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return _attr(value.item())
    return value


def _names(value: Any, path: str, what: str) -> list[str]:
    """Keras's list of names (layer_names, weight_names): strings, or the file is damaged."""
    names = _attr(value)
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CorruptCheckpointError(f"{path}: Keras's {what} should be a list of strings, it is "
                                     f"{str(names)[:60]}")
    return names


def _natural(key: str) -> list[tuple[int, int, str]]:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split("/")]


def _legacy_weights(inner: H5pyReader, group: Any) -> tuple[list[str], list[tuple[str, str]]]:
    """layer_names, and every weight they list as (its name in weight_names, its dataset), in model order."""
    prefix = group.name.strip("/")
    prefix = prefix + "/" if prefix else ""
    layers = _names(group.attrs["layer_names"], inner.path, "layer_names")
    out: list[tuple[str, str]] = []
    for layer in layers:
        weights = group[layer].attrs.get("weight_names", []) if layer in group else None
        if weights is None:
            raise CorruptCheckpointError(f"{inner.path}: Keras layer {layer!r} is listed in layer_names but "
                                         "has no group with weight_names")
        weights = _names(weights, inner.path, f"weight_names of layer {layer!r}")
        for weight in weights:
            key = f"{prefix}{layer}/{weight}"
            if key not in inner.tensors and key not in inner.opaque:
                raise CorruptCheckpointError(f"{inner.path}: Keras layer {layer!r} lists weight {weight!r}, "
                                             f"but the file has no dataset {key!r}")
            out.append((weight, key))
    return layers, out


def _legacy_order(inner: H5pyReader, h5: Any, layers: list[str],
                  weights: list[tuple[str, str]]) -> tuple[list[str], dict[str, Any]]:
    """Keys in model order (layer_names / weight_names), then any other datasets."""
    order = [key for _, key in weights if key in inner.tensors]
    listed = set(order)
    order += sorted((k for k in inner.tensors if k not in listed), key=_natural)
    meta = {name: _attr(h5.attrs[name]) for name in ("keras_version", "backend", "model_config")
            if name in h5.attrs}
    meta["layer_names"] = layers
    return order, meta


def _keras3_order(inner: H5pyReader, h5: Any) -> tuple[list[str], dict[str, Any]]:
    """Keys in natural order; each vars group's "name" attribute is the layer's name."""
    names: dict[str, str] = {}

    def visit(name: str, obj: Any) -> None:
        if (name == "vars" or name.endswith("/vars")) and "name" in obj.attrs:
            names[name] = str(_attr(obj.attrs["name"]))

    h5.visititems(visit)
    return sorted(inner.tensors, key=_natural), {"layer_names": names} if names else {}


def _open_zip(path: str, source: ReadableBlob) -> KerasReader:
    archive = _zip.open_archive(_io.stream(source), path)
    try:
        info = archive.getinfo(WEIGHTS_MEMBER)
    except KeyError:
        raise UnsupportedCheckpointError(f"{path}: a .keras archive without {WEIGHTS_MEMBER} (Keras 3 "
                                         "keeps the weights there)") from None
    offset, size = _zip.member_span(source, info)
    got = _zip.crc32_range(source, offset, size, WEIGHTS_MEMBER)
    if got != info.CRC:
        raise checksum_error(path, WEIGHTS_MEMBER, got, info.CRC, checksum="CRC-32")
    metadata = _zip_metadata(archive, path)
    inner = H5pyReader(path, file=_io.RangeFile(source, offset, size))
    try:
        reader = _keras_reader(inner, metadata, source, (offset, size, info.CRC), required=True)
    except BaseException:
        inner.close()
        raise
    assert reader is not None  # required=True always gives a reader
    return reader


def _zip_metadata(archive: Any, path: str) -> dict[str, Any]:
    """metadata.json's fields and config.json's text (the model's architecture)."""
    out: dict[str, Any] = {}
    for name in ("metadata.json", "config.json"):
        try:
            info = archive.getinfo(name)
            if info.file_size > _MAX_JSON:
                continue
            text = archive.read(name).decode("utf-8")
        except KeyError:
            continue
        except Exception as exc:  # zipfile raises BadZipFile, zlib.error, EOFError, ...
            raise CorruptCheckpointError(f"{path}: cannot read {name} from the archive: {exc}") from exc
        if name == "config.json":
            out["model_config"] = text
            continue
        try:
            fields = json.loads(text, parse_int=json_int)
        except (ValueError, RecursionError) as exc:
            raise CorruptCheckpointError(f"{path}: metadata.json is not JSON: {str(exc)[:200]}") from exc
        if isinstance(fields, dict):
            out.update({k: v for k, v in fields.items() if isinstance(v, (str, int, float, bool))})
    return out
