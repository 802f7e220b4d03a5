"""Incremental checkpoints in object stores (memory://): chunks read through the checkpoint's own
store, saves that write only missing chunks, and collection that never deletes a chunk a kept or
in-flight checkpoint references."""

from __future__ import annotations

import os
import time

import fsspec
import numpy as np
import pytest

import ckpt
from ckpt.errors import CorruptCheckpointError

CHUNK = 4096
CHUNKS = ".ckpt-chunks"


def _root() -> str:
    return f"memory://inc-{time.time_ns()}"


def _vars(rng: np.random.Generator) -> dict[str, ckpt.Variable]:
    return {"big": ckpt.Variable(rng.standard_normal((64, 100)).astype(np.float32), name="big"),
            "frozen": ckpt.Variable(rng.standard_normal(5000).astype(np.float64), name="frozen"),
            "text": ckpt.Variable(np.array([b"a", b"xyz"], dtype=ckpt.dtypes.string), name="text")}


def _upload_tree(local: str, url: str) -> None:
    """Copy a local checkpoint directory to ``url`` object by object (as `aws s3 sync` would)."""
    fs = fsspec.filesystem("memory")
    for folder, _, files in os.walk(local):
        for name in files:
            if name.startswith(".checkpoint.lock"):
                continue
            relative = os.path.relpath(os.path.join(folder, name), local)
            with open(os.path.join(folder, name), "rb") as f:
                fs.pipe_file(f"{url}/{relative}", f.read())


def test_an_incremental_checkpoint_copied_to_a_store_reads_its_chunks_from_there(tmp_path: object) -> None:
    v = _vars(np.random.default_rng(1))
    local = str(tmp_path)
    path = ckpt.Saver(v, incremental=True, chunk_bytes=CHUNK).save(os.path.join(local, "m.msgpack"), global_step=1)
    root = _root()
    _upload_tree(local, root)
    url = f"{root}/{os.path.basename(path)}"
    with ckpt.load_checkpoint(url) as reader:
        assert reader["big"].tobytes() == v["big"].numpy().tobytes()
        assert reader["frozen"].tobytes() == v["frozen"].numpy().tobytes()
        assert reader.verify() == []
    [chunk] = [n for n in os.listdir(os.path.join(local, CHUNKS))
               if os.path.getsize(os.path.join(local, CHUNKS, n)) == 5000 * 8 % CHUNK]  # frozen's short last chunk
    fsspec.filesystem("memory").rm_file(f"{root}/{CHUNKS}/{chunk}")
    with ckpt.load_checkpoint(url) as reader:
        assert reader["big"].tobytes() == v["big"].numpy().tobytes()  # the other tensors are unaffected
        with pytest.raises(CorruptCheckpointError, match=f"tensor 'frozen': its chunk {root}/{CHUNKS}/{chunk} "
                                                         "is missing"):
            reader["frozen"]
