"""Block checksums in single-file checkpoints (msgpack version 3, HDF5 version 2): a slice of a
large tensor reads and verifies only the 1 MiB blocks that hold it; damage elsewhere does not
fail it, but fails verify and a whole read; older files still slice (by reading the tensor)."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest
from conftest import assert_bit_exact, TESTS
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt
from ckpt import distributed
from ckpt.formats import _blocks
from distributed_support import run_ranks

MIB = 1 << 20
SAMPLES = os.path.join(TESTS, os.pardir, "sample_checkpoints")
BIG = np.arange(3 << 20, dtype=np.float32).reshape(3072, 1024)  # 12 MiB: 12 blocks of 256 rows


@pytest.fixture(params=[".msgpack", ".h5"])
def big_file(request, tmp_path):
    return ckpt.Saver({"big": ckpt.Variable(BIG, name="big"), "small": ckpt.Variable(np.arange(5.0))}).save(
        str(tmp_path / ("model" + request.param)))


class CountReads:
    """Bytes the process reads from files with positioned reads (what the kernel is asked for)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.total = 0
        preadv, pread = os.preadv, os.pread

        def counting_preadv(fd, buffers, offset):
            n = preadv(fd, buffers, offset)
            self.total += n
            return n

        def counting_pread(fd, n, offset):
            data = pread(fd, n, offset)
            self.total += len(data)
            return data

        monkeypatch.setattr(os, "preadv", counting_preadv)
        monkeypatch.setattr(os, "pread", counting_pread)


def test_get_slice_of_a_big_tensor_reads_only_its_blocks(big_file, monkeypatch):
    with ckpt.load_checkpoint(big_file) as reader:
        count = CountReads(monkeypatch)
        assert_bit_exact(BIG[300:400, 10:20], reader.get_slice("big", np.s_[300:400, 10:20]))
        assert count.total == MIB  # rows 300..399 lie in block 1 (rows 256..511)
        count.total = 0
        assert_bit_exact(BIG[500:1300], reader.get_slice("big", np.s_[500:1300]))  # 3.1 MiB: blocks 1..5
        assert count.total == 5 * MIB <= BIG[500:1300].nbytes + 2 * MIB
        count.total = 0
        assert_bit_exact(BIG[:, 7], reader.get_slice("big", (slice(None), 7)))  # a column: every block
        assert count.total == BIG.nbytes
        count.total = 0
        assert_bit_exact(np.arange(1.0, 3.0), reader.get_slice("small", np.s_[1:3]))  # one block: the tensor
        assert count.total == 40
        assert reader._reader.bytes_read == MIB + 5 * MIB + BIG.nbytes + 40


def _flip(path: str, offset: int) -> None:
    raw = bytearray(pathlib.Path(path).read_bytes())
    raw[offset] ^= 0x04
    pathlib.Path(path).write_bytes(bytes(raw))


def _data_offset(path: str, key: str) -> int:
    with ckpt.load_checkpoint(path) as reader:
        ((offset, _), *_) = reader._reader.data_extents(key)
    return int(offset)


def test_damage_outside_a_slice_spares_it_but_fails_verify_and_whole_reads(big_file):
    _flip(big_file, _data_offset(big_file, "big") + 7 * MIB + 123)  # in block 7 (rows 1792..2047)
    with ckpt.load_checkpoint(big_file) as reader:
        assert_bit_exact(BIG[:1792], reader.get_slice("big", np.s_[:1792]))
        assert_bit_exact(BIG[2048:, 5:9], reader.get_slice("big", np.s_[2048:, 5:9]))
        problems = reader.verify()
        assert len(problems) == 1 and big_file in problems[0] and "'big'" in problems[0]
        with pytest.raises(ckpt.CorruptCheckpointError, match="'big' fails its checksum"):
            reader.get_tensor("big")
    with pytest.raises(ckpt.CorruptCheckpointError, match="big"):
        ckpt.Saver({"big": ckpt.Variable(np.zeros_like(BIG), name="big")}).restore(big_file)


def test_damage_inside_a_slice_names_the_file_key_and_bytes(big_file):
    _flip(big_file, _data_offset(big_file, "big") + 7 * MIB + 123)
    with ckpt.load_checkpoint(big_file) as reader:
        with pytest.raises(ckpt.CorruptCheckpointError) as caught:
            reader.get_slice("big", np.s_[2000:2001, :3])
        message = str(caught.value)
        assert message.startswith(f"{big_file}: tensor 'big', bytes {7 * MIB}..{8 * MIB}, fails its checksum")


def test_a_sharded_restore_from_one_file_reads_only_each_ranks_blocks(big_file, monkeypatch):
    """3 simulated ranks restore row blocks of BIG from a single-file checkpoint: each reads the
    1 MiB blocks its rows touch (the restore's own bytes, counted by the reader)."""
    read: list[int] = []
    with ckpt.load_checkpoint(big_file) as reader:
        cls = type(reader._reader)
    close = cls.close

    def counting_close(self) -> None:
        read.append(self.bytes_read)
        close(self)

    monkeypatch.setattr(cls, "close", counting_close)

    def fn(comm: distributed.Communicator) -> np.ndarray:
        rows = np.array_split(np.arange(3072), comm.size)[comm.rank]
        v = ckpt.Variable(np.zeros((len(rows), 1024), np.float32), name="big",
                          shard=ckpt.Shard(BIG.shape, (int(rows[0]), 0)))
        ckpt.Saver([v], comm=comm, timeout=20).restore(big_file)
        return v.numpy()

    read.clear()
    parts = run_ranks(3, fn)
    assert_bit_exact(BIG, np.concatenate(parts))
    needed = BIG.nbytes // 3  # 1024 rows each: 4 MiB, rank 1's from 1 MiB boundary to boundary
    assert sorted(n for n in read if n) == [needed, needed, needed]


@pytest.mark.parametrize("name", ["v2/mlp.msgpack", "v1/mlp.h5", "v1/mlp.msgpack"])
def test_files_without_block_checksums_still_slice(name):
    with ckpt.load_checkpoint(os.path.join(SAMPLES, name)) as reader:
        whole = reader.get_tensor("hidden/kernel")
        assert_bit_exact(whole[100:300, 5:7], reader.get_slice("hidden/kernel", np.s_[100:300, 5:7]))


@settings(deadline=None, max_examples=40)
@given(data=st.data(), ext=st.sampled_from([".msgpack", ".h5"]), block=st.sampled_from([8, 100, 4096]))
def test_any_box_of_any_tensor_reads_back_exactly(tmp_path_factory, data, ext, block):
    shape = tuple(data.draw(st.lists(st.integers(1, 9), min_size=1, max_size=3), label="shape"))
    dtype = data.draw(st.sampled_from([np.float64, np.int16, np.uint8, ckpt.dtypes.bfloat16]), label="dtype")
    value = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape).astype(dtype)
    path = str(tmp_path_factory.mktemp("box") / ("t" + ext))
    type(ckpt.formats.base.format_for_path(path))(block_bytes=block).write(path, [("t", value)], {})
    index = tuple(slice(*sorted(data.draw(st.tuples(st.integers(0, d), st.integers(0, d))))) for d in shape)
    with ckpt.load_checkpoint(path) as reader:
        assert (reader._reader.block_checksums("t") is not None) == (value.nbytes > block)
        assert_bit_exact(value[index], reader.get_slice("t", index))
        out = np.empty(value[index].shape, value.dtype)
        reader._reader.read_box_into("t", tuple(s.start for s in index), out)
        assert_bit_exact(value[index], out)
        assert reader.verify() == []


def test_block_checksums_combine_into_the_tensor_checksum():
    rng = np.random.default_rng(0)
    for n in (0, 1, 4095, 4096, 4097, 3 * 4096, 3 * 4096 + 17):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        whole, packed = _blocks.checksums(memoryview(data), 4096)()
        crcs = _blocks.block_crcs(memoryview(data), 4096)
        assert whole == _blocks.crc32c(data) == _blocks.combine(crcs, n, 4096)
        assert packed == (None if n <= 4096 else _blocks.pack_crcs(crcs))
