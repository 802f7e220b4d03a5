"""Zeroed sectors and pages in the first pages of every format ckpt writes.

Disks and file systems lose whole sectors (512 bytes) or pages (4 KiB), and they come back as
zeros. Each case zeroes one 64-byte block, sector or page, or the first sector plus one more (ckpt's header
and index gone, and damage elsewhere that nothing but them could catch). The rule: a
CheckpointError or values bit-equal to what was saved, never other values; and a ckpt file
whose header was zeroed is refused on open, never read as an unchecksummed foreign file.
"""

from __future__ import annotations

import collections
import os
import shutil

import pytest
from reliability_support import (ANY, OPEN, Case, large_tensors, overwrite, run_cases, small_tensors, time_limit,
                                 write_checkpoint)

import ckpt
from ckpt.formats.base import open_reader
from conftest import TESTS

SECTOR, PAGE = 512, 4096
FIRST_PAGES = 8  # x --reliability-scale: how many of a file's first pages are damaged
FILES = {"hdf5-small": ".h5", "hdf5-large": ".h5", "msgpack-small": ".msgpack", "msgpack-large": ".msgpack",
         "safetensors-small": ".safetensors", "safetensors-large": ".safetensors"}


def tensors_for(name: str):
    tensors = small_tensors() if name.endswith("small") else large_tensors()
    return [(k, v) for k, v in tensors if not name.startswith("safetensors") or v.dtype.kind != "O"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sectors")
    out = {}
    for name, ext in FILES.items():
        path = str(directory / f"{name}{ext}")
        out[name] = (path, write_checkpoint(path, tensors_for(name), {"step": 3}))
    return out


def zeroed(raw: bytes, *spans: tuple[int, int]) -> bytes:
    data = bytearray(raw)
    for start, n in spans:
        data[start:start + n] = bytes(len(data[start:start + n]))
    return bytes(data)


def sector_cases(raw: bytes, pages: int) -> list[Case]:
    """Each sector and page of the first ``pages`` pages zeroed (and each 64-byte block of the
    first page: small files have few sectors); the first sector plus each other one."""
    end = min(len(raw), pages * PAGE)
    cases = []
    for unit, what, stop in ((64, "64-byte block", PAGE), (SECTOR, "sector", end), (PAGE, "page", end)):
        for start in range(0, min(end, stop), unit):
            if raw[start:start + unit].count(0) < len(raw[start:start + unit]):  # zeroing changes something
                expect = OPEN if start == 0 else ANY
                cases.append(Case(f"{what} at {start} zeroed", zeroed(raw, (start, unit)), expect, region=what))
    for start in range(SECTOR, end, SECTOR):
        cases.append(Case(f"sectors at 0 and {start} zeroed", zeroed(raw, (0, SECTOR), (start, SECTOR)), OPEN,
                          region="first sector + sector"))
    return cases


@pytest.mark.parametrize("name", FILES)
def test_zeroed_sectors_and_pages_never_read_as_other_values(tmp_path, pristine, name, reliability_scale):
    path, raw = pristine[name]
    cases = sector_cases(raw, FIRST_PAGES * reliability_scale)
    counts: collections.Counter = run_cases(str(tmp_path), path, tensors_for(name), cases)
    print(f"\n{name} ({len(raw)} bytes): {len(cases)} zeroed sectors and pages")
    for (region, kind), n in sorted(counts.items()):
        print(f"  {region:24} {kind:13} {n}")
    assert sum(counts.values()) == len(cases) > 0


# --- other frameworks' files --------------------------------------------------------------------------
FOREIGN = os.path.join(TESTS, "fixtures", "foreign")
#: (file to damage, path to open): HDF5 files are left out (libhdf5 is not safe on damaged input,
#: as DESIGN.md says); a .keras archive is, since its weights' CRC-32 is checked before h5py opens them.
FOREIGN_FILES = {
    "torch": ("torch_state.pt", "torch_state.pt"), "torch v3": ("torch_v3.pt", "torch_v3.pt"),
    "torch legacy": ("torch_legacy.pt", "torch_legacy.pt"),
    "tensorflow index": ("tf1_saver/model.ckpt-7.index", "tf1_saver/model.ckpt-7"),
    "tensorflow data": ("tf1_saver/model.ckpt-7.data-00000-of-00001", "tf1_saver/model.ckpt-7"),
    "tensorflow 2 index": ("tf2_object/ckpt-1.index", "tf2_object/ckpt-1"),
    "keras archive": ("keras3_model.keras", "keras3_model.keras"),
    "flax": ("flax_state.msgpack", "flax_state.msgpack"), "safetensors": ("st.safetensors", "st.safetensors"),
}


def read_all(path: str) -> tuple[str, dict | None, bool]:
    """("open-error"|"read-error"|"verify-error"|"read", values, checksummed); never another exception."""
    try:
        reader = open_reader(path)
    except ckpt.CheckpointError:
        return "open-error", None, True
    with reader:
        try:
            values = {key: reader.read(key) for key in list(reader.tensors)}
        except ckpt.CheckpointError:
            return "read-error", None, reader.checksummed
        return ("verify-error" if reader.verify() else "read"), values, reader.checksummed


@pytest.mark.parametrize("name", FOREIGN_FILES)
def test_zeroed_blocks_in_other_frameworks_files(tmp_path, name, reliability_scale):
    """A CheckpointError, or (for files with checksums) the values of the intact file."""
    damaged, opened = FOREIGN_FILES[name]
    copy = tmp_path / "copy"
    shutil.copytree(FOREIGN, copy)
    target, path = str(copy / damaged), str(copy / opened)
    with open(target, "rb") as f:
        raw = f.read()
    kind, pristine, checksummed = read_all(path)
    assert kind == "read" and pristine
    counts: collections.Counter = collections.Counter()
    spans = [(start, unit) for unit in (64, SECTOR, PAGE)
             for start in range(0, min(len(raw), FIRST_PAGES * reliability_scale * PAGE), unit)]
    for start, unit in spans:
        overwrite(target, zeroed(raw, (start, unit)))
        with time_limit(10, f"{name}: {unit} bytes at {start} zeroed"):
            kind, values, _ = read_all(path)
        if kind == "read" and checksummed:
            same = values.keys() == pristine.keys() and all(
                values[k].dtype == pristine[k].dtype and values[k].shape == pristine[k].shape and
                values[k].tobytes() == pristine[k].tobytes() if values[k].dtype.kind != "O" else
                values[k].tolist() == pristine[k].tolist() for k in values)
            assert same, f"{name}: {unit} bytes at {start} zeroed: other values, and no error"
            kind = "read (same values)"
        counts[kind] += 1
    overwrite(target, raw)
    print(f"\n{name} ({len(raw)} bytes, {'checksummed' if checksummed else 'no checksums'}): {dict(counts)}")
    assert sum(counts.values()) == len(spans)
