"""Fuzzing every foreign reader on the files the frameworks wrote: truncations, seeded bit flips and
byte runs overwritten, each ending in values or a CheckpointError — never another exception — with
memory bounded by the file (tracemalloc's peak during open + read).

Files up to 1 KiB are truncated at every byte; larger ones at every byte of their first and last KiB
and every 7th byte between. Per-reader counts are in docs/foreign.md (Fuzzing). Readers with their
own fuzz tests elsewhere: the legacy torch format (test_foreign_torch_legacy), TensorFlow's sliced
index (test_foreign_tf_slices), orbax chunks and metadata (test_foreign_orbax), HF/Keras indexes
(test_foreign_sharded). Keras .h5 goes through libhdf5 (test_foreign_hdf5_child).
"""

from __future__ import annotations

import os
import shutil
import tracemalloc

import numpy as np
import pytest

import ckpt
from conftest import TESTS

FIXTURES = os.path.join(TESTS, "fixtures", "foreign")
#: (name, the file to damage inside the copied fixture, what to open)
TARGETS = [
    ("safetensors", "st.safetensors", "st.safetensors"),
    ("pytorch zip", "torch_state.pt", "torch_state.pt"),
    ("pytorch zip v3", "torch_v3.pt", "torch_v3.pt"),
    ("flax", "flax_state.msgpack", "flax_state.msgpack"),
    ("tensorflow index", "tf1_saver/model.ckpt-7.index", "tf1_saver/model.ckpt-7"),
    ("tensorflow data", "tf1_saver/model.ckpt-7.data-00000-of-00001", "tf1_saver/model.ckpt-7"),
    ("hf index", "hf_sharded_safetensors/model.safetensors.index.json", "hf_sharded_safetensors"),
    ("keras index", "keras_sharded/model.weights.json", "keras_sharded/model.weights.json"),
    ("keras zip", "keras3_model.keras", "keras3_model.keras"),
]
COUNTS: dict[str, int] = {}


def cuts(size):
    if size <= 1024:
        return list(range(size))
    return sorted(set(range(1024)) | set(range(size - 1024, size)) | set(range(1024, size - 1024, 7)))


def outcome(path):
    """Open and read everything; only a CheckpointError may stop it. Returns the peak memory."""
    tracemalloc.start()
    try:
        with ckpt.load_checkpoint(path) as reader:
            for key in reader.get_variable_to_shape_map():
                reader.get_tensor(key)
    except ckpt.CheckpointError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize("name, damaged, opened", TARGETS, ids=[t[0] for t in TARGETS])
def test_fuzz_foreign_reader(tmp_path, name, damaged, opened):
    source = os.path.join(FIXTURES, damaged.split("/")[0])
    target = tmp_path / damaged.split("/")[0]
    (shutil.copytree if os.path.isdir(source) else shutil.copy)(source, target)
    victim = tmp_path / damaged
    path = str(tmp_path / opened)
    raw = victim.read_bytes()
    directory = os.path.dirname(str(victim))
    budget = 64 * sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)
                      if os.path.isfile(os.path.join(directory, f))) + (4 << 20)
    rng = np.random.default_rng(sum(map(ord, name)))
    variants = [raw[:n] for n in cuts(len(raw))]
    for _ in range(300):
        flipped = bytearray(raw)
        for _ in range(int(rng.integers(1, 4))):
            flipped[int(rng.integers(len(raw)))] ^= 1 << int(rng.integers(8))
        variants.append(bytes(flipped))
    for _ in range(100):  # a run of hostile bytes (huge lengths, 0xff counts) at a random place
        edited = bytearray(raw)
        at, n = int(rng.integers(len(raw))), int(rng.integers(1, 9))
        edited[at:at + n] = bytes([int(rng.choice([0x00, 0x7f, 0x80, 0xff]))]) * n
        variants.append(bytes(edited[:len(raw)]))
    for variant in variants:
        victim.write_bytes(variant)
        peak = outcome(path)
        assert peak <= budget, (name, peak, budget)
    COUNTS[name] = len(variants)
    assert len(variants) >= 300
