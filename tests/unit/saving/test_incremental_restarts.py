"""Delta chains restart whole in turn (issue 28, target 2): a table whose chunks all change in
every save restarts 1/max_chain of them per save from the second save on (not all within a
few saves once the first chains are long), no chain is ever longer than max_chain, and every
step restores bit-exact across restarts, full_every saves, compression and object stores."""

from __future__ import annotations

import itertools
import os
import uuid
from typing import Any

import numpy as np
import pytest

import ckpt
from ckpt.formats._chunkcodec import chain_of, restarts

CHUNK = 4096
ROWS, DIM = 1024, 64  # float32: 256 KiB, 64 chunks of 16 rows
CHUNKS, CHUNK_ROWS = ROWS * DIM * 4 // CHUNK, CHUNK // (DIM * 4)


def _update(table: ckpt.Variable, rng: np.random.Generator, share: float) -> None:
    """Change one random row in a ``share`` of the chunks (all of them at 1.0): a sparse update."""
    chunks = np.flatnonzero(rng.random(CHUNKS) < share)
    value = table.numpy().copy()
    value[chunks * CHUNK_ROWS + rng.integers(0, CHUNK_ROWS, len(chunks))] += np.float32(0.01)
    table.assign(value)


def _refs(path: str) -> list[Any]:
    """The table's chunk references in the checkpoint ``path`` (a digest, or a delta chain)."""
    with ckpt.load_checkpoint(path) as reader:
        return list(getattr(reader.tensors["table"].extra, "chunks", []))  # none in a self-contained one


def _saves(directory: str, saves: int, share: float, **kw: Any) -> tuple[list[list[Any]], dict[str, bytes]]:
    """Save the table ``saves`` times after a first save, updating it before each; the references
    of every save, and what each checkpoint still kept restores to."""
    rng = np.random.default_rng(7)
    table = ckpt.Variable(rng.standard_normal((ROWS, DIM)).astype(np.float32), name="table")
    saver = ckpt.Saver({"table": table}, format="msgpack", incremental=True, chunk_bytes=CHUNK, **kw)
    refs, want = [], {}
    for step in range(saves + 1):
        if step:
            _update(table, rng, share)
        path = saver.save(f"{directory}/m.msgpack", global_step=step)
        refs.append(_refs(path))
        want[path] = table.numpy().tobytes()
    return refs, {path: want[path] for path in saver.last_checkpoints}


def _restarted(refs: list[list[Any]]) -> list[int]:
    """Per save after the first: how many chunks changed and were written whole (chains restarted)."""
    return [sum(isinstance(ref, bytes) and ref != old for ref, old in zip(now, before))
            for before, now in itertools.pairwise(refs)]


def _assert_restores(want: dict[str, bytes]) -> None:
    assert want
    for path, value in want.items():
        with ckpt.load_checkpoint(path) as reader:
            assert reader["table"].tobytes() == value, path
        assert ckpt.verify(path).ok


def _directory(store: str, tmp_path: Any) -> str:
    """A local directory, or an object store's (memory://: the same encoding, no fsyncs)."""
    return str(tmp_path) if store == "local" else f"memory://restarts-{os.getpid()}-{uuid.uuid4().hex}"


@pytest.mark.parametrize(("max_chain", "store"), [(4, "local"), (4, "memory"), (8, "memory"), (16, "memory")])
def test_chains_restart_in_turn_from_the_first_cycle(tmp_path: Any, max_chain: int, store: str) -> None:
    saves = 2 * (max_chain + 1)  # the first cycle and the next
    refs, want = _saves(_directory(store, tmp_path), saves, 1.0, max_chain=max_chain, max_to_keep=2)
    per_save = _restarted(refs)
    # 1/max_chain of the chunks per save from the second save on (the first changes a whole chunk:
    # a delta); a bound drawn per chain restarted none for max_chain / 2 saves, then ~2/max_chain
    assert per_save[0] == 0 and max(per_save) == -(-CHUNKS // max_chain), per_save
    assert min(per_save[1:]) == CHUNKS // max_chain, per_save
    assert max(len(chain_of(ref)) - 1 for save in refs for ref in save) == max_chain
    _assert_restores(want)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_chains_stay_within_max_chain_and_restore_bit_exact_across_full_every(tmp_path: Any,
                                                                              compression: str | None) -> None:
    # half the chunks change per save: chains grow unevenly; saves 0, 7 and 14 are self-contained
    refs, want = _saves(str(tmp_path), 20, 0.5, max_chain=4, full_every=7, compression=compression,
                        max_to_keep=None)
    assert max(len(chain_of(ref)) - 1 for save in refs for ref in save) == 4
    assert all(isinstance(ref, bytes) for ref in refs[8])  # the save after a full one starts every chain
    assert max(_restarted(refs[8:14])) <= CHUNKS // 4  # and those chains restart in turn too
    _assert_restores(want)


@pytest.mark.parametrize("max_chain", [1, 2, 5, 16])
def test_a_chunk_changed_every_save_restarts_every_max_chain_saves_at_its_turn(max_chain: int) -> None:
    for place in range(2 * max_chain):
        deltas, whole = 0, []
        for save in range(1, 6 * max_chain + 2):
            if restarts(deltas, save + place, max_chain):
                deltas = 0
                whole.append(save)
            else:
                deltas += 1
            assert deltas <= max_chain
        assert whole[0] <= max_chain + 1  # its first chain is cut at its turn (the first change: a delta)
        # then every max_chain saves (max_chain=1: a delta between, as a restart needs one to cut)
        assert {b - a for a, b in itertools.pairwise(whole)} == {max(max_chain, 2)}
    assert not restarts(max_chain - 1, None, max_chain) and restarts(max_chain, None, max_chain)
