"""The format API in one import: the Reader/Format protocols, the format registry, and the helpers
formats build on. Plugins import from here (``ckpt.formats.base``) or take the public names from
``ckpt`` (``ckpt.Format``, ``ckpt.register_format``, ``ckpt.decline``).

A format knows how to recognise its files (``sniff``), open them (``open`` -> a Reader that
has read only the index) and, optionally, write them. The built-in formats register
themselves with :func:`register_format`, the same function a user calls for their own.

Each name is defined in a module with one job (patch a name there, where it is looked up):

- ``_readers``: TensorInfo, the Reader protocol, BaseReader, FileReader;
- ``_contract``: the Format and WritableFormat protocols;
- ``_registry``: register_format, formats, get_format, format_for_path, open_reader;
- ``_lazy``: LazyFormat, lazy_format (built-ins whose module loads on first use);
- ``_offers``: offering, handed, decline, Declined (what is handed between formats on open);
- ``_blobs``: open_blob (the one place a path becomes bytes: a local file or an object);
- ``_writing``: write_into, stage, materialize, source_chunks (calling a writer, feeding it);
- ``_validation``: keys, shapes, dtypes, versions and metadata checked against ckpt's rules.

Example:
    >>> from ckpt.formats import base
    >>> base.format_for_path("model.msgpack").name
    'msgpack'
"""

from __future__ import annotations

from ._blobs import open_blob
from ._contract import Format, WritableFormat
from ._lazy import LazyFormat, lazy_format
from ._offers import Declined, decline, handed, offering
from ._readers import BaseReader, FileReader, Reader, TensorInfo
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
    key_problem,
    keys_plainly_valid,
    normalize_metadata,
    plain_extents,
    unique_pairs,
    validate_keys,
)
from ._writing import materialize, source_chunks, stage, write_into

__all__ = ["TensorInfo", "Reader", "BaseReader", "FileReader", "Format", "WritableFormat", "register_format",
           "unregister_format", "LazyFormat", "lazy_format", "Declined", "decline", "handed", "offering",
           "get_format", "formats", "format_for_path", "open_reader", "validate_keys",
           "key_problem", "normalize_metadata", "materialize", "source_chunks", "check_tensors", "open_blob",
           "SNIFF_BYTES", "keys_plainly_valid", "all_lists", "all_exactly", "plain_extents", "unique_pairs",
           "check_version", "dtype_or_raise", "MAX_ELEMENTS", "check_shape", "check_metadata", "write_into", "stage"]
