"""Checkpoints split across files by a JSON index: Hugging Face's sharded saves and model
directories, and Keras 3's sharded weights.

* Hugging Face: ``save_pretrained`` writes ``model.safetensors`` (or ``pytorch_model.bin``), or,
  past ``max_shard_size``, shards plus ``model.safetensors.index.json`` /
  ``pytorch_model.bin.index.json``: ``{"metadata": {"total_size": N}, "weight_map": {key:
  shard file}}``. Open the index file or the model directory.
* Keras 3: ``save_weights("model.weights.json", max_shard_size=...)`` writes that JSON
  (``{"metadata": ..., "weight_map": {"/vars/group": shard file or [shard files]}}``) and
  ``model_00000.weights.h5``, ... shards. Open the JSON file.

The shards are opened with ckpt's own readers for their formats (safetensors, PyTorch,
Keras HDF5), so everything those check is checked; the index must agree with them exactly:
every key it maps is in its shard, and every tensor a shard holds is mapped to that shard.
Shard names are plain file names next to the index (no directories, no "..").

Example:
    >>> import ckpt
    >>> ckpt.list_variables("hf_sharded")  # doctest: +SKIP
    [('h.0.attn.c_attn.bias', [24]), ...]
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedCheckpointError

from ._foreign import read_json
from .keras import _natural
from .base import BaseReader, TensorInfo, normalize_metadata, open_reader

#: Index files larger than this are refused (the largest real ones are a few MB).
MAX_INDEX = 64 << 20
#: Files a Hugging Face model directory may hold, in the order transformers prefers them.
HF_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
            "pytorch_model.bin")
_HF_SHARD_FORMATS = ("safetensors", "pytorch")
_KERAS_SUFFIX = ".weights.json"


def open_sharded(path: str, max_index: int = MAX_INDEX) -> BaseReader:
    """A reader of a Hugging Face model directory or index, or a Keras 3 ``.weights.json``; an index
    file over ``max_index`` bytes is refused before it is read."""
    if os.path.isdir(path):
        name = next((n for n in HF_FILES if os.path.isfile(os.path.join(path, n))), None)
        if name is None:
            raise CheckpointNotFoundError(f"{path}: no {' or '.join(HF_FILES)} in this directory")
        path = os.path.join(path, name)
        if not name.endswith(".json"):
            return _open_shard(path, _HF_SHARD_FORMATS, path)
    index = read_index(path, max_index)
    if path.endswith(_KERAS_SUFFIX):
        return ShardedReader(path, "keras", _keras_map(index, path), _index_metadata(index, path),
                             ("keras",), by_scope=True)
    return ShardedReader(path, "huggingface", _hf_map(index, path), _index_metadata(index, path),
                         _HF_SHARD_FORMATS)


class ShardedReader(BaseReader):
    """One checkpoint over the readers of its shards, as the index maps keys to them.

    ``weight_map`` maps a key (or, ``by_scope``, a key's scope: Keras maps "layers/dense/vars")
    to the shard files holding it.
    """

    def __init__(self, path: str, format_name: str, weight_map: dict[str, list[str]],
                 metadata: dict[str, Any], shard_formats: Sequence[str], by_scope: bool = False) -> None:
        self.path, self.format_name = path, format_name
        self._shards: dict[str, BaseReader] = {}
        self._owner: dict[str, BaseReader] = {}
        try:
            self._open_shards(weight_map, shard_formats, by_scope)
        except BaseException:
            self.close()
            raise
        self.checksummed = all(r.checksummed for r in self._shards.values())
        self._metadata = {**metadata, "shards": list(self._shards)}
        names = {k: v for r in self._shards.values() if isinstance(r.metadata.get("layer_names"), dict)
                 for k, v in r.metadata["layer_names"].items()}
        if names:  # Keras: each vars group's layer name, from whichever shard holds the group
            self._metadata["layer_names"] = names

    def _open_shards(self, weight_map: dict[str, list[str]], formats: Sequence[str], by_scope: bool) -> None:
        directory = os.path.dirname(self.path)
        mapped: dict[str, set[str]] = {}  # shard -> the names the index maps to it
        for name, files in weight_map.items():
            for file in files:
                mapped.setdefault(file, set()).add(name)
        for file in mapped:  # every name is checked before any shard is opened
            if not os.path.isfile(os.path.join(directory, _shard_name(file, self.path))):
                raise CorruptCheckpointError(f"{self.path}: the shard {file} is missing")
        if by_scope:  # Keras maps groups, not keys: a shard left out of the index would go unnoticed
            stem = os.path.basename(self.path)[:-len(_KERAS_SUFFIX)]
            pattern = re.compile(re.escape(stem) + r"_\d{5}\.weights\.h5")
            unused = sorted(f for f in os.listdir(directory or ".") if pattern.fullmatch(f) and f not in mapped)
            if unused:
                raise CorruptCheckpointError(f"{self.path}: the shard {unused[0]} is in the directory but the "
                                             "index maps nothing to it")
        self._tensors = {}
        for file, names in mapped.items():
            reader = _open_shard(os.path.join(directory, file), formats, self.path)
            self._shards[file] = reader
            found = set()
            for key, info in reader.tensors.items():
                name = key.rpartition("/")[0] if by_scope else key
                if name not in names:
                    raise CorruptCheckpointError(f"{self.path}: shard {file} holds {key!r}, which the index "
                                                 f"does not map to it: the shard is not from this save")
                if key in self._tensors:
                    raise CorruptCheckpointError(f"{self.path}: {key!r} is in two shards ({file} and "
                                                 f"{next(f for f, r in self._shards.items() if key in r.tensors)})")
                found.add(name)
                self._tensors[key] = info
                self._owner[key] = reader
            missing = names - found
            if missing and not by_scope:
                raise CorruptCheckpointError(f"{self.path}: the index maps {sorted(missing)[0]!r} to {file}, "
                                             f"which does not hold it")
        if by_scope:  # Keras: a vars group may be split across shards; each must appear somewhere
            missing = set(weight_map) - {k.rpartition("/")[0] for k in self._tensors}
            empty = {n for n in missing if not weight_map[n]}
            if missing - empty:
                raise CorruptCheckpointError(f"{self.path}: the index maps {sorted(missing - empty)[0]!r} to "
                                             "shards that do not hold it")
            self._tensors = {k: self._tensors[k] for k in sorted(self._tensors, key=_natural)}
        else:  # keep the index's order (Hugging Face sorts it)
            self._tensors = {k: self._tensors[k] for k in weight_map}

    def _read_many(self, pairs: list[tuple[TensorInfo, np.ndarray]]) -> None:
        groups: dict[int, list[tuple[str, np.ndarray]]] = {}
        for info, out in pairs:
            groups.setdefault(id(self._owner[info.key]), []).append((info.key, out))
        for items in groups.values():
            self._owner[items[0][0]].read_into_many(items)

    def verify(self, progress: Callable[[int], None] | None = None) -> list[str]:
        return [problem for reader in self._shards.values() for problem in reader.verify(progress)]

    def close(self) -> None:
        for reader in self._shards.values():
            reader.close()


def read_index(path: str, max_bytes: int = MAX_INDEX) -> dict[str, Any]:
    """The index file (at most ``max_bytes``) as a dict with a "weight_map" object (see ``_foreign.read_json``)."""
    index = read_json(path, max_bytes)
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise CorruptCheckpointError(f"{path}: the index has no \"weight_map\" object")
    return index


def _hf_map(index: dict[str, Any], path: str) -> dict[str, list[str]]:
    out = {}
    for key, file in index["weight_map"].items():
        if type(file) is not str:
            raise CorruptCheckpointError(f"{path}: the weight_map gives {key!r} the shard {file!r}, not a "
                                         "file name")
        out[key] = [file]
    if not out:
        raise CorruptCheckpointError(f"{path}: the weight_map is empty")
    return out


def _keras_map(index: dict[str, Any], path: str) -> dict[str, list[str]]:
    out = {}
    for name, files in index["weight_map"].items():
        files = [files] if type(files) is str else files
        if type(files) is not list or not all(type(f) is str for f in files):
            raise CorruptCheckpointError(f"{path}: the weight_map gives {name!r} the shards {files!r}, not "
                                         "file names")
        out[name.strip("/")] = files
    return out


def _index_metadata(index: dict[str, Any], path: str) -> dict[str, Any]:
    meta = index.get("metadata")
    try:
        return normalize_metadata(meta if isinstance(meta, dict) else {}, path)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{path}: the index's metadata: {exc}") from None


def _shard_name(file: str, path: str) -> str:
    """A shard must be a plain file name next to the index: a path could point anywhere."""
    if not file or file in (".", "..") or "/" in file or "\\" in file or "\x00" in file or \
            file.endswith(".json"):
        raise CorruptCheckpointError(f"{path}: the index names the shard {file!r}; shards are file names "
                                     "in the index's directory")
    return file


def _open_shard(path: str, formats: Sequence[str], index: str) -> BaseReader:
    if not os.path.isfile(path):
        raise CorruptCheckpointError(f"{index}: the shard {os.path.basename(path)} is missing")
    reader = open_reader(path)
    if reader.format_name not in formats:
        reader.close()
        raise UnsupportedCheckpointError(f"{index}: the shard {os.path.basename(path)} is a "
                                         f"{reader.format_name} file; expected {' or '.join(formats)}")
    return reader  # type: ignore[return-value]
