"""Incremental sharded saves (Saver(comm=..., incremental=True)) with simulated ranks (threads):
shard files index the directory's shared chunk store; restores on any number of ranks, partial
reads, verify, convert, retention and chunk collection beside local incremental checkpoints."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import pytest

import ckpt
from ckpt import distributed
from ckpt.formats import ckpt_sharded as sharded
from ckpt.formats.base import get_format
from ckpt.formats.incremental import CHUNK_DIR, MAX_CHAIN
from ckpt.saving.incremental import references_at
from conftest import assert_bit_exact
from distributed_support import global_tensors, layout, make_variables, run_ranks
from incremental_support import file_bytes, flip, stored_at

CHUNK = 256  # small chunks: every tensor of global_tensors() has several


def _tensors(step: int, big: bool = False) -> dict[str, np.ndarray]:
    """global_tensors(), plus a 'head' that changes with ``step`` (and with ``big`` a frozen 2.4 MB 'big')."""
    out = global_tensors()
    out["head"] = np.full((6, 8), step, np.float32)
    if big:
        out["big"] = np.arange(2000 * 300, dtype=np.float32).reshape(2000, 300)
    return out


def _save_steps(directory: str, size: int, steps: list[int], big: bool = False, chunk_bytes: int = CHUNK,
                tensors: Callable[[int], dict[str, np.ndarray]] | None = None, **kw: object) -> list:
    """Each rank's [(path, last_incremental)] per step, saving ``tensors(step)`` (default _tensors)."""
    def fn(comm: distributed.Communicator) -> list:
        saver = None
        out = []
        for step in steps:
            values = _tensors(step, big) if tensors is None else tensors(step)
            variables = make_variables(values, "rows", comm.rank, size)
            if saver is None:
                saver = ckpt.Saver(variables, comm=comm, timeout=20, incremental=True, chunk_bytes=chunk_bytes,
                                   **kw)  # type: ignore[arg-type]
            else:
                for key, var in variables.items():
                    saver.var_list[key].assign(var.numpy())
            out.append((saver.save(os.path.join(directory, "model.msgpack"), global_step=step),
                        saver.last_incremental))
        return out

    results = run_ranks(size, fn)
    assert not any(isinstance(r, BaseException) for r in results), results
    return results


def _chunks(directory: str) -> set[str]:
    return set(os.listdir(os.path.join(directory, CHUNK_DIR)))


def _referenced(directory: str, names: list[str]) -> set[str]:
    fmt = get_format("ckpt-incremental")
    return {c.hex() for n in names for c in references_at(fmt, os.path.join(directory, n)) or set()}  # type: ignore[arg-type]


def test_shards_index_the_shared_store_and_a_save_writes_only_what_changed(tmp_path):
    results = _save_steps(str(tmp_path), 3, [1, 2])
    path = results[0][1][0]
    names = [n for n in os.listdir(path) if sharded.is_shard_file(n)]
    assert len(names) == 3
    assert not os.path.exists(os.path.join(path, CHUNK_DIR))  # one store, beside the checkpoints
    for name in names:
        with open(os.path.join(path, name), "rb") as f:
            assert get_format("ckpt-incremental").sniff(f.read(64)), name
    first = [r[0][1] for r in results]
    second = [r[1][1] for r in results]
    assert sum(s.chunks_written for s in first) > 0
    # the second save: only 'head' (6 x 8 float32, split over 3 ranks) and the replicated 'step' changed
    assert sum(s.bytes_written for s in second) <= 6 * 8 * 4 + 8
    assert sum(s.chunks_reused for s in second) >= sum(s.chunks_written for s in first) - 3


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A directory where 3 ranks saved steps 1 and 2 incrementally."""
    directory = str(tmp_path_factory.mktemp("inc"))
    _save_steps(directory, 3, [1, 2])
    return directory


@pytest.mark.parametrize("m,kind", [(1, "rows"), (2, "cols"), (4, "uneven")])
def test_restore_on_any_number_of_ranks_bit_exact(two_steps, m, kind):
    tensors = _tensors(2)

    def fn(comm: distributed.Communicator) -> dict:
        variables = make_variables(tensors, kind, comm.rank, m, zero=True)
        ckpt.Saver(variables, comm=comm, timeout=20).restore(two_steps)
        return {k: v.numpy() for k, v in variables.items()}

    for rank, got in enumerate(run_ranks(m, fn)):
        assert not isinstance(got, BaseException), got
        for key, value in tensors.items():
            offset, block = layout(kind, value.shape, rank, m)
            assert_bit_exact(np.asarray(value[tuple(slice(o, o + b) for o, b in zip(offset, block))]),
                             np.asarray(got[key]).reshape(block))
        assert int(got["step"]) == 42


def test_plain_reader_slices_verifies_and_converts(tmp_path):
    # one rank: 'big' is one 2.4 MB block; 100,000-byte chunks do not line up with the 1 MiB checksum blocks
    path = _save_steps(str(tmp_path), 1, [1], big=True, chunk_bytes=100_000)[0][0][0]
    tensors = _tensors(1, big=True)
    with ckpt.load_checkpoint(path) as reader:
        assert reader.format == "ckpt-sharded"
        for key, value in tensors.items():
            assert_bit_exact(value, reader.get_tensor(key))
        assert reader.verify() == []
    with sharded.ShardedReader(path) as raw:  # a slice reads the checksum block holding it, not the whole block
        part = raw.read_slice("big", np.s_[10:20, 5:9])
        assert_bit_exact(tensors["big"][10:20, 5:9], part)
        assert raw.bytes_read == sharded.BLOCK_BYTES < tensors["big"].nbytes
    out = str(tmp_path / "single.msgpack")
    ckpt.convert(path, out)
    with open(out, "rb") as f:
        assert not get_format("ckpt-incremental").sniff(f.read(64))  # self-contained
    with ckpt.load_checkpoint(out) as reader:
        for key, value in tensors.items():
            assert_bit_exact(value, reader.get_tensor(key))


def test_a_damaged_shared_chunk_fails_every_checkpoint_that_references_it_naming_the_key(tmp_path):
    results = _save_steps(str(tmp_path), 2, [1, 2], max_to_keep=None)
    paths = [path for path, _ in results[0]]
    with sharded.ShardedReader(paths[0]) as reader:
        chunk = reader._shard(0).chunks_of("emb")[0]  # the first shard file's index: its 'emb' rows' chunks
    pack = flip(paths[0], chunk, count=4)
    for path in paths:  # 'emb' is frozen: both checkpoints reference the chunk
        with ckpt.load_checkpoint(path) as reader:
            with pytest.raises(ckpt.CorruptCheckpointError, match="emb") as info:
                reader.get_tensor("emb")
            assert info.value.key == "emb"
            assert_bit_exact(_tensors(int(path[-9])).get("head"), reader.get_tensor("head"))
            problems = reader.verify()
            assert problems and all("emb" in p for p in problems)
            # the pack as each checkpoint reaches it (<path>/../.ckpt-chunks/<pack id>)
            assert any(chunk.hex() in p and f"{CHUNK_DIR}/{os.path.basename(pack)})" in p for p in problems)


def test_retention_collects_only_chunks_no_kept_checkpoint_references(tmp_path):
    directory = str(tmp_path)
    results = _save_steps(directory, 3, [1, 2, 3, 4], max_to_keep=2)
    kept = ["model-3.msgpack", "model-4.msgpack"]
    assert sorted(n for n in os.listdir(directory) if not n.startswith(".") and n != "checkpoint") == kept
    assert results[0][-1][1].chunks_collected > 0  # the dropped steps' 'head' chunks
    assert _chunks(directory) == _referenced(directory, kept)
    # a local incremental save's collection in the same directory keeps the sharded checkpoints' chunks
    local = {"solo": ckpt.Variable(np.arange(1000, dtype=np.float64) + 0.5, name="solo")}
    ckpt.Saver(local, format="msgpack", incremental=True, chunk_bytes=CHUNK, max_to_keep=None).save(
        os.path.join(directory, "solo.msgpack"))
    assert _chunks(directory) == _referenced(directory, kept + ["solo.msgpack"])
    for name in kept + ["solo.msgpack"]:
        assert ckpt.verify(os.path.join(directory, name)).problems == []


def test_full_every_writes_self_contained_shards_and_the_chain_restores(tmp_path):
    results = _save_steps(str(tmp_path), 2, [1, 2, 3], full_every=2, max_to_keep=None)
    chunked = get_format("ckpt-incremental")
    for (path, _), full in zip(results[0], [True, False, True]):
        for name in (n for n in os.listdir(path) if sharded.is_shard_file(n)):
            with open(os.path.join(path, name), "rb") as f:
                assert chunked.sniff(f.read(64)) is not full, (path, name)
        with ckpt.load_checkpoint(path) as reader:
            assert_bit_exact(_tensors(int(path[-9]))["head"], reader.get_tensor("head"))
            assert reader.verify() == []


def test_blocking_false_commits_in_the_background(tmp_path):
    tensors = _tensors(1)

    def fn(comm: distributed.Communicator) -> object:
        variables = make_variables(tensors, "rows", comm.rank, 2)
        saver = ckpt.Saver(variables, comm=comm, timeout=20, incremental=True, chunk_bytes=CHUNK)
        future = saver.save(os.path.join(str(tmp_path), "model.msgpack"), global_step=5, blocking=False)
        path = future.result()
        return path, saver.last_incremental

    results = run_ranks(2, fn)
    assert not any(isinstance(r, BaseException) for r in results), results
    assert sum(r[1].chunks_written for r in results) > 0
    with ckpt.load_checkpoint(results[0][0]) as reader:
        for key, value in tensors.items():
            assert_bit_exact(value, reader.get_tensor(key))


def _weights(step: int) -> dict[str, np.ndarray]:
    """A 256 KiB float32 table drawn from N(0, 0.02) (seeded) whose column ``step % 64`` moves by
    ``step``: every 4 KiB chunk changes in one float per row, so its XOR with the last save is sparse."""
    table = np.random.default_rng(11).normal(0, 0.02, (256, 256)).astype(np.float32)
    table[:, step % 64] += np.float32(step)
    return {"table": table}


def _stored(path: str, names: set[bytes]) -> int:
    """The stored bytes of the chunks ``names`` of the checkpoint ``path``."""
    return sum(stored_at(path, n)[2] for n in names)


def _shard_refs(path: str) -> list[bytes | list[bytes]]:
    """Every chunk reference (a digest, or a delta chain) of 'table' in the shard files of ``path``."""
    with sharded.ShardedReader(path) as reader:
        return [ref for i in range(len(reader.files)) for ref in reader._shard(i).info("table").extra.chunks]


def test_compression_stores_compressed_chunks_that_restore_and_slice_bit_exact(tmp_path):
    directory = str(tmp_path)
    results = _save_steps(directory, 2, [1], chunk_bytes=4096, tensors=_weights, compression="zstd", max_chain=0)
    path, table = results[0][0][0], _weights(1)["table"]
    refs = _shard_refs(path)
    assert len(refs) == table.nbytes // 4096 and all(isinstance(r, bytes) for r in refs)
    stored = _stored(path, set(refs))
    everything = file_bytes(directory, _chunks(directory))  # the packs the ranks wrote: 'table' and 'step'
    assert _chunks(directory) == _referenced(directory, ["model-1.msgpack"])
    assert sum(r[0][1].bytes_written for r in results) == everything
    assert stored * 1.1 <= table.nbytes  # float32 N(0, 0.02): the exponent plane compresses

    def fn(comm: distributed.Communicator) -> np.ndarray:  # restored on 3 ranks
        variables = make_variables({"table": table}, "rows", comm.rank, 3, zero=True)
        ckpt.Saver(variables, comm=comm, timeout=20).restore(directory)
        return variables["table"].numpy()

    assert_bit_exact(table, np.concatenate(run_ranks(3, fn)))
    with sharded.ShardedReader(path) as reader:  # part of a block, across the two shard files
        assert_bit_exact(table[120:140, 3:7], reader.read_slice("table", np.s_[120:140, 3:7]))
        assert reader.verify() == []


def test_changed_chunks_are_stored_as_deltas_per_rank_and_every_kept_step_restores(tmp_path):
    directory = str(tmp_path)
    results = _save_steps(directory, 2, [1, 2, 3, 4], chunk_bytes=4096, tensors=_weights, max_to_keep=2)
    chunks = _weights(1)["table"].nbytes // 4096
    for step, path in ((3, "model-3.msgpack"), (4, "model-4.msgpack")):
        refs = _shard_refs(os.path.join(directory, path))
        chains = [r for r in refs if isinstance(r, list) and len(r) == step]  # deltas down to step 1's chunks
        # the others restarted whole in turn: 1/MAX_CHAIN of the chunks per save (steps 3 and 4)
        assert len(refs) == chunks and len(chains) >= chunks - 2 * chunks // MAX_CHAIN
        with ckpt.load_checkpoint(os.path.join(directory, path)) as reader:
            assert_bit_exact(_weights(step)["table"], reader.get_tensor("table"))
            assert_bit_exact(_weights(step)["table"][100:200, 60:70],
                             reader.get_slice("table", np.s_[100:200, 60:70]))
            assert reader.verify() == []
    assert sum(r[-1][1].bytes_written for r in results) * 4 < chunks * 4096  # deltas, not whole chunks
    # retention dropped steps 1 and 2, but their chunks are the kept chains' bases
    assert _chunks(directory) == _referenced(directory, ["model-3.msgpack", "model-4.msgpack"])


def test_a_damaged_delta_base_fails_every_checkpoint_whose_chain_rests_on_it(tmp_path):
    results = _save_steps(str(tmp_path), 2, [1, 2, 3], chunk_bytes=4096, tensors=_weights, max_to_keep=None)
    paths = [path for path, _ in results[0]]
    base = _shard_refs(paths[2])[0][-1]  # the whole chunk step 1 wrote, under steps 2 and 3's deltas
    flip(paths[2], base, count=8)
    for path in paths:
        with ckpt.load_checkpoint(path) as reader:
            with pytest.raises(ckpt.CorruptCheckpointError, match="table") as info:
                reader.get_tensor("table")
            assert info.value.key == "table"
            assert int(reader.get_tensor("step")) == 42  # the other tensors are unaffected
            assert any(base.hex() in p for p in reader.verify())


def test_a_full_save_cuts_the_delta_chains(tmp_path):
    results = _save_steps(str(tmp_path), 2, [1, 2, 3, 4, 5], chunk_bytes=4096, tensors=_weights, full_every=3,
                          max_to_keep=None)
    paths = [path for path, _ in results[0]]  # steps 1 and 4 self-contained
    assert all(isinstance(r, list) and len(r) == 2 for r in _shard_refs(paths[2]))  # step 3: on step 2's chunks
    assert all(isinstance(r, bytes) for r in _shard_refs(paths[4]))  # step 5: whole chunks after the full step 4
    with ckpt.load_checkpoint(paths[4]) as reader:
        assert_bit_exact(_weights(5)["table"], reader.get_tensor("table"))


@pytest.mark.parametrize("where,kw,what", [("memory://bucket/run", {}, "object-store URL"),
                                          ("", {"format": "hdf5"}, "hdf5 format")])
def test_what_is_not_supported_is_refused_on_every_rank_before_writing(tmp_path, where, kw, what):
    directory = where or str(tmp_path)
    name = "model.h5" if kw.get("format") == "hdf5" else "model.msgpack"

    def fn(comm: distributed.Communicator) -> object:
        variables = make_variables({"w": np.ones((4, 2), np.float32)}, "rows", comm.rank, 2)
        saver = ckpt.Saver(variables, comm=comm, timeout=20, incremental=True, **kw)  # type: ignore[arg-type]
        return saver.save(f"{directory}/{name}", global_step=1)

    for result in run_ranks(2, fn):
        assert isinstance(result, ckpt.UnsupportedCheckpointError), result
        assert what in str(result)
    if not where:
        assert os.listdir(tmp_path) == []
