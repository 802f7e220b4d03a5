"""Incremental saves (Saver(incremental=True)): chunks written once, restored bit-exact, retention
that keeps every referenced chunk, damaged chunks named."""

from __future__ import annotations

import hashlib
import os
from typing import NoReturn

import numpy as np
import pytest

import ckpt
from ckpt import dtypes
from ckpt.errors import CorruptCheckpointError, UnsupportedCheckpointError
from ckpt.formats.base import open_reader
from incremental_support import file_bytes, flip, keys_reading, referenced_files, remove, store_files

CHUNK = 4096
CHUNKS = ".ckpt-chunks"


def _vars(rng: np.random.Generator) -> dict[str, ckpt.Variable]:
    return {
        "big": ckpt.Variable(rng.standard_normal((64, 100)).astype(np.float32), name="big"),  # 6.25 chunks
        "exact": ckpt.Variable(rng.integers(0, 9, CHUNK // 8, dtype=np.int64), name="exact"),  # one chunk
        "bf": ckpt.Variable(rng.standard_normal(3000).astype(dtypes.bfloat16), name="bf"),
        "scalar": ckpt.Variable(np.float64(2.5), name="scalar"),
        "empty": ckpt.Variable(np.zeros((0, 3), np.int32), name="empty"),
        "text": ckpt.Variable(np.array([b"a", b"", b"xyz"], dtype=dtypes.string), name="text"),
    }


def _set_first(var: ckpt.Variable, value: float) -> None:
    """Change only the first element (so only the first chunk)."""
    new = var.numpy().copy()
    new[0, 0] = value
    var.assign(new)


def _load(path: str, key: str) -> np.ndarray:
    with ckpt.load_checkpoint(path) as reader:
        return reader[key]


def _saver(v: dict[str, ckpt.Variable], **kw: object) -> ckpt.Saver:
    kw.setdefault("max_chain", 0)  # whole chunks (these tests count chunk files); deltas: test_incremental_deltas.py
    return ckpt.Saver(v, format="msgpack", incremental=True, chunk_bytes=CHUNK, **kw)  # type: ignore[arg-type]


def test_round_trip_every_kind_of_tensor(tmp_path: object) -> None:
    v = _vars(np.random.default_rng(0))
    want = {k: x.numpy().copy() for k, x in v.items()}
    path = _saver(v).save(os.path.join(str(tmp_path), "m.msgpack"), global_step=1)
    with ckpt.load_checkpoint(path) as got:
        for key, value in want.items():
            assert got[key].dtype == value.dtype and got[key].shape == value.shape
            assert got[key].tobytes() == value.tobytes() if value.dtype.kind != "O" else list(got[key]) == list(value)
        assert np.array_equal(got.get_slice("big", np.s_[3:5, 10:20]), want["big"][3:5, 10:20])
    assert ckpt.verify(path).ok


def test_a_save_writes_only_changed_chunks_and_restores_each_step(tmp_path: object) -> None:
    v = _vars(np.random.default_rng(1))
    saver = _saver(v, max_to_keep=None)
    d = str(tmp_path)
    saved = {}
    for step in range(3):
        v["big"].assign(v["big"].numpy() + np.eye(64, 100, dtype=np.float32)[::-1] * (step == 2))
        _set_first(v["big"], step)  # the first chunk changes every step
        saved[step] = v["big"].numpy().copy()
        saver.save(os.path.join(d, "m.msgpack"), global_step=step)
        stats = saver.last_incremental
        assert stats is not None
        if step == 1:
            assert (stats.chunks_written, stats.bytes_written) == (1, CHUNK)
    for step, value in saved.items():
        assert _load(os.path.join(d, f"m-{step}.msgpack"), "big").tobytes() == value.tobytes()


def test_retention_deletes_only_unreferenced_chunks(tmp_path: object) -> None:
    v = _vars(np.random.default_rng(2))
    saver = _saver(v, max_to_keep=2)
    d = str(tmp_path)
    for step in range(5):
        _set_first(v["big"], step)
        saver.save(os.path.join(d, "m.msgpack"), global_step=step)
    assert sorted(n for n in os.listdir(d) if n.endswith(".msgpack")) == ["m-3.msgpack", "m-4.msgpack"]
    for step in (3, 4):
        assert ckpt.verify(os.path.join(d, f"m-{step}.msgpack")).ok
    kept = referenced_files(d, ["m-3.msgpack", "m-4.msgpack"])
    # the first save's pack (every chunk but big's first, shared by both) and the one pack each of
    # steps 3 and 4 wrote (its first chunk of big): the packs of steps 1 and 2 were deleted
    assert store_files(d) == kept and len(kept) == 3
    assert len(referenced_files(d, ["m-3.msgpack"]) & referenced_files(d, ["m-4.msgpack"])) == 1


def test_a_damaged_shared_chunk_is_named_and_other_tensors_still_restore(tmp_path: object) -> None:
    v = _vars(np.random.default_rng(3))
    saver = _saver(v, max_to_keep=None)
    d = str(tmp_path)
    _set_first(v["big"], 1)
    saver.save(os.path.join(d, "m.msgpack"), global_step=1)
    _set_first(v["big"], 2)
    saver.save(os.path.join(d, "m.msgpack"), global_step=2)
    shared = hashlib.sha256(v["exact"].numpy().tobytes()).digest()
    first = os.path.join(d, "m-1.msgpack")
    pack = flip(first, shared, at=0)
    for step in (1, 2):
        path = os.path.join(d, f"m-{step}.msgpack")
        with pytest.raises(CorruptCheckpointError, match="'exact'") as info:
            _load(path, "exact")
        assert info.value.key == "exact"  # the index file is whole: the message points at the chunk folder
        assert f"a chunk file of it in {os.path.join(d, CHUNKS)} is damaged" in str(info.value)
        assert f"ckpt verify {path}" in str(info.value)
        problems = ckpt.verify(path).problems
        assert len(problems) == 1 and "'exact'" in problems[0]
        assert f"its chunk {shared.hex()} (bytes " in problems[0] and f"of the pack {pack})" in problems[0]
        assert _load(path, "big")[0, 0] == step
    readers = keys_reading(first, pack)
    assert readers == {"big", "exact", "bf", "scalar"}  # the first save wrote every chunk into one pack
    remove(first, shared)  # the pack goes: every tensor reading it is missing a chunk, the others read
    for key in readers:
        with pytest.raises(CorruptCheckpointError, match=f"'{key}'.*of the pack {pack}\\) is missing") as info:
            _load(first, key)
        assert info.value.key == key
    assert _load(first, "text").tolist() == [b"a", b"", b"xyz"] and _load(first, "empty").shape == (0, 3)


def test_full_every_writes_self_contained_checkpoints(tmp_path: object) -> None:
    v = _vars(np.random.default_rng(4))
    saver = _saver(v, max_to_keep=None, full_every=2)
    d = str(tmp_path)
    formats = []
    for step in range(4):
        path = saver.save(os.path.join(d, "m.msgpack"), global_step=step)
        with open_reader(path) as reader:
            formats.append(reader.format_name)
    assert formats == ["msgpack", "ckpt-incremental", "msgpack", "ckpt-incremental"]


def test_convert_writes_a_self_contained_file(tmp_path: object) -> None:
    v = _vars(np.random.default_rng(5))
    d = str(tmp_path)
    path = _saver(v).save(os.path.join(d, "m.msgpack"))
    out = os.path.join(d, "out", "plain.h5")
    os.makedirs(os.path.dirname(out))
    ckpt.convert(path, out)
    assert _load(out, "big").tobytes() == v["big"].numpy().tobytes()


@pytest.mark.parametrize("blocking", [True, False])
def test_hdf5_paths_are_refused(tmp_path: object, blocking: bool) -> None:
    v = _vars(np.random.default_rng(6))
    saver = ckpt.Saver(v, incremental=True)
    with pytest.raises(UnsupportedCheckpointError, match="hdf5"):
        saver.save(os.path.join(str(tmp_path), "m.h5"), blocking=blocking)
    assert os.listdir(str(tmp_path)) == []


def test_bad_arguments_are_refused(tmp_path: object) -> None:
    v = _vars(np.random.default_rng(7))
    with pytest.raises(ValueError, match="chunk_bytes"):
        ckpt.Saver(v, incremental=True, chunk_bytes=0)
    with pytest.raises(ValueError, match="max_chain"):
        ckpt.Saver(v, incremental=True, max_chain=-1)


def test_a_save_creates_its_directory(tmp_path: object) -> None:
    """As every other save does (TensorFlow, orbax and torch do too)."""
    v = _vars(np.random.default_rng(8))
    path = _saver(v).save(os.path.join(str(tmp_path), "run", "sub", "m.msgpack"), global_step=1)
    assert ckpt.latest_checkpoint(os.path.join(str(tmp_path), "run", "sub")) == path
    assert _load(path, "big").tobytes() == v["big"].numpy().tobytes()


def _two_steps(d: str, first: int = 1) -> tuple[list[str], dict[str, set[str]]]:
    """Two incremental checkpoints that differ in big's first chunk; their paths and chunk names.
    ``first=0``: a save of step 0 comes first (dropped by retention, its pack kept for the chunks
    the two share), so each of the two stores its own first chunk in a pack of its own."""
    v = _vars(np.random.default_rng(9))
    saver = _saver(v, max_to_keep=2)
    paths = []
    for step in range(first, 3):
        _set_first(v["big"], step)
        paths.append(saver.save(os.path.join(d, "m.msgpack"), global_step=step))
    paths = paths[-2:]
    chunks = {}
    for path in paths:
        with open_reader(path) as reader:
            chunks[path] = {c.hex() for k in reader.tensors for c in reader.chunks_of(k)}  # type: ignore[attr-defined]
    return paths, chunks


def test_list_checkpoints_gives_the_bytes_each_owns_and_shares(tmp_path: object) -> None:
    d = str(tmp_path)
    paths, _ = _two_steps(d, first=0)
    files = {path: referenced_files(d, [os.path.basename(path)]) for path in paths}
    both = files[paths[0]] & files[paths[1]]
    rows = ckpt.list_checkpoints(d)
    assert [os.path.join(d, row.path) for row in rows] == paths
    for row, path in zip(rows, paths):
        own = files[path] - both
        assert len(own) == 1  # the pack holding its first chunk of big
        assert row.owned == os.path.getsize(path) + file_bytes(d, own)
        assert row.shared == file_bytes(d, both) > 0
    # without the earlier save, step 1's own chunk is in the pack it wrote with every shared chunk:
    # a pack two checkpoints reference is shared by both (deleting step 1 frees none of it)
    d2 = os.path.join(d, "two")
    paths, chunks = _two_steps(d2)
    assert len(chunks[paths[0]] - chunks[paths[1]]) == 1
    first, second = ckpt.list_checkpoints(d2)
    assert first.owned == os.path.getsize(paths[0]) and first.shared == second.shared > 0
    assert second.owned == os.path.getsize(paths[1]) + file_bytes(d2, referenced_files(d2, ["m-2.msgpack"]) -
                                                                  referenced_files(d2, ["m-1.msgpack"]))
    plain = os.path.join(d, "plain")
    ckpt.Saver({"w": ckpt.Variable([1.0])}).save(os.path.join(plain, "m.h5"), global_step=1)
    [row] = ckpt.list_checkpoints(plain)
    assert (row.owned, row.shared) == (row.size, 0)


def test_ckpt_ls_shows_owned_and_shared_bytes(tmp_path: object) -> None:
    import json

    from click.testing import CliRunner

    from ckpt.cli.main import main

    d = str(tmp_path)
    _two_steps(d)
    rows = ckpt.list_checkpoints(d)
    table = CliRunner().invoke(main, ["ls", d])
    assert table.exit_code == 0
    header = table.output.splitlines()[0].split()
    assert header[-2:] == ["owns", "shares"]
    doc = json.loads(CliRunner().invoke(main, ["ls", d, "--json"]).output)
    assert [(r["owned"], r["shared"]) for r in doc["checkpoints"]] == [(r.owned, r.shared) for r in rows]


def test_verify_directory_checks_every_reference_of_every_kept_checkpoint(tmp_path: object) -> None:
    from click.testing import CliRunner

    from ckpt.cli.main import main

    d = str(tmp_path)
    paths, chunks = _two_steps(d, first=0)
    assert [r.ok for r in ckpt.verify_directory(d)] == [True, True]
    assert CliRunner().invoke(main, ["verify", d]).output == f"{d}: OK (2 kept checkpoints; the structure and " \
                                                             "every checksum match)\n"
    [only_first] = chunks[paths[0]] - chunks[paths[1]]
    # the latest checkpoint is whole: only a directory check sees it
    own = remove(paths[0], bytes.fromhex(only_first))  # the pack only step 1 reads: its first chunk of big
    with open_reader(paths[1]) as reader:
        [shared] = [c.hex() for c in reader.chunks_of("exact")]  # type: ignore[attr-defined]  # another tensor
    flip(paths[1], bytes.fromhex(shared), at=0)
    reports = ckpt.verify_directory(d)
    assert [len(r.problems) for r in reports] == [2, 1]
    assert any(only_first in p and own in p and "missing" in p for p in reports[0].problems)
    assert all(any(shared in p and "damaged" in p for p in r.problems) for r in reports)
    result = CliRunner().invoke(main, ["verify", d])
    assert result.exit_code == 1 and only_first in result.output
    assert f"{d}: 3 problems found in 2 checkpoints" in result.output


def test_saves_find_the_incremental_format_in_the_registry(tmp_path: object) -> None:
    """The Saver uses the registered ChunkedFormat (docs/architecture.md: saving asks the registry)."""
    from ckpt.formats.base import ChunkedFormat, Format, get_format, register_format

    builtin = get_format("ckpt-incremental")
    assert isinstance(builtin, ChunkedFormat)

    class NotChunked(Format):
        name = "ckpt-incremental"

        def sniff(self, head: bytes) -> bool:
            return False

        def open(self, path: str, blob: object = None, declined: object = None) -> NoReturn:
            raise AssertionError("never opened")

    register_format(NotChunked(), replace=True)
    try:
        with pytest.raises(UnsupportedCheckpointError, match="not a ChunkedFormat"):
            _saver(_vars(np.random.default_rng(10))).save(os.path.join(str(tmp_path), "m.msgpack"))
    finally:
        register_format(builtin, replace=True)
    assert not os.path.exists(os.path.join(str(tmp_path), "m.msgpack"))
