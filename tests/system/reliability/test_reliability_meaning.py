"""Edits of what a checkpoint's bytes mean, for every format ckpt writes.

A checksum over tensor bytes alone does not notice a header that now calls those bytes
something else: a dtype of the same width, another shape with as many elements, a renamed
key, two tensors' offsets swapped, edited metadata. Each case here makes such an edit and
fixes up every checksum that covers tensor bytes (so they agree with what the edited header
says), leaving only what ckpt keeps over the header's meaning to catch it. Every case must be
refused when the file is opened. Seeded single-byte edits of the safetensors header (where
the JSON text is the meaning) must be refused or harmless, never read as other values.
"""

from __future__ import annotations

import collections
import json
import random

import numpy as np
import pytest
from reliability_support import (
    OPEN,
    Case,
    hdf5_rebuild,
    hdf5_split,
    msgpack_rebuild,
    msgpack_split,
    packb,
    run_cases,
    safetensors_rebuild,
    safetensors_split,
    small_tensors,
    write_checkpoint,
)

from ckpt import dtypes
from ckpt.formats import _io
from ckpt.formats import msgpack as msgpack_format
from ckpt.formats import safetensors as st_format

HEADER_BYTE_EDITS = 300  # x --reliability-scale: seeded one-byte edits of the safetensors header
EXT = {"hdf5": ".h5", "msgpack": ".msgpack", "safetensors": ".safetensors"}
METADATA = {"step": 3, "note": "pristine"}


def tensors_for(fmt: str) -> list[tuple[str, np.ndarray]]:
    """The small checkpoint's tensors (safetensors cannot store strings)."""
    return [(k, v) for k, v in small_tensors() if fmt != "safetensors" or v.dtype.kind != "O"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """{format: (path, bytes)} of the small checkpoint with metadata."""
    directory = tmp_path_factory.mktemp("meaning")
    out = {}
    for fmt, ext in EXT.items():
        path = str(directory / f"small{ext}")
        out[fmt] = (path, write_checkpoint(path, tensors_for(fmt), METADATA))
    return out


def same_width(name: str) -> list[str]:
    """Other dtype names of the same element width (the bytes fit, the values would not)."""
    width = dtypes.as_dtype(name).itemsize
    return [n for n in dtypes.NAMES if n not in (name, "string") and dtypes.as_dtype(n).itemsize == width]


def other_shapes(shape: list[int]) -> list[list[int]]:
    """Other shapes with as many elements."""
    count = int(np.prod(shape, dtype=np.int64))
    return [s for s in (shape[::-1], [count], [1] + shape, shape + [1]) if s != shape]


def swappable(sizes: dict[str, int]) -> list[tuple[str, str]]:
    """Pairs of distinct non-empty tensors of the same byte size."""
    keys = sorted(k for k, n in sizes.items() if n)
    return [(a, b) for i, a in enumerate(keys) for b in keys[i + 1:] if sizes[a] == sizes[b]]


def metadata_edits(metadata: dict) -> list[tuple[str, dict]]:
    return [("metadata step 3 -> 4", {**metadata, "step": 4}), ("metadata entry added", {**metadata, "x": 1}),
            ("metadata entry removed", {k: v for k, v in metadata.items() if k != "note"})]


# --- the edits, per format --------------------------------------------------------------------------
def hdf5_meaning_edits(raw: bytes) -> list[Case]:
    """Index edits with the tensor crcs following their bytes; the index crc is left as written."""
    head, index = hdf5_split(raw)
    entries = index["tensors"]
    cases = []

    def case(label: str, new_entries: list, metadata: dict | None = None) -> None:
        new = {**index, "tensors": new_entries, "metadata": index["metadata"] if metadata is None else metadata}
        cases.append(Case(label, hdf5_rebuild(raw, packb(new), index_crc=head[4]), OPEN, region="hdf5 meaning"))

    for i, entry in enumerate(entries):
        if entry[1] == "string":
            continue
        for name in same_width(entry[1]):
            case(f"{entry[0]}: dtype {entry[1]} -> {name}", entries[:i] + [[entry[0], name] + entry[2:]] + entries[i + 1:])
        for shape in other_shapes(entry[2]):
            case(f"{entry[0]}: shape {entry[2]} -> {shape}", entries[:i] + [entry[:2] + [shape] + entry[3:]] + entries[i + 1:])
        case(f"{entry[0]}: renamed", entries[:i] + [["renamed/" + entry[0]] + entry[1:]] + entries[i + 1:])
    position = {e[0]: i for i, e in enumerate(entries)}
    for a, b in swappable({e[0]: e[4] for e in entries if e[1] != "string"}):
        new = list(entries)
        ea, eb = entries[position[a]], entries[position[b]]
        new[position[a]] = ea[:3] + eb[3:4] + ea[4:5] + eb[5:6] + ea[6:]  # offset and the crc of its bytes
        new[position[b]] = eb[:3] + ea[3:4] + eb[4:5] + ea[5:6] + eb[6:]
        case(f"{a} <-> {b}: data swapped", new)
    for label, metadata in metadata_edits(index["metadata"]):
        case(label, entries, metadata)
    return cases


def msgpack_meaning_edits(raw: bytes) -> list[Case]:
    """Index edits with the tensor crcs following their bytes; the footer keeps the written index crc."""
    _, index = msgpack_split(raw)
    crc = msgpack_format._FOOTER.unpack(raw[-msgpack_format.FOOTER_SIZE:])[8]
    tensors = index["tensors"]
    cases = []

    def case(label: str, new_tensors: dict, metadata: dict | None = None) -> None:
        new = {**index, "tensors": new_tensors, "metadata": index["metadata"] if metadata is None else metadata}
        cases.append(Case(label, msgpack_rebuild(raw, packb(new), crc=crc), OPEN, region="msgpack meaning"))

    for key, entry in tensors.items():
        if entry[0] == "string":
            continue
        for name in same_width(entry[0]):
            case(f"{key}: dtype {entry[0]} -> {name}", {**tensors, key: [name] + entry[1:]})
        for shape in other_shapes(entry[1]):
            case(f"{key}: shape {entry[1]} -> {shape}", {**tensors, key: [entry[0], shape] + entry[2:]})
        renamed = {("renamed/" + k if k == key else k): v for k, v in tensors.items()}
        case(f"{key}: renamed", renamed)
    sizes = {k: sum(n for _, n in e[2]) for k, e in tensors.items() if e[0] != "string"}
    for a, b in swappable(sizes):
        ea, eb = tensors[a], tensors[b]
        case(f"{a} <-> {b}: data swapped", {**tensors, a: ea[:2] + [eb[2], eb[3]], b: eb[:2] + [ea[2], ea[3]]})
    for label, metadata in metadata_edits(index["metadata"]):
        case(label, tensors, metadata)
    return cases


def safetensors_meaning_edits(raw: bytes) -> list[Case]:
    """Header edits with ``ckpt_crc32c`` recomputed for the bytes each edited entry now points at."""
    n, header = safetensors_split(raw)
    data = raw[8 + n:]
    codes = {dt: code for code, dt in st_format._CODES.items()}
    cases = []

    def case(label: str, new: dict) -> None:
        meta = dict(new["__metadata__"])
        if "ckpt_crc32c" in meta:  # fix up the tensor checksums for what the header now says
            crcs = {k: _io.crc32c(data[v["data_offsets"][0]:v["data_offsets"][1]])
                    for k, v in new.items() if k != "__metadata__"}
            meta["ckpt_crc32c"] = json.dumps(crcs)
        cases.append(Case(label, safetensors_rebuild(raw, {**new, "__metadata__": meta}), OPEN,
                          region="safetensors meaning"))

    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    for key, spec in entries.items():
        name = dtypes.dtype_name(st_format._CODES[spec["dtype"]])
        for other in same_width(name):
            code = codes.get(dtypes.as_dtype(other))
            if code is not None:
                case(f"{key}: dtype {spec['dtype']} -> {code}", {**header, key: {**spec, "dtype": code}})
        for shape in other_shapes(spec["shape"]):
            case(f"{key}: shape {spec['shape']} -> {shape}", {**header, key: {**spec, "shape": shape}})
        case(f"{key}: renamed", {("renamed/" + k if k == key else k): v for k, v in header.items()})
    sizes = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in entries.items()}
    for a, b in swappable(sizes):
        case(f"{a} <-> {b}: data swapped", {**header, a: {**entries[a], "data_offsets": entries[b]["data_offsets"]},
                                            b: {**entries[b], "data_offsets": entries[a]["data_offsets"]}})
    meta = header["__metadata__"]
    for label, metadata in metadata_edits(json.loads(meta["ckpt_metadata"])):
        case(label, {**header, "__metadata__": {**meta, "ckpt_metadata": json.dumps(metadata)}})
    case("__metadata__ format np -> pt", {**header, "__metadata__": {**meta, "format": "pt"}})
    case("__metadata__ entry added", {**header, "__metadata__": {**meta, "x": "1"}})
    for field in (f for f in meta if f.startswith("ckpt_")):  # losing one of ckpt's marks is damage, not foreign
        rest = {k: v for k, v in meta.items() if k != field}
        case(f"__metadata__ without {field}", {**header, "__metadata__": rest})
        case(f"__metadata__ {field} renamed", {**header, "__metadata__": {**rest, "x" + field[1:]: meta[field]}})
    return cases


EDITS = {"hdf5": hdf5_meaning_edits, "msgpack": msgpack_meaning_edits, "safetensors": safetensors_meaning_edits}


def report(title: str, counts: collections.Counter) -> None:
    print(f"\n{title}: {sum(counts.values())} cases")
    for (region, kind), n in sorted(counts.items()):
        print(f"  {region:28} {kind:13} {n}")


@pytest.mark.parametrize("fmt", EXT)
def test_edits_of_what_the_bytes_mean_are_refused_on_open(tmp_path, pristine, fmt):
    path, raw = pristine[fmt]
    cases = EDITS[fmt](raw)
    counts = run_cases(str(tmp_path), path, tensors_for(fmt), cases)
    report(f"{fmt}: {len(cases)} edits of what the bytes mean, tensor checksums fixed up", counts)
    assert counts == {(f"{fmt} meaning", "open-error"): len(cases)} and len(cases) > 30


def test_one_byte_edits_of_a_ckpt_safetensors_header(tmp_path, pristine, reliability_scale):
    """The issue's edit ("F32" -> "I32") and seeded others: refused, or the same meaning (a
    space of padding turned into another whitespace), never other values."""
    path, raw = pristine["safetensors"]
    n, _header = safetensors_split(raw)
    text = raw[8:8 + n]
    first = text.index(b'"F32"') + 9  # the edit: 8 + 1 bytes into the dtype's string
    cases = [Case('dtype "F32" -> "I32"', raw[:first] + b"I" + raw[first + 1:], OPEN, region="header byte")]
    rng = random.Random("safetensors-header-bytes")
    for _ in range(HEADER_BYTE_EDITS * reliability_scale):
        pos = 8 + rng.randrange(n)
        new = rng.choice(b'0123456789"{}[],: \tFIUBaefilnrstx')
        if new != raw[pos]:
            cases.append(Case(f"byte {pos} {bytes([raw[pos]])!r} -> {bytes([new])!r}",
                              raw[:pos] + bytes([new]) + raw[pos + 1:], frozenset({"open-error", "equal"}),
                              region="header byte"))
    counts = run_cases(str(tmp_path), path, tensors_for("safetensors"), cases)
    report(f"safetensors: {len(cases)} one-byte header edits", counts)
    assert sum(counts.values()) == len(cases)
