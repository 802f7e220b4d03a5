"""The format API in one import: the Reader/Format protocols, the format registry, and the helpers
formats build on. Plugins import from here (``ckpt.formats.base``) or take the public names from
``ckpt`` (``ckpt.Format``, ``ckpt.register_format``, ``ckpt.decline``).

A format is one class: it recognises its files (``claims``, ``sniff``), opens the blob it is
given (``open`` -> a Reader that has read only the index, or ``decline``) and, if it is a
``WritableFormat``, writes into a blob (``write_blob``). The built-in formats
(``formats/builtin.py``) register with :func:`register_format`, the function a user calls too.

Each name is defined in a module with one job (patch a name there, where it is looked up):

- ``_readers``: TensorInfo, the Reader protocol, BaseReader, FileReader;
- ``_contract``: Format, WritableFormat, ChunkedFormat, decline, Declined, check_compression, write_with;
- ``_registry``: register_format, formats, get_format, format_for_path, open_reader;
- ``_blobs``: open_blob, open_folder (the one place a path becomes bytes: a local file or an object);
- ``_writing``: stage, materialize, source_chunks (feeding a writer);
- ``_validation``: keys, shapes, dtypes, versions and metadata checked against ckpt's rules.

Example:
    >>> from ckpt.formats import base
    >>> base.format_for_path("model.msgpack").name
    'msgpack'
"""

from __future__ import annotations

from ckpt.lazy import LazySource

from ._blobs import open_blob, open_folder
from ._contract import ChunkedFormat, Declined, Format, WritableFormat, check_compression, decline, write_with
from ._readers import BaseReader, FileReader, LazyIndex, Reader, TensorInfo, as_dict
from ._registry import (
    SNIFF_BYTES,
    format_for_path,
    formats,
    get_format,
    open_reader,
    register_format,
    unregister_format,
)
from ._validation import (
    MAX_ELEMENTS,
    all_exactly,
    all_lists,
    check_metadata,
    check_shape,
    check_tensors,
    check_version,
    dtype_or_raise,
    index_entry,
    key_problem,
    keys_plainly_valid,
    normalize_metadata,
    plain_extents,
    unique_pairs,
    validate_keys,
)
from ._writing import materialize, source_chunks, stage

__all__ = ["TensorInfo", "Reader", "BaseReader", "FileReader", "LazyIndex", "as_dict", "Format", "WritableFormat",
           "ChunkedFormat", "check_compression", "write_with", "register_format",
           "unregister_format", "Declined", "decline",
           "get_format", "formats", "format_for_path", "open_reader", "validate_keys",
           "key_problem", "normalize_metadata", "materialize", "source_chunks", "LazySource", "check_tensors",
           "open_blob", "open_folder",
           "SNIFF_BYTES", "keys_plainly_valid", "all_lists", "all_exactly", "plain_extents", "unique_pairs",
           "check_version", "dtype_or_raise", "index_entry", "MAX_ELEMENTS", "check_shape", "check_metadata", "stage"]
