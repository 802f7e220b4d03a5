"""Sharded checkpoints with simulated ranks (threads): resharding, agreement, timeouts, leftovers,
partial reads. The same code paths run under real MPI processes in test_mpi.py."""

from __future__ import annotations

import json
import os
import re
import threading
import pathlib
import struct

import crc32c
import msgpack
import numpy as np
import pytest

import ckpt
from ckpt import boxes, distributed
from ckpt.formats import ckpt_sharded as sharded
from conftest import assert_bit_exact, OUTSIDE_CHECKOUT
from distributed_support import global_tensors, layout, make_variables, run_ranks


def _save(directory: str, size: int, kind: str, step: int = 1, ext: str = ".msgpack", **saver_args: object) -> list:
    tensors = global_tensors()

    def fn(comm: distributed.Communicator) -> str:
        variables = make_variables(tensors, kind, comm.rank, size)
        return ckpt.Saver(variables, comm=comm, timeout=20, **saver_args).save(
            os.path.join(directory, "model" + ext), global_step=step)

    return run_ranks(size, fn)


@pytest.mark.parametrize("kind_in,kind_out", [("rows", "cols"), ("uneven", "rows"), ("cols", "uneven")])
@pytest.mark.parametrize("n,m", [(1, 3), (2, 4), (3, 2), (4, 1), (4, 3)])
def test_reshard_n_to_m(tmp_path, n, m, kind_in, kind_out):
    tensors = global_tensors()
    paths = _save(str(tmp_path), n, kind_in, ext=".h5" if n % 2 else ".msgpack")
    assert all(p == paths[0] and isinstance(p, str) for p in paths), paths

    def fn(comm: distributed.Communicator) -> dict:
        variables = make_variables(tensors, kind_out, comm.rank, m, zero=True)
        result = ckpt.Saver(variables, comm=comm, timeout=20).restore(str(tmp_path))
        assert result.path == paths[0]
        return {k: v.numpy() for k, v in variables.items()}

    for rank, got in enumerate(run_ranks(m, fn)):
        assert not isinstance(got, BaseException), got
        for key, value in tensors.items():
            offset, block = layout(kind_out, value.shape, rank, m)
            assert_bit_exact(np.asarray(value[tuple(slice(o, o + b) for o, b in zip(offset, block))]),
                             np.asarray(got[key]).reshape(block))
        assert int(got["step"]) == 42


def test_sharded_to_whole_and_single_file_to_sharded(tmp_path):
    tensors = global_tensors()
    path = _save(str(tmp_path / "a"), 3, "rows")[0] if os.makedirs(tmp_path / "a") is None else None
    # a plain process: load_checkpoint assembles global tensors; plain variables restore whole
    with ckpt.load_checkpoint(path) as reader:
        assert reader.format == "ckpt-sharded"
        for key, value in tensors.items():
            assert_bit_exact(value, reader.get_tensor(key))
        assert reader.verify() == []
    whole = {k: ckpt.Variable(np.zeros_like(v) if v.dtype.kind != "O" else np.full(v.shape, b"", object),
                              name="w" + str(i), dtype=v.dtype) for i, (k, v) in enumerate(tensors.items())}
    assert sorted(ckpt.Saver(whole).restore(path).restored) == sorted(tensors)
    for key, value in tensors.items():
        assert_bit_exact(value, np.asarray(whole[key].numpy()))
    # a single-file checkpoint restores into sharded variables
    single = ckpt.Saver(whole).save(str(tmp_path / "single.msgpack"))

    def fn(comm: distributed.Communicator) -> dict:
        variables = make_variables(tensors, "cols", comm.rank, 2, zero=True)
        ckpt.Saver({k: v for k, v in variables.items() if k != "step"}, comm=comm, timeout=20).restore(single)
        return {k: v.numpy() for k, v in variables.items()}

    for rank, got in enumerate(run_ranks(2, fn)):
        for key, value in tensors.items():
            offset, block = layout("cols", value.shape, rank, 2)
            assert_bit_exact(value[tuple(slice(o, o + b) for o, b in zip(offset, block))],
                             np.asarray(got[key]).reshape(block))


def test_replicated_written_once_and_zero_size_blocks_skipped(tmp_path):
    path = _save(str(tmp_path), 4, "uneven")[0]
    with sharded.ShardedReader(path) as reader:
        info = reader.tensors["step"]
        assert len(info.extra) == 1  # one rank wrote the replicated scalar
        assert len(reader.tensors["emb"].extra) == 3  # the 4th rank's block is empty: not written
        assert len(reader.tensors["empty"].extra) == 0
        assert reader.ranks == 4


def test_get_slice_reads_only_the_checksum_blocks_it_needs(tmp_path):
    big = np.arange(1_000_000, dtype=np.float32).reshape(1000, 1000)  # 4 MB: 4 checksum blocks

    def fn(comm: distributed.Communicator) -> str:
        rows = np.array_split(np.arange(1000), comm.size)[comm.rank]
        v = ckpt.Variable(big[rows[0]:rows[-1] + 1], name="big", shard=ckpt.Shard(big.shape, (int(rows[0]), 0)))
        return ckpt.Saver([v], comm=comm, timeout=20).save(str(tmp_path / "m.msgpack"))

    path = run_ranks(2, fn)[0]
    with sharded.ShardedReader(path) as reader:
        part = reader.read_slice("big", np.s_[100:200, 10:20])
        assert_bit_exact(big[100:200, 10:20], part)
        assert reader.bytes_read == 1 << 20  # rows 100..199 lie in the first 1 MiB block of rank 0's file
        reader.bytes_read = 0
        assert_bit_exact(big[250:750], reader.read_slice("big", np.s_[250:750]))
        assert reader.bytes_read <= big[250:750].nbytes + 2 * (1 << 20)
        assert_bit_exact(big[999, 3:5], reader.read_slice("big", (999, slice(3, 5))))
        assert_bit_exact(big[:, 7], reader.read_slice("big", (slice(None), 7)))
        with pytest.raises(IndexError):
            reader.read_slice("big", np.s_[::2])
        with pytest.raises(IndexError):
            reader.read_slice("big", (1000, 0))
    # the same through the public API, and on a single-file checkpoint
    with ckpt.load_checkpoint(path) as r:
        assert_bit_exact(big[5:9, 1:3], r.get_slice("big", np.s_[5:9, 1:3]))
    single = ckpt.Saver({"big": ckpt.Variable(big, name="b2")}).save(str(tmp_path / "s.h5"))
    with ckpt.load_checkpoint(single) as r:
        assert_bit_exact(big[5:9, 1:3], r.get_slice("big", np.s_[5:9, 1:3]))


def test_partial_read_detects_a_damaged_block(tmp_path):
    big = np.arange(1 << 19, dtype=np.float64).reshape(512, 1024)  # 4 MiB, one rank

    path = ckpt.Saver({"big": ckpt.Variable(big, name="big", shard=ckpt.Shard(big.shape, (0, 0)))},
                      comm=distributed.local()).save(str(tmp_path / "m.msgpack"))
    shard_file = next(os.path.join(path, n) for n in os.listdir(path) if sharded.is_shard_file(n))
    with ckpt.load_checkpoint(path) as reader:
        offset = reader._reader._shard(0).data_extents("big")[0][0]
    with open(shard_file, "r+b") as f:  # flip a byte in the third MiB
        f.seek(offset + (2 << 20) + 5)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    with ckpt.load_checkpoint(path) as reader:
        assert_bit_exact(big[:10], reader.get_slice("big", np.s_[:10]))  # the first MiB is sound
        with pytest.raises(ckpt.CorruptCheckpointError, match="big.*checksum"):
            reader.get_slice("big", np.s_[300:310])
        assert any("checksum" in p for p in reader.verify())


def _disagreeing(tmp_path, size: int, make) -> list:
    def fn(comm: distributed.Communicator) -> str:
        saver = ckpt.Saver(make(comm.rank), comm=comm, timeout=20)
        return saver.save(str(tmp_path / "model.msgpack"), global_step=3)

    return run_ranks(size, fn)


@pytest.mark.parametrize("case,expected", [
    ("dtype", "w: the ranks hold different dtypes: float32 on rank 0; float64 on rank 1"),
    ("global_shape", "w: the ranks hold different global shapes"),
    ("overlap", "w: the blocks of rank 0 and rank 1 overlap"),
    ("gap", "w: element (2,) is in no block"),
    ("keys", "x: only on rank 1, not on rank 0"),
    ("mixed", "w: a block of a sharded tensor on rank 0, replicated (no Shard) on rank 1"),
])
def test_disagreement_raises_on_every_rank_before_writing(tmp_path, case, expected):
    def make(rank: int) -> dict:
        n = 3 if case == "overlap" and rank == 0 else 2
        offset = 0 if rank == 0 else (2 if case != "gap" else 4)
        dtype = np.float64 if case == "dtype" and rank else np.float32
        gshape = (6,) if case == "global_shape" and rank else (4,) if case != "gap" else (6,)
        if case == "gap":
            n = 2
        shard = ckpt.Shard(gshape, (offset,)) if not (case == "mixed" and rank) else None
        value = np.zeros(n if shard else 4, dtype)
        out = {"w": ckpt.Variable(value, name="w", shard=shard)}
        if case == "keys" and rank:
            out["x"] = ckpt.Variable(1.0, name="x")
        return out

    results = _disagreeing(tmp_path, 2, make)
    for exc in results:
        assert isinstance(exc, ckpt.MismatchError), exc
        assert expected in str(exc)
        assert "nothing was written" in str(exc)
    assert os.listdir(tmp_path) == []


def test_ranks_saving_different_paths_or_steps(tmp_path):
    def fn(comm: distributed.Communicator) -> str:
        saver = ckpt.Saver({"v": ckpt.Variable(1.0, name="v")}, comm=comm, timeout=20)
        return saver.save(str(tmp_path / "model.msgpack"), global_step=comm.rank)

    for exc in run_ranks(3, fn):
        assert isinstance(exc, ckpt.MismatchError)
        assert "different paths" in str(exc) and "on rank 2" in str(exc)
    assert os.listdir(tmp_path) == []


def test_a_rank_that_never_arrives_times_out(tmp_path):
    def fn(comm: distributed.Communicator) -> str:
        saver = ckpt.Saver({"v": ckpt.Variable(1.0, name="v")}, comm=comm, timeout=0.5)
        if comm.rank == 2:
            return "absent"
        return saver.save(str(tmp_path / "model.msgpack"))

    results = run_ranks(3, fn)
    for exc in results[:2]:
        assert isinstance(exc, ckpt.CheckpointWriteError), exc
        assert "did not complete within 0.5 s" in str(exc) and "rank(s) 2 did not arrive" in str(exc)
    assert ckpt.latest_checkpoint(str(tmp_path)) is None


def test_a_blocking_save_failing_on_one_rank_before_it_starts_fails_on_every_rank_at_once(tmp_path):
    """A rank whose blocking save fails before the first exchange (metadata it cannot store on rank 1,
    a step that is not an int on rank 0) still takes part in it with its error: it raises its own
    error, every other rank a CheckpointWriteError naming it at once (not "did not complete within
    60 s"), nothing is written, and the next save works on every rank. (Under mpiexec: test_mpi.py.)"""
    def fn(comm: distributed.Communicator) -> list:
        v = ckpt.Variable(np.arange(4.0) + comm.rank, name="v", shard=ckpt.Shard((12,), (4 * comm.rank,)))
        saver = ckpt.Saver([v], comm=comm, timeout=60)
        out: list = []
        for step, metadata in ((1, {"bad": {1}} if comm.rank == 1 else None), ("x" if comm.rank == 0 else 1, None)):
            try:
                out.append(saver.save(str(tmp_path / "m.msgpack"), global_step=step, metadata=metadata))
            except Exception as exc:
                out.append(exc)
        out.append(saver.save(str(tmp_path / "m.msgpack"), global_step=3))
        return out

    results = run_ranks(3, fn)
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert isinstance(results[1][0], ValueError) and "metadata key 'bad'" in str(results[1][0])
    assert isinstance(results[0][1], TypeError)
    for failed, others, kind in ((1, (0, 2), "InvalidMetadataError"), (0, (1, 2), "TypeError")):
        for rank in others:
            error = results[rank][0 if failed == 1 else 1]
            assert isinstance(error, ckpt.CheckpointWriteError), error
            assert f"the sharded save failed on rank {failed}: {kind}" in str(error), error
            assert "nothing was written" in str(error)
    assert {r[2] for r in results} == {str(tmp_path / "m-3.msgpack")}
    assert not (tmp_path / "m-1.msgpack").exists() and not (tmp_path / "m-x.msgpack").exists()
    assert ckpt.latest_checkpoint(str(tmp_path)) == str(tmp_path / "m-3.msgpack")
    with ckpt.load_checkpoint(str(tmp_path / "m-3.msgpack")) as reader:
        assert_bit_exact(np.concatenate([np.arange(4.0) + r for r in range(3)]), reader.get_tensor("v"))


def test_restore_timeout_and_failure_on_one_rank(tmp_path):
    path = _save(str(tmp_path), 2, "rows")[0]

    def absent(comm: distributed.Communicator) -> object:
        if comm.rank == 1:
            return None
        return ckpt.Saver({"step": ckpt.Variable(np.int64(0), name="s")}, comm=comm, timeout=0.5).restore(path)

    exc = run_ranks(2, absent)[0]
    assert isinstance(exc, distributed.CollectiveTimeoutError) and isinstance(exc, ckpt.CheckpointError)

    def one_fails(comm: distributed.Communicator) -> object:
        key = "step" if comm.rank == 0 else "nope"
        return ckpt.Saver({key: ckpt.Variable(np.int64(0), name="s")}, comm=comm, timeout=20).restore(path)

    results = run_ranks(2, one_fails)
    assert isinstance(results[1], ckpt.KeyNotFoundError)
    assert isinstance(results[0], ckpt.KeyNotFoundError) and "failed on rank(s) 1" in str(results[0])


def test_retention_and_leftovers_of_killed_saves(tmp_path):
    def fn(comm: distributed.Communicator) -> list:
        saver = ckpt.Saver({"v": ckpt.Variable(1.0, name="v")}, comm=comm, timeout=20, max_to_keep=2)
        for step in (1, 2, 3):
            saver.save(str(tmp_path / "model.msgpack"), global_step=step)
        return saver.last_checkpoints

    for kept in run_ranks(2, fn):  # every rank knows what rank 0 kept
        assert [os.path.basename(p) for p in kept] == ["model-2.msgpack", "model-3.msgpack"]
    for step in (1, 2, 3):
        _save(str(tmp_path), 2, "rows", step=step, max_to_keep=2)
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == [
        "checkpoint", "model-2.msgpack", "model-3.msgpack"]
    # what a save killed before its commit leaves: a directory of shard files without COMMIT
    dead = tmp_path / "model-4.msgpack"
    os.makedirs(dead)
    (dead / (("ab" * 8) + ".00000-of-00002.msgpack")).write_bytes(b"partial")
    (dead / (".abababababababab.saving")).write_bytes(b"")
    assert ckpt.latest_checkpoint(str(tmp_path)).endswith("model-3.msgpack")
    with pytest.raises(ckpt.CheckpointNotFoundError, match="no commit record|no checkpoint"):
        ckpt.load_checkpoint(str(dead))
    # a stray shard file inside a committed checkpoint (a killed re-save of the same step)
    stray = tmp_path / "model-3.msgpack" / (("cd" * 8) + ".00001-of-00002.msgpack")
    stray.write_bytes(b"x")
    # a failed save whose rank 0 removed its lock before any rank wrote: an empty checkpoint directory
    empty, users = tmp_path / "model-6.msgpack", tmp_path / "logs"
    os.makedirs(empty)
    os.makedirs(users)
    _save(str(tmp_path), 2, "rows", step=5, max_to_keep=2)
    assert not dead.exists() and not empty.exists()
    assert users.is_dir()  # an empty directory without a checkpoint's name is not ours
    _save(str(tmp_path), 2, "rows", step=3, max_to_keep=2)  # saved again under the same name
    assert not stray.exists()
    names = os.listdir(tmp_path / "model-3.msgpack")
    assert len([n for n in names if sharded.is_shard_file(n)]) == 2 and "COMMIT" in names


def test_save_without_comm_refuses_sharded_variables(tmp_path):
    v = ckpt.Variable(np.zeros(2), name="v", shard=ckpt.Shard((4,), (0,)))
    with pytest.raises(ValueError, match="pass comm="):
        ckpt.Saver([v]).save(str(tmp_path / "m.h5"))
    with pytest.raises(ValueError, match="outside the global shape"):
        ckpt.Variable(np.zeros(3), shard=ckpt.Shard((4,), (2,)))


def test_damaged_commit_record_is_reported(tmp_path):
    path = _save(str(tmp_path), 1, "rows")[0]
    record = os.path.join(path, "COMMIT")
    with open(record, "r+b") as f:
        raw = bytearray(f.read())
        raw[len(raw) // 2] ^= 0xFF
        f.seek(0)
        f.write(bytes(raw))
    with pytest.raises(ckpt.CorruptCheckpointError, match="COMMIT"):
        ckpt.load_checkpoint(path)


def test_a_commit_record_too_large_for_memory_is_reported(tmp_path):
    """A damaged COMMIT of 64 GiB (sparse) is a CorruptCheckpointError naming it, not a MemoryError."""
    path = _save(str(tmp_path), 1, "rows")[0]
    os.truncate(os.path.join(path, "COMMIT"), 1 << 36)
    with pytest.raises(ckpt.CorruptCheckpointError, match="COMMIT: the commit record is too large"):
        ckpt.load_checkpoint(path)


def _commit_v1(raw: bytes) -> bytes:
    """A version 2 commit record rewritten as version 1 wrote it: three objects as a stream."""
    header, record, _ = msgpack.unpackb(raw, raw=False)
    body = msgpack.packb({**record, "version": 1}, use_bin_type=True)
    head = msgpack.packb({**header, "version": 1})
    return head + body + struct.pack(">B2s8sBQBQBI", 0x94, b"\xc4\x08", b"ckpt-cmt", 0xCF, len(head), 0xCF,
                                     len(body), 0xCE, crc32c.crc32c(body))


def test_commit_record_is_one_msgpack_object_and_version_1_still_reads(tmp_path):
    path = _save(str(tmp_path), 2, "rows")[0]
    commit = pathlib.Path(path, "COMMIT")
    raw = commit.read_bytes()
    header, record, footer = msgpack.unpackb(raw, raw=False)  # one object: no ExtraData
    assert header == {"format": "ckpt-commit", "version": 2} and record["version"] == 2
    assert footer[0] == b"ckpt-cmt" and raw[footer[1]:footer[1] + footer[2]] == msgpack.packb(record)
    assert footer[1] == 30 and footer[1] + footer[2] + 34 == len(raw)
    with ckpt.load_checkpoint(path) as reader:
        expected = {key: reader.get_tensor(key) for key in reader.tensors}
    old = _commit_v1(raw)
    with pytest.raises(msgpack.ExtraData):
        msgpack.unpackb(old, raw=False)
    commit.write_bytes(old)
    with ckpt.load_checkpoint(path) as reader:
        assert reader.verify() == []
        for key, value in expected.items():
            assert_bit_exact(value, reader.get_tensor(key))
    for bad, match in ((raw[1:], "lacks the array"), (b"\x93" + old, "has the array"),
                       (raw.replace(b"version\x02", b"version\x03", 1), "newer")):
        commit.write_bytes(bad)
        with pytest.raises(ckpt.CheckpointError, match=match):
            ckpt.load_checkpoint(path)


def test_tiling_and_byte_runs():
    assert boxes.tiling_problem((4, 4), [((0, 0), (2, 4), "a"), ((2, 0), (2, 2), "b"), ((2, 2), (2, 2), "c")]) is None
    assert "gap" in boxes.tiling_problem((4, 4), [((0, 0), (2, 4), "a"), ((2, 0), (2, 2), "b")])
    assert "a and b overlap" in boxes.tiling_problem((4,), [((0,), (3,), "a"), ((2,), (2,), "b")])
    assert "outside" in boxes.tiling_problem((4,), [((3,), (2,), "a")])
    assert boxes.tiling_problem((4, 0), []) is None
    assert boxes.tiling_problem((), [((), (), "a")]) is None
    starts, run = boxes.byte_runs((4, 6), 2, (0, 0), (2, 6))
    assert starts.tolist() == [0] and run == 24
    starts, run = boxes.byte_runs((3, 4, 5), 1, (1, 1, 0), (2, 2, 5))
    assert starts.tolist() == [25, 45] and run == 10
    assert boxes.touched_ranges(np.array([0, 3000]), 100, 1024, 3500) == [(0, 1024), (2048, 3500)]


def _cli(*args: object):
    from click.testing import CliRunner

    from ckpt.cli import main

    return CliRunner().invoke(main, [str(a) for a in args], prog_name="ckpt", catch_exceptions=False)


def test_cli_commands_on_sharded_checkpoints(tmp_path):
    tensors = global_tensors()
    path = _save(str(tmp_path), 3, "uneven", step=9)[0]
    result = _cli("inspect", path)
    assert result.exit_code == 0 and "tensor: emb (float32) [37, 5]" in result.output
    assert _cli("verify", path).exit_code == 0
    listing = _cli("ls", str(tmp_path))
    assert listing.exit_code == 0 and "model-9.msgpack" in listing.output and "latest" in listing.output
    single = tmp_path / "single.h5"
    assert _cli("convert", path, single).exit_code == 0  # sharded -> one file
    assert _cli("diff", path, single).exit_code == 0
    back = tmp_path / "back.h5"
    result = _cli("convert", single, back, "--shards", 4)  # one file -> sharded
    assert result.exit_code == 0, result.output
    with sharded.ShardedReader(str(back)) as reader:
        assert len(reader.files) == 4 and len(reader.tensors["emb"].extra) == 4
        for key, value in tensors.items():
            assert_bit_exact(value, reader.read(key))
    assert _cli("diff", back, path).exit_code == 0
    nested = tmp_path / "new" / "dir" / "nested.h5"  # missing directories are created, as for one file
    assert _cli("convert", single, nested, "--shards", 2).exit_code == 0 and _cli("diff", nested, path).exit_code == 0
    assert _cli("convert", single, back, "--shards", 2).exit_code == 2  # an existing DST needs --force
    refused = _cli("convert", single, back, "--shards", 2, "--force")  # and --shards never replaces one
    assert refused.exit_code == 1 and "never replaces" in refused.output
    assert [n for n in os.listdir(tmp_path) if n.startswith(".") and "tmp" in n] == []
    # damage one shard file: verify reports it, naming the file
    shard_file = os.path.join(path, sorted(n for n in os.listdir(path) if sharded.is_shard_file(n))[0])
    with open(shard_file, "r+b") as f:
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0x55]))
    result = _cli("verify", path)
    assert result.exit_code == 1 and os.path.basename(shard_file) in result.output


def test_strict_false_and_init_from_checkpoint_with_sharded_variables(tmp_path):
    path = _save(str(tmp_path), 2, "rows")[0]
    emb = global_tensors()["emb"]

    def fn(comm: distributed.Communicator) -> tuple:
        rows = np.array_split(np.arange(37), comm.size)[comm.rank]
        part = ckpt.Variable(np.zeros((len(rows), 5), np.float32), name=f"enc{comm.rank}/emb",
                             shard=ckpt.Shard((37, 5), (int(rows[0]), 0)))
        extra = ckpt.Variable(np.zeros(3, np.float32), name=f"new{comm.rank}")
        result = ckpt.Saver({"emb": part, "not/saved": extra}, comm=comm, timeout=20).restore(path, strict=False)
        assert result.missing == ["not/saved"] and "emb" in result.restored
        got = part.numpy().copy()
        part.assign(np.zeros_like(got))
        ckpt.init_from_checkpoint(path, {"emb": part})  # one process's view: reads only its block
        return rows, got, part.numpy()

    for rows, got, again in run_ranks(3, fn):
        assert_bit_exact(emb[rows[0]:rows[-1] + 1], got)
        assert_bit_exact(emb[rows[0]:rows[-1] + 1], again)
    v = ckpt.Variable(np.zeros((2, 5), np.float32), shard=ckpt.Shard((37, 5), (0, 0)))
    with pytest.raises(ValueError, match="transpose applies to whole tensors"):
        ckpt.init_from_checkpoint(path, {"emb": v}, transpose=["emb"])
    wrong = ckpt.Variable(np.zeros((2, 5), np.float32), shard=ckpt.Shard((36, 5), (0, 0)))
    with pytest.raises(ckpt.MismatchError, match=r"emb: shape \(36, 5\) in the model, \(37, 5\)"):
        ckpt.init_from_checkpoint(path, {"emb": wrong})


def test_asynchronous_sharded_save(tmp_path):
    def fn(comm: distributed.Communicator) -> tuple:
        rows = np.array_split(np.arange(40), comm.size)[comm.rank]
        v = ckpt.Variable(np.arange(40.0)[rows[0]:rows[-1] + 1], name="v", shard=ckpt.Shard((40,), (int(rows[0]),)))
        saver = ckpt.Saver([v], comm=comm, timeout=20)
        future = saver.save(str(tmp_path / "m.msgpack"), global_step=1, blocking=False)
        v.assign(np.zeros_like(v.numpy()))  # training goes on; the checkpoint keeps the values of the call
        first = future.result(timeout=30)
        second = saver.save(str(tmp_path / "m.msgpack"), global_step=2)  # a blocking save after it
        return first, second

    results = run_ranks(3, fn)
    assert all(not isinstance(r, BaseException) for r in results), results
    with ckpt.load_checkpoint(results[0][0]) as r:
        assert_bit_exact(np.arange(40.0), r.get_tensor("v"))
    with ckpt.load_checkpoint(str(tmp_path)) as r:
        assert_bit_exact(np.zeros(40), r.get_tensor("v"))


def test_a_first_async_save_that_fails_or_is_missing_on_one_rank_fails_on_every_rank(tmp_path):
    """Before the first asynchronous save duplicates the communicator (MPI's Dup cannot time out),
    the ranks agree that each got that far: one rank's error, or one rank's absence, ends the save
    on every rank. (Under mpiexec: test_mpi.py.)"""
    def fn(comm: distributed.Communicator) -> object:
        v = ckpt.Variable(np.zeros(2), name="v")
        saver = ckpt.Saver([v], comm=comm, timeout=1)
        if comm.rank == 2:
            return None  # never saves
        try:
            saver.save(str(tmp_path / "m.msgpack"), blocking=False, metadata={"bad": {1, 2}} if comm.rank else None)
        except Exception as exc:
            return exc
        return "saved"

    errors = run_ranks(3, fn)
    assert isinstance(errors[1], ValueError) and "metadata key 'bad'" in str(errors[1])
    assert isinstance(errors[0], ckpt.CheckpointWriteError)
    assert "did not start on rank 0" in str(errors[0]) and "within 1 s" in str(errors[0])

    def fails_on_one(comm: distributed.Communicator) -> object:
        saver = ckpt.Saver([ckpt.Variable(np.zeros(2), name="v")], comm=comm, timeout=20)
        try:
            return saver.save(str(tmp_path / "n.msgpack"), blocking=False,
                              metadata={"bad": {1}} if comm.rank == 1 else None).result()
        except Exception as exc:
            return exc

    errors = run_ranks(3, fails_on_one)
    assert isinstance(errors[1], ValueError)
    for error in (errors[0], errors[2]):
        assert isinstance(error, ckpt.CheckpointWriteError)
        assert "failed on rank 1: InvalidMetadataError" in str(error) and "nothing was written" in str(error)
    assert sorted(os.listdir(tmp_path)) == []


def test_a_later_async_save_failing_on_one_rank_fails_on_every_rank_at_once(tmp_path):
    """After the first asynchronous save (the communicator is duplicated), a save that fails on one
    rank before it starts still takes part in the plan's exchange: the others' futures raise its
    error at once (not "did not complete within 60 s"), and the ranks stay in step for the next save.
    (Under mpiexec: test_mpi.py.)"""
    def fn(comm: distributed.Communicator) -> list:
        v = ckpt.Variable(np.arange(4.0) + comm.rank, name="v", shard=ckpt.Shard((12,), (4 * comm.rank,)))
        saver = ckpt.Saver([v], comm=comm, timeout=60)
        out: list = [saver.save(str(tmp_path / "m.msgpack"), global_step=1, blocking=False).result()]
        try:
            future = saver.save(str(tmp_path / "m.msgpack"), global_step=2, blocking=False,
                                metadata={"bad": {1}} if comm.rank == 1 else None)
            out.append(future.result())
        except Exception as exc:
            out.append(exc)
        out.append(saver.save(str(tmp_path / "m.msgpack"), global_step=3, blocking=False).result())
        return out

    results = run_ranks(3, fn)
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert isinstance(results[1][1], ValueError) and "metadata key 'bad'" in str(results[1][1])
    for rank in (0, 2):
        error = results[rank][1]
        assert isinstance(error, ckpt.CheckpointWriteError), error
        assert "the sharded save failed on rank 1: InvalidMetadataError" in str(error), error
        assert "nothing was written" in str(error)
    assert {r[2] for r in results} == {str(tmp_path / "m-3.msgpack")}
    assert ckpt.latest_checkpoint(str(tmp_path)) == str(tmp_path / "m-3.msgpack")
    assert not (tmp_path / "m-2.msgpack").exists()
    with ckpt.load_checkpoint(str(tmp_path / "m-3.msgpack")) as reader:
        assert_bit_exact(np.concatenate([np.arange(4.0) + r for r in range(3)]), reader.get_tensor("v"))


def test_an_unseen_error_raised_by_the_next_async_save_on_some_ranks_fails_it_on_every_rank(tmp_path):
    """Ranks 0 and 2 never look at their failed futures, so their next save raises that error
    (the single-process contract); rank 1 saw its own error and saves: its future fails at once,
    naming ranks 0 and 2, and the save after that works everywhere."""
    def fn(comm: distributed.Communicator) -> list:
        v = ckpt.Variable(np.arange(4.0) + comm.rank, name="v", shard=ckpt.Shard((12,), (4 * comm.rank,)))
        saver = ckpt.Saver([v], comm=comm, timeout=60)
        saver.save(str(tmp_path / "m.msgpack"), global_step=1, blocking=False).result()
        out: list = []
        try:
            saver.save(str(tmp_path / "m.msgpack"), global_step=2, blocking=False,
                       metadata={"bad": {1}} if comm.rank == 1 else None)  # futures not looked at
        except ValueError:
            pass
        try:
            out.append(saver.save(str(tmp_path / "m.msgpack"), global_step=3, blocking=False).result())
        except Exception as exc:
            out.append(exc)
        out.append(saver.save(str(tmp_path / "m.msgpack"), global_step=4, blocking=False).result())
        return out

    results = run_ranks(3, fn)
    assert not [r for r in results if isinstance(r, BaseException)], results
    for rank in (0, 2):  # the save-2 error, raised by their save 3
        assert isinstance(results[rank][0], ckpt.CheckpointWriteError), results[rank][0]
        assert "the sharded save failed on rank 1: InvalidMetadataError" in str(results[rank][0])
    error = results[1][0]
    assert isinstance(error, ckpt.CheckpointWriteError), error
    assert "failed on rank 0: CheckpointWriteError" in str(error) and "rank 2: CheckpointWriteError" in str(error)
    assert {r[1] for r in results} == {str(tmp_path / "m-4.msgpack")}
    assert ckpt.latest_checkpoint(str(tmp_path)) == str(tmp_path / "m-4.msgpack")


def test_the_first_async_save_passes_its_timeout_to_a_dup_that_takes_one():
    """distributed.mpi()'s dup(timeout=) is MPI's Idup polled against it (test_mpi.py); an adapter
    whose dup takes no timeout (docs/distributed.md's torch example) is called plainly."""
    from ckpt.distributed.comm import duplicate

    calls = []

    class Timed(distributed.LocalCommunicator):
        def dup(self, timeout=None):
            calls.append(timeout)
            return distributed.LocalCommunicator()

    class Plain(distributed.LocalCommunicator):
        def dup(self):
            calls.append("plain")
            return distributed.LocalCommunicator()

    assert isinstance(duplicate(Timed(), 7.5), distributed.LocalCommunicator)
    assert isinstance(duplicate(Plain(), 7.5), distributed.LocalCommunicator)
    assert calls == [7.5, "plain"]


def test_no_mpi_needed_and_a_clear_error_without_it(tmp_path, monkeypatch):
    import subprocess
    import sys

    code = ("import sys, numpy as np, ckpt; from ckpt import distributed\n"
            "v = ckpt.Variable(np.ones(3), name='v', shard=ckpt.Shard((3,), (0,)))\n"
            f"p = ckpt.Saver([v], comm=distributed.local()).save({str(tmp_path / 'm.h5')!r})\n"
            "ckpt.Saver([v], comm=distributed.local()).restore(p)\n"
            "print('mpi4py' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=OUTSIDE_CHECKOUT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"  # sharded checkpoints without MPI import no MPI
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # as if the mpi extra were not installed
    with pytest.raises(ImportError, match=r"pip install 'ckpt-numpy\[mpi\]'"):
        distributed.mpi()


def test_a_commit_record_opened_by_its_own_path_opens_its_checkpoint(tmp_path):
    # the sharded format recognises a COMMIT by its content (how an object-store URL finds it)
    path = _save(str(tmp_path), 2, "rows")[0]
    with ckpt.load_checkpoint(os.path.join(path, sharded.COMMIT)) as reader:
        assert reader.format == "ckpt-sharded" and reader.path == path
        assert_bit_exact(global_tensors()["emb"], reader.get_tensor("emb"))


def _replicas(rank: int, agree: bool = False) -> dict:
    """A sharded "w" and replicated variables: "same" (NaNs) agrees everywhere; unless ``agree``,
    "bias" differs on rank 1 and "names" (strings) on rank 2."""
    odd = not agree
    return {"w": ckpt.Variable(np.arange(2.0) + 2 * rank, name="w", shard=ckpt.Shard((6,), (2 * rank,))),
            "same": ckpt.Variable(np.full(3, np.nan, np.float32), name="same"),
            "bias": ckpt.Variable(np.arange(4.0) + (odd and rank == 1), name="bias"),
            "names": ckpt.Variable(np.array([b"a", b"c" if odd and rank == 2 else b"b"], dtype=object),
                                   name="names", dtype=object)}


@pytest.mark.parametrize("blocking,staging", [(True, None), (False, None), (False, 0)],
                         ids=["blocking", "async", "async-unstaged"])
def test_replicated_variables_that_differ_between_ranks_are_refused_on_every_rank(tmp_path, blocking, staging):
    """Without a Shard a variable is written by one rank for all: if the ranks hold different values
    the save is refused on every rank before anything is written, naming the keys and the ranks;
    the next save (values agreeing) works on every rank. Asynchronous saves compare them in the
    background, unstaged (live) values included."""
    def fn(comm: distributed.Communicator) -> list:
        variables = _replicas(comm.rank)
        saver = ckpt.Saver(variables, comm=comm, timeout=20, staging_bytes=staging)
        out: list = []
        for step in (1, 2):
            try:
                future = saver.save(str(tmp_path / "m.msgpack"), global_step=step, blocking=blocking)
                out.append(future if blocking else future.result(timeout=30))
            except Exception as exc:
                out.append(exc)
            if step == 1:
                assert sorted(os.listdir(tmp_path)) == []  # every rank raised before anything was written
                for key, var in _replicas(comm.rank, agree=True).items():
                    variables[key].assign(var.numpy())
        return out

    results = run_ranks(3, fn)
    assert not [r for r in results if isinstance(r, BaseException)], results
    for first, second in results:
        assert isinstance(first, ckpt.MismatchError), first
        message = str(first)
        assert "the ranks disagree; nothing was written" in message
        assert re.search(r"bias: replicated \(no Shard\), but the ranks hold different values: crc32c "
                         r"[0-9a-f]{8} on ranks 0, 2; [0-9a-f]{8} on rank 1", message), message
        assert re.search(r"names: .* on ranks 0, 1; [0-9a-f]{8} on rank 2", message), message
        assert "same:" not in message and "w:" not in message
        assert second == str(tmp_path / "m-2.msgpack")
    with ckpt.load_checkpoint(str(tmp_path)) as reader:
        assert_bit_exact(np.arange(4.0), reader.get_tensor("bias"))
        assert reader.get_tensor("names").tolist() == [b"a", b"b"]


class _Held:
    """A rank's communicator that arrives at its ``hold``-th collective (0: the save's plan
    allgather, 1: the verdict broadcast, 2: the reports allgather, 3: the outcome broadcast) only
    once the ranks in ``wait_for`` have set their ``failed`` events, and gives up on the collectives
    in ``short`` after a fraction of a second: a slow rank, simulated in order, without sleeps."""

    def __init__(self, comm: distributed.ThreadCommunicator, failed: dict, hold: int | None = None,
                 wait_for: tuple = (), short: tuple = ()) -> None:
        self.inner, self.rank, self.size = comm, comm.rank, comm.size
        self.failed, self.hold, self.wait_for, self.short, self.calls = failed, hold, wait_for, short, 0

    def _next(self, timeout: float) -> float:
        call, self.calls = self.calls, self.calls + 1
        if call == self.hold:
            for rank in self.wait_for:
                assert self.failed[rank].wait(30)
        return 0.3 if call in self.short else timeout

    def barrier(self, timeout: float) -> None:
        self.inner.barrier(self._next(timeout))

    def allgather(self, data: bytes, timeout: float) -> list:
        return self.inner.allgather(data, self._next(timeout))

    def broadcast(self, data: bytes | None, root: int, timeout: float) -> bytes:
        return self.inner.broadcast(data, root, self._next(timeout))

    def dup(self, timeout: float | None = None) -> _Held:  # an async save's collectives: on the duplicate
        held = _Held(self.inner.dup(), self.failed, self.hold, self.wait_for, self.short)
        self.hold = None
        return held


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
@pytest.mark.parametrize("slow", ["commit", "writer"])
def test_a_rank_that_cannot_know_whether_the_save_committed_says_so(tmp_path, blocking, slow):
    """"commit": rank 0's commit outlasts the others' timeout; "writer": rank 2 reports its file after
    rank 1 gave up waiting for the reports, yet in time for rank 0, which commits. Rank 0 knows
    the checkpoint is committed and returns its path; a rank that timed out after handing in its
    report cannot know: it raises OutcomeUnknownError saying so (never "the previous checkpoint is
    still the latest"), and the next collective restore settles it: every rank finds the same
    latest checkpoint."""
    failed = {r: threading.Event() for r in range(3)}
    setups = {"commit": {0: dict(hold=3, wait_for=(1, 2), short=(3,)), 1: dict(short=(3,)), 2: dict(short=(3,))},
              "writer": {0: dict(short=(3,)), 1: dict(short=(2,)), 2: dict(hold=2, wait_for=(1,), short=(3,))}}

    def fn(comm: distributed.ThreadCommunicator) -> object:
        v = ckpt.Variable(np.arange(2.0) + 2 * comm.rank, name="v", shard=ckpt.Shard((6,), (2 * comm.rank,)))
        saver = ckpt.Saver([v], comm=_Held(comm, failed, **setups[slow][comm.rank]), timeout=20)
        try:
            if blocking:
                return saver.save(str(tmp_path / "m.msgpack"), global_step=1)
            return saver.save(str(tmp_path / "m.msgpack"), global_step=1, blocking=False).result(timeout=60)
        except Exception as exc:
            failed[comm.rank].set()
            return exc

    results = run_ranks(3, fn)
    path = str(tmp_path / "m-1.msgpack")
    assert results[0] == path, results[0]
    assert ckpt.latest_checkpoint(str(tmp_path)) == path
    for exc in results[1:]:
        assert isinstance(exc, distributed.OutcomeUnknownError), exc
        assert isinstance(exc, ckpt.CheckpointWriteError) and isinstance(exc, TimeoutError)
        message = str(exc)
        assert "may or may not be committed" in message and f"latest_checkpoint({str(tmp_path)!r})" in message
        assert "still the latest" not in message

    def restore(comm: distributed.Communicator) -> tuple:
        v = ckpt.Variable(np.zeros(3), name="v", shard=ckpt.Shard((6,), (3 * comm.rank,)))
        return ckpt.Saver([v], comm=comm, timeout=20).restore(str(tmp_path)).path, v.numpy().tolist()

    assert run_ranks(2, restore) == [(path, [0.0, 1.0, 2.0]), (path, [3.0, 4.0, 5.0])]


def test_a_collective_restore_racing_a_resave_of_its_step_never_mixes_versions(tmp_path):
    """Rank 0 reads the checkpoint, then the same step is saved again (a new commit record, the old
    files deleted), then rank 1 reads: the ranks must not restore different versions without a
    word. Every rank restores the commit record rank 0 read: rank 1 finds that version's files gone
    and every rank raises, saying the checkpoint was saved again (not that it is damaged); the next
    restore gives every rank the new version."""
    def save(comm: distributed.Communicator, base: float) -> str:
        n = 6 // comm.size
        v = ckpt.Variable(np.arange(n) + n * comm.rank + base, name="v", shard=ckpt.Shard((6,), (n * comm.rank,)))
        return ckpt.Saver([v], comm=comm, timeout=20).save(str(tmp_path / "m.msgpack"), global_step=1)

    path = run_ranks(2, lambda comm: save(comm, 0.0))[0]
    rank0_read = threading.Event()

    class Racing:
        def __init__(self, comm: distributed.ThreadCommunicator) -> None:
            self.inner, self.rank, self.size = comm, comm.rank, comm.size

        def broadcast(self, data: bytes | None, root: int, timeout: float) -> bytes:
            message = self.inner.broadcast(data, root, timeout)  # the checkpoint to restore, from rank 0
            if self.rank == 1:
                assert rank0_read.wait(30)
                assert save(distributed.local(), 100.0) == path  # saved again under the same name
            return message

        def allgather(self, data: bytes, timeout: float) -> list:
            if self.rank == 0:
                rank0_read.set()  # rank 0 has restored its variables: it exchanges outcomes
            return self.inner.allgather(data, timeout)

    def restore(comm: distributed.Communicator, wrap: bool) -> object:
        v = ckpt.Variable(np.zeros(3), name="v", shard=ckpt.Shard((6,), (3 * comm.rank,)))
        try:
            result = ckpt.Saver([v], comm=Racing(comm) if wrap else comm, timeout=20).restore(str(tmp_path))
        except Exception as exc:
            return exc
        return result.path, v.numpy().tolist()

    results = run_ranks(2, lambda comm: restore(comm, True))
    for exc in results:
        assert isinstance(exc, ckpt.CheckpointNotFoundError), results
        assert "saved again" in str(exc) and "restore again" in str(exc)
    assert "failed on rank(s) 1" in str(results[0])
    assert run_ranks(2, lambda comm: restore(comm, False)) == [(path, [100.0, 101.0, 102.0]),
                                                               (path, [103.0, 104.0, 105.0])]


def test_list_checkpoints_shows_a_committed_sharded_checkpoint_the_state_file_does_not_list(tmp_path):
    saver = ckpt.Saver({"w": ckpt.Variable(np.arange(6.0))}, comm=distributed.local())
    first = saver.save(str(tmp_path / "m.h5"), global_step=1)
    saver.save(str(tmp_path / "m.h5"), global_step=2)
    (tmp_path / "checkpoint").write_text(json.dumps({"format": "ckpt-state", "version": 1, "checkpoints": [
        {"path": "m-2.h5", "time": 2.0, "step": 2}]}))
    (tmp_path / "m-3.h5").mkdir()  # a sharded save that never committed: not a checkpoint
    rows = {r.path: r for r in ckpt.list_checkpoints(tmp_path)}
    assert sorted(rows) == ["m-1.h5", "m-2.h5"] and rows["m-2.h5"].latest
    assert rows["m-1.h5"].note == "not in the 'checkpoint' state file"
    assert rows["m-1.h5"].size == sum(p.stat().st_size for p in pathlib.Path(first).iterdir())


def test_both_sharded_writers_build_the_one_commit_record_the_reader_parses(tmp_path):
    """A Saver(comm=) save and a sharded conversion build a CommitRecord (named fields, no
    positional indices); its bytes are what they commit, and the reader parses them back."""
    from ckpt.formats.ckpt_sharded import COMMIT, HEADER, CommitRecord

    w = np.arange(12.0).reshape(4, 3)
    saved = ckpt.Saver([ckpt.Variable(w, name="w")], comm=distributed.local()).save(str(tmp_path / "a.msgpack"))
    src = str(tmp_path / "src.h5")
    ckpt.save_file({"w": w, "s": np.array("text")}, src)
    converted = ckpt.convert(src, tmp_path / "b.msgpack", shards=2).path
    for path, blocks in [(saved, 1), (converted, 2)]:
        raw = (pathlib.Path(path) / COMMIT).read_bytes()
        record = CommitRecord.from_bytes(raw, path)
        assert record.to_bytes() == raw
        entry = record.tensors["w"]
        assert entry.dtype == "float64" and list(entry.shape) == [4, 3] and entry.files == list(range(blocks))
        assert sum(entry.nbytes) == w.nbytes and len(entry.crcs) == blocks
        assert [name for name, _ in record.files] == sorted(name for name, _ in record.files)
    assert CommitRecord.from_bytes((pathlib.Path(converted) / COMMIT).read_bytes(), converted).tensors["s"].crcs is None
    with pytest.raises(ckpt.CorruptCheckpointError, match="COMMIT: the commit record fails its checksum"):
        at = len(HEADER) + 5  # a byte of the record's body
        CommitRecord.from_bytes(raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1:], f"{converted}/COMMIT")
