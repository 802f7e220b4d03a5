"""Zeroed sectors and pages in the first pages of every format ckpt writes.

Disks and file systems lose whole sectors (512 bytes) or pages (4 KiB), and they come back as
zeros. Each case zeroes one 64-byte block, sector or page, or the first sector plus one more (ckpt's header
and index gone, and damage elsewhere that nothing but them could catch). The rule: a
CheckpointError or values bit-equal to what was saved, never other values; and a ckpt file
whose header was zeroed is refused on open, never read as an unchecksummed foreign file.
"""

from __future__ import annotations

import collections

import pytest
from reliability_support import ANY, OPEN, Case, large_tensors, run_cases, small_tensors, write_checkpoint

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
