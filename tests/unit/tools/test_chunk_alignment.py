"""Streamed reads land in page-aligned memory, as tensors sit at page-aligned file offsets (the
kernel copies between the two 1.6x faster when they agree: docs/benchmarks.md)."""

from __future__ import annotations

import numpy as np
import pytest

import ckpt
from ckpt.buffers import PAGE
from ckpt.storage.blobio import checksum_range
from ckpt.storage.localfile import LocalFile
from ckpt.tools import chunks as _chunks

MiB = 1 << 20


@pytest.mark.parametrize("ext", [".msgpack", ".h5"])
def test_streamed_chunks_are_page_aligned_and_exact_also_when_their_buffers_are_reused(tmp_path, ext):
    x = np.random.default_rng(29).standard_normal(3 * MiB + 77).astype(np.float32)  # 12 MiB: 4 chunks
    path = str(tmp_path / f"m{ext}")
    ckpt.save_file({"x": x, "y": x[::-1].copy()}, path)
    with ckpt.load_checkpoint(path) as reader, _chunks.reusing_buffers():
        for key, want in (("x", x), ("y", x[::-1]), ("x", x)):  # later tensors get the first one's buffers
            got, addresses = [], []
            for chunk in _chunks.tensor_chunks(reader, key, chunk_bytes=4 * MiB):
                addresses.append(chunk.ctypes.data % PAGE)
                got.append(chunk.copy())
            assert len(got) == 4 and addresses == [0] * 4
            assert np.concatenate(got).tobytes() == want.tobytes()


class _Recording:
    """A local file that records the memory addresses ``read_spans`` fills."""

    def __init__(self, blob: LocalFile) -> None:
        self.blob, self.addresses = blob, []

    def read_spans(self, spans, name):
        self.addresses += [np.frombuffer(view, np.uint8).ctypes.data % PAGE for _, view in spans]
        return self.blob.read_spans(spans, name)


def test_a_long_checksum_reads_into_page_aligned_memory(tmp_path):
    data = np.random.default_rng(3).integers(0, 256, 20 * MiB + 5, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    with LocalFile(str(path)) as blob:
        recording = _Recording(blob)
        got = checksum_range(recording, 0, data.size, "the data")  # type: ignore[arg-type]
    assert got == ckpt.checksums.crc32c(data.tobytes())
    assert len(recording.addresses) == 3 and set(recording.addresses) == {0}
