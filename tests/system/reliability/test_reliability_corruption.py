"""Corrupted checkpoints: truncation at every byte, seeded bit flips, edited header and index fields.

Every case ends in a ckpt.CheckpointError or in values bit-equal to what was saved, never in
another exception, a hang, a crash or wrong data; a restore of it is all-or-nothing. Damage
is classified by the region it hits, and each region has a sharper rule: a flip in tensor
data is caught by that tensor's checksum, one in a header, index or footer, or in HDF5's own
structure, by their checks when the file is opened. Cases whose bytes ckpt
would hand to libhdf5 (which can crash or hang on damaged input) run in a child process.
"""

from __future__ import annotations

import bisect
import collections
import random

import pytest
from reliability_support import (
    ANY,
    OPEN,
    Case,
    data_extents,
    hdf5_rebuild,
    hdf5_split,
    large_tensors,
    msgpack_rebuild,
    msgpack_split,
    packb,
    read_outcome,
    run_cases,
    small_tensors,
    write_checkpoint,
)

from ckpt.formats import hdf5 as hdf5_format
from ckpt.formats import msgpack as msgpack_format

FLIPS_PER_FORMAT = 1000  # x --reliability-scale: seeded single-bit flips anywhere in the file
LARGE_TRUNCATIONS = 150  # x --reliability-scale: random cut points of the ~550 KB checkpoint
EXT = {"hdf5": ".h5", "msgpack": ".msgpack"}
#: What a single damaged byte in each region may end in.
EXPECT = {
    "tensor data": frozenset({"read-error"}),  # and by that tensor's checksum (Case.key)
    "hdf5 magic": frozenset({"open-error", "equal"}),  # read as a plain HDF5 file: its structure is intact
    "hdf5 header": OPEN,
    "hdf5 index": OPEN,
    "hdf5 user-block padding": frozenset({"equal"}),  # bytes nobody reads (HDF5 skips the user block)
    "hdf5 structure": OPEN,  # the checksum over every non-data byte: h5py would read the changed structure
    "msgpack header": OPEN,
    "msgpack framing": frozenset({"verify-error"}),  # bin headers: plain msgpack readers need them intact
    "msgpack index": OPEN,
    "msgpack footer": OPEN,
}


class Regions:
    """Maps a byte offset of an intact checkpoint to the region it belongs to."""

    def __init__(self, raw: bytes) -> None:
        spans: list[tuple[int, int, str, str | None]] = []
        for key, extents in data_extents(raw).items():
            spans += [(offset, offset + n, "tensor data", key) for offset, n in extents]
        if raw.startswith(hdf5_format.MAGIC):
            head, _ = hdf5_split(raw)
            header, index_end = hdf5_format._HEADER.size, hdf5_format._HEADER.size + head[3]
            spans += [(0, len(hdf5_format.MAGIC), "hdf5 magic", None), (len(hdf5_format.MAGIC), header, "hdf5 header", None),
                      (header, index_end, "hdf5 index", None), (index_end, head[2], "hdf5 user-block padding", None)]
            self.default = "hdf5 structure"
        else:
            index_offset, _ = msgpack_split(raw)
            footer = len(raw) - msgpack_format.FOOTER_SIZE
            spans += [(0, msgpack_format.DATA_START, "msgpack header", None),  # array header + header map
                      (index_offset, footer, "msgpack index", None), (footer, len(raw), "msgpack footer", None)]
            self.default = "msgpack framing"
        self.spans = sorted(spans)
        self._starts = [s[0] for s in self.spans]

    def at(self, pos: int) -> tuple[str, str | None]:
        i = bisect.bisect_right(self._starts, pos) - 1
        if i >= 0 and self.spans[i][0] <= pos < self.spans[i][1]:
            return self.spans[i][2], self.spans[i][3]
        return self.default, None

    def positions(self, region: str) -> list[int]:
        return [p for s in self.spans if s[2] == region for p in range(s[0], s[1])]


def flip_case(raw: bytes, regions: Regions, bit: int) -> Case:
    data = bytearray(raw)
    data[bit // 8] ^= 1 << (bit % 8)
    region, key = regions.at(bit // 8)
    return Case(f"bit {bit} (byte {bit // 8})", bytes(data), EXPECT[region], key, region)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """The small and large checkpoints of both formats: {(format, size): (path, bytes)}."""
    directory = tmp_path_factory.mktemp("pristine")
    out = {}
    for fmt, ext in EXT.items():
        for size, tensors in (("small", small_tensors()), ("large", large_tensors())):
            path = str(directory / f"{size}{ext}")
            out[fmt, size] = (path, write_checkpoint(path, tensors))
    return out


def expected_of(size: str):
    return small_tensors() if size == "small" else large_tensors()


def report(title: str, counts: collections.Counter) -> None:
    """Print the (region, outcome) table (run with -s to see where damage was caught)."""
    print(f"\n{title}: {sum(counts.values())} cases")
    for (region, kind), n in sorted(counts.items()):
        print(f"  {region:28} {kind:13} {n}")


@pytest.mark.parametrize("fmt", EXT)
def test_truncation_at_every_byte_of_a_small_checkpoint(tmp_path, pristine, fmt):
    path, raw = pristine[fmt, "small"]
    cases = [Case(f"cut at {n} of {len(raw)}", raw[:n], OPEN, region="truncated") for n in range(len(raw))]
    counts = run_cases(str(tmp_path), path, small_tensors(), cases)
    assert counts == {("truncated", "open-error"): len(raw)}
    for n in (0, 40, len(raw) // 2, len(raw) - 1):  # the message says what happened
        (tmp_path / "cut").write_bytes(raw[:n])
        kind, detail = read_outcome(str(tmp_path / "cut"), small_tensors())
        assert kind == "open-error" and ("truncated" in detail or "empty file" in detail), (n, detail)
    report(f"{fmt}: truncations of the {len(raw)}-byte checkpoint", counts)


@pytest.mark.parametrize("fmt", EXT)
def test_truncation_at_random_offsets_of_a_larger_checkpoint(tmp_path, pristine, fmt, reliability_scale):
    path, raw = pristine[fmt, "large"]
    rng = random.Random(f"truncate-large-{fmt}")
    cuts = sorted({rng.randrange(len(raw)) for _ in range(LARGE_TRUNCATIONS * reliability_scale)})
    cases = [Case(f"cut at {n} of {len(raw)}", raw[:n], OPEN, region="truncated") for n in cuts]
    counts = run_cases(str(tmp_path), path, large_tensors(), cases)
    assert counts == {("truncated", "open-error"): len(cuts)}


@pytest.mark.parametrize("fmt", EXT)
def test_seeded_single_bit_flips_anywhere(tmp_path, pristine, fmt, reliability_scale):
    path, raw = pristine[fmt, "small"]
    regions = Regions(raw)
    rng = random.Random(f"flips-{fmt}")
    bits = [rng.randrange(len(raw) * 8) for _ in range(FLIPS_PER_FORMAT * reliability_scale)]
    counts = run_cases(str(tmp_path), path, small_tensors(), [flip_case(raw, regions, b) for b in bits])
    report(f"{fmt}: {len(bits)} seeded bit flips in the {len(raw)}-byte checkpoint", counts)
    assert sum(counts.values()) == len(bits)


@pytest.mark.parametrize("fmt", EXT)
def test_every_bit_flip_in_tensor_data_is_caught_by_its_checksum(tmp_path, pristine, fmt):
    path, raw = pristine[fmt, "small"]
    regions = Regions(raw)
    bits = [p * 8 + b for p in regions.positions("tensor data") for b in range(8)]
    assert len(bits) > 500
    counts = run_cases(str(tmp_path), path, small_tensors(), [flip_case(raw, regions, b) for b in bits])
    assert counts == {("tensor data", "read-error"): len(bits)}


@pytest.mark.parametrize("fmt", EXT)
def test_every_bit_flip_in_headers_indexes_and_footers_is_caught_on_open(tmp_path, pristine, fmt):
    path, raw = pristine[fmt, "small"]
    regions = Regions(raw)
    names = ["hdf5 header", "hdf5 index"] if fmt == "hdf5" else ["msgpack header", "msgpack index", "msgpack footer"]
    bits = [p * 8 + b for name in names for p in regions.positions(name) for b in range(8)]
    counts = run_cases(str(tmp_path), path, small_tensors(), [flip_case(raw, regions, b) for b in bits])
    assert {kind for _, kind in counts} == {"open-error"} and sum(counts.values()) == len(bits)
    report(f"{fmt}: every bit of the header, index and footer", counts)


def test_hdf5_magic_flips_fall_back_to_the_intact_hdf5_structure(tmp_path, pristine):
    """A damaged ckpt magic routes the file to libhdf5 (in a child process here); with the HDF5
    structure intact, every value still reads back exactly or the file is refused."""
    path, raw = pristine["hdf5", "small"]
    regions = Regions(raw)
    cases = [flip_case(raw, regions, b) for b in range(len(hdf5_format.MAGIC) * 8)]
    counts = run_cases(str(tmp_path), path, small_tensors(), cases)
    report("hdf5: every bit of the magic", counts)
    assert sum(counts.values()) == 64


# --- edited header and index fields (checksums fixed up, so the field checks are reached) --------
def hdf5_edits(raw: bytes) -> list[Case]:
    """Edits of every header and index field of a ckpt HDF5 file."""
    head, index = hdf5_split(raw)
    size, block = len(raw), head[2]
    cases = []

    def index_case(label: str, new_index: dict, expect=OPEN) -> None:
        cases.append(Case(label, hdf5_rebuild(raw, packb(new_index)), expect, region="hdf5 index edit"))

    def header_case(label: str, expect=OPEN, **fields) -> None:
        cases.append(Case(label, hdf5_rebuild(raw, packb(index), **fields), expect, region="hdf5 header edit"))

    for version in (0, 1, 3, 2 ** 32 - 1):  # 1: the index says 2
        header_case(f"header version {version}", version=version)
    for userblock in (0, 256, 511, 513, block * 2, 2 ** 31):
        header_case(f"header user block {userblock}", ANY, userblock=userblock)
    for index_len in (0, 1, head[3] - 1, head[3] + 1, block, 2 ** 64 - 1):
        header_case(f"header index length {index_len}", index_len=index_len)
    header_case("header index crc off by one bit", index_crc=head[4] ^ 1)
    header_case("header crc off by one bit", header_crc=1)

    for field, values in {"format": ["ckpt-msgpack", 5, None, _MISSING], "version": [0, 1, 3, -1, "2", None],
                          "file_size": [size - 1, size + 1, 0, -1, 2 ** 64 - 1, "big", None],
                          "metadata": [[], None, "x"], "tensors": [None, {}, "x", 5]}.items():
        for value in values:
            index_case(f"index {field} = {value!r}", edited(index, field, value))
    index_case("index metadata crc off by one bit", edited(index, "metadata_crc32c", index["metadata_crc32c"] ^ 1))
    block_table_cases(index, next(e[0] for e in index["tensors"] if e[1] == "float32" and e[4]),
                      next(e[0] for e in index["tensors"] if e[1] == "string"), index_case)
    index_case("index without tensors", edited(index, "tensors", []))  # all data then counts as structure
    index_case("index with a tensor listed twice", edited(index, "tensors", index["tensors"] + index["tensors"][:1]))

    entries = index["tensors"]
    numeric = next(i for i, e in enumerate(entries) if e[1] == "float32" and e[4])
    string = next(i for i, e in enumerate(entries) if e[1] == "string")
    other = next(i for i, e in enumerate(entries) if i != numeric and e[4])
    base = entries[numeric]
    variants: dict[str, tuple[list, frozenset]] = {}
    for n in (5, 7, 9):
        variants[f"entry of length {n}"] = ((base + [0, 0, 0])[:n], OPEN)
    for key in ("", "a/../b", "/lead", "trail/", "a//b", "nul\x00", ".", 5, b"bytes", entries[other][0]):
        variants[f"key {key!r}"] = ([key] + base[1:], OPEN)
    for dtype in ("float31", 5, None, "object", "<f4", "float64"):
        variants[f"dtype {dtype!r}"] = ([base[0], dtype] + base[2:], OPEN)
    for shape in ([-1], [2 ** 62, 2 ** 62], "x", [1] * 65, [True, 3], [1.5], [3, 5], None):
        variants[f"shape {shape!r}"] = (base[:2] + [shape] + base[3:], OPEN)
    for offset in (0, -1, size, size - 1, block - 1, 2 ** 64 - 1, "x", entries[other][3]):
        variants[f"offset {offset!r}"] = (base[:3] + [offset] + base[4:], OPEN)
    variants["offset shifted by one byte"] = (base[:3] + [base[3] + 1] + base[4:], frozenset({"read-error", "open-error"}))
    for nbytes in (base[4] + 1, base[4] - 1, 0, -5, 2 ** 64 - 1):
        variants[f"nbytes {nbytes}"] = (base[:4] + [nbytes] + base[5:], OPEN)
    variants["crc off by one bit"] = (base[:5] + [base[5] ^ 1], frozenset({"read-error"}))
    for crc in (2 ** 32, -1, "x"):
        variants[f"crc {crc!r}"] = (base[:5] + [crc], OPEN)
    for label, (entry, expect) in variants.items():
        new = list(entries)
        new[numeric] = entry
        index_case(f"float32 entry: {label}", edited(index, "tensors", new), expect)

    sbase = entries[string]
    for label, entry in {"itemsize 0": sbase[:6] + [0, sbase[7]], "itemsize -1": sbase[:6] + [-1, sbase[7]],
                         "itemsize 2**40": sbase[:6] + [2 ** 40, sbase[7]],
                         "lengths too few": sbase[:7] + [[1]], "lengths too long": sbase[:7] + [[1, 2, 3, 4]],
                         "length above itemsize": sbase[:7] + [[sbase[6] + 1, 0, 0]],
                         "negative length": sbase[:7] + [[-1, 0, 0]], "lengths not a list": sbase[:7] + ["x"],
                         "no itemsize": sbase[:6]}.items():
        new = list(entries)
        new[string] = entry
        index_case(f"string entry: {label}", edited(index, "tensors", new))
    return cases


def block_table_cases(index: dict, numeric: str, string: str, index_case) -> None:
    """Edits of the block checksum fields (msgpack version 3, HDF5 version 2) of an index whose
    tensors all fit in one block (so the table is empty)."""
    assert index["block_crcs"] == {} and index["block_bytes"] == 1 << 20
    for value in (0, -1, "x", None, True, _MISSING):
        index_case(f"index block_bytes = {value!r}", edited(index, "block_bytes", value))
    for value in (None, "x", 5, [], _MISSING, {"no/such/key": b"\0" * 4}, {string: b"\0" * 4},
                  {numeric: b"\0" * 3}, {numeric: b"\0" * 8}, {numeric: [0]}, {numeric: None}):
        index_case(f"index block_crcs = {value!r}", edited(index, "block_crcs", value))
    # a well-formed but wrong checksum of the tensor's one block: whole reads use the tensor's own
    # crc32c, so only verify (which checks that the blocks' checksums combine into it) sees it
    index_case("index block_crcs with a wrong one-block checksum", edited(index, "block_crcs", {numeric: b"\0" * 4}),
               frozenset({"verify-error"}))


def msgpack_edits(raw: bytes) -> list[Case]:
    """Edits of every footer and index field of a ckpt msgpack file."""
    index_offset, index = msgpack_split(raw)
    index_bytes = packb(index)
    size = len(raw)
    cases = []

    def footer_case(label: str, data: bytes, expect=OPEN) -> None:
        cases.append(Case(label, data, expect, region="msgpack footer edit"))

    for offset in (0, index_offset - 1, index_offset + 1, size, 2 ** 64 - 1):
        footer_case(f"footer index offset {offset}", msgpack_rebuild(raw, index_bytes, offset=offset))
    for length in (0, len(index_bytes) - 1, len(index_bytes) + 1, 2 ** 64 - 1):
        footer_case(f"footer index length {length}", msgpack_rebuild(raw, index_bytes, length=length))
    footer_case("footer crc off by one bit", msgpack_rebuild(raw, index_bytes, crc=1))
    footer = len(raw) - msgpack_format.FOOTER_SIZE
    for pos, label in ((0, "array marker"), (2, "magic"), (11, "offset type"), (20, "length type"),
                       (29, "crc type")):
        data = bytearray(raw)
        data[footer + pos] ^= 0x01
        footer_case(f"footer {label} byte changed", bytes(data))
    data = bytearray(raw)
    for version in (4, 2):  # 2: the index says 3
        data[msgpack_format.DATA_START - 1] = version
        footer_case(f"header says version {version}", bytes(data))
    data[msgpack_format.DATA_START - 1] = 1
    footer_case("header says version 1 behind an array header", bytes(data))
    footer_case("array header counts one object more", bytes([raw[0]]) + (int.from_bytes(raw[1:5], "big") + 1)
                .to_bytes(4, "big") + raw[5:])
    footer_case("version 3 objects without the array header", raw[5:])

    def index_case(label: str, new_index: dict, expect=OPEN) -> None:
        cases.append(Case(label, msgpack_rebuild(raw, packb(new_index)), expect, region="msgpack index edit"))

    for field, values in {"format": ["ckpt-hdf5", 5, None, _MISSING], "version": [0, 1, 2, 4, -1, "3", None],
                          "metadata": [[], None, "x"], "tensors": [None, [], "x", 5]}.items():
        for value in values:
            index_case(f"index {field} = {value!r}", edited(index, field, value))
    block_table_cases(index, next(k for k, e in index["tensors"].items() if e[0] == "float32" and e[2][0][1]),
                      next(k for k, e in index["tensors"].items() if e[0] == "string"), index_case)
    # the array header still counts the payloads the index no longer describes
    index_case("index without tensors", edited(index, "tensors", {}))

    tensors = index["tensors"]
    numeric = next(k for k, e in tensors.items() if e[0] == "float32" and e[2][0][1])
    other = next(k for k, e in tensors.items() if k != numeric and e[2][0][1])
    base = tensors[numeric]
    (offset, n), = base[2]
    variants: dict[str, tuple[list, frozenset]] = {}
    for length in (3, 5):
        variants[f"entry of length {length}"] = ((base + [0])[:length], OPEN)
    for dtype in ("float31", 5, None, "object", "<f4", "float64"):
        variants[f"dtype {dtype!r}"] = ([dtype] + base[1:], OPEN)
    for shape in ([-1], [2 ** 62, 2 ** 62], "x", [1] * 65, [True, 3], [1.5], [3, 5], None):
        variants[f"shape {shape!r}"] = ([base[0], shape] + base[2:], OPEN)
    for extents in ([], None, "x", [[offset]], [[offset, n, 0]], [[offset, -1]], [[-5, n]], [[0, n]],
                    [[index_offset, n]], [[size, n]], [[offset, 2 ** 64 - 1]], [[offset, n - 1]], [[offset, n + 1]],
                    [[offset, 8], [offset + 4, n - 8]], [tensors[other][2][0]], [["x", n]]):
        variants[f"extents {extents!r}"] = (base[:2] + [extents] + base[3:], OPEN)
    variants["extent shifted by one byte"] = (base[:2] + [[[offset + 1, n]]] + base[3:],
                                               frozenset({"read-error", "open-error"}))
    variants["crc off by one bit"] = (base[:3] + [base[3] ^ 1], frozenset({"read-error"}))
    for crc in (2 ** 32, -1, "x"):
        variants[f"crc {crc!r}"] = (base[:3] + [crc], OPEN)
    for label, (entry, expect) in variants.items():
        index_case(f"float32 entry: {label}", edited(index, "tensors", {**tensors, numeric: entry}), expect)
    for key in ("", "a/../b", "/lead", "trail/", "a//b", "nul\x00", "."):
        index_case(f"key {key!r}", edited(index, "tensors", {**tensors, key: tensors[numeric]}))
    return cases


_MISSING = object()


def edited(index: dict, field: str, value: object) -> dict:
    """A copy of ``index`` with ``field`` set to ``value`` (or removed, for _MISSING)."""
    new = dict(index)
    if value is _MISSING:
        del new[field]
    else:
        new[field] = value
    return new


@pytest.mark.parametrize("fmt", EXT)
def test_edited_header_and_index_fields(tmp_path, pristine, fmt):
    path, raw = pristine[fmt, "small"]
    cases = hdf5_edits(raw) if fmt == "hdf5" else msgpack_edits(raw)
    counts = run_cases(str(tmp_path), path, small_tensors(), cases)
    report(f"{fmt}: {len(cases)} header/index field edits", counts)
    assert sum(counts.values()) == len(cases) > 60


def test_damaged_hdf5_magic_plus_more_damage_never_reads_wrong_values(tmp_path, pristine, reliability_scale):
    """Two flips: one in ckpt's magic and one in tensor data or HDF5's structure. Without
    ckpt's magic the index and checksums would be skipped; the damage must still be refused."""
    path, raw = pristine["hdf5", "small"]
    regions = Regions(raw)
    rng = random.Random("magic-plus")
    targets = [regions.positions("tensor data"),
               [p for p in range(len(raw)) if regions.at(p)[0] == "hdf5 structure"]]
    cases = []
    for i in range(100 * reliability_scale):
        data = bytearray(raw)
        magic_bit, pos = rng.randrange(len(hdf5_format.MAGIC) * 8), rng.choice(targets[i % 2])
        data[magic_bit // 8] ^= 1 << (magic_bit % 8)
        data[pos] ^= 1 << rng.randrange(8)
        region = regions.at(pos)[0]
        cases.append(Case(f"magic bit {magic_bit} + byte {pos}", bytes(data),
                          frozenset({"open-error", "read-error"}), region=f"magic + {region}"))
    counts = run_cases(str(tmp_path), path, small_tensors(), cases)
    report("hdf5: damaged magic plus one more flipped bit", counts)


def test_msgpack_verify_sees_damaged_framing(tmp_path, pristine):
    _path, raw = pristine["msgpack", "small"]
    regions = Regions(raw)
    framing = [p for p in range(len(raw)) if regions.at(p)[0] == "msgpack framing"]
    assert framing
    undetected = []
    for pos in framing:
        for bit in range(8):
            data = bytearray(raw)
            data[pos] ^= 1 << bit
            (tmp_path / "case.msgpack").write_bytes(bytes(data))
            kind, _ = read_outcome(str(tmp_path / "case.msgpack"), small_tensors())
            if kind == "equal":
                undetected.append(f"byte {pos} bit {bit}")
    assert not undetected, f"{len(undetected)} of {len(framing) * 8} framing flips pass verify(): {undetected[:5]}"
