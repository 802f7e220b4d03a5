"""What reading foreign HDF5 through a child process first costs (formats/_h5child.py).

A Keras-like file (groups of small and mid-sized datasets) is opened with ckpt's reader, the
child probe off and on (its once-per-file cache cleared each time), plus the whole-file read.
"""

from __future__ import annotations

import os
import statistics
import time

import h5py
import numpy as np

import ckpt
from ckpt.formats import _h5child

from .run import fmt_row


def write_file(path: str, layers: int, nbytes: int) -> int:
    """``layers`` groups, each a kernel of ``nbytes`` and a bias; returns the file's size."""
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f.attrs["layer_names"] = [f"dense_{i}".encode() for i in range(layers)]
        for i in range(layers):
            g = f.create_group(f"dense_{i}")
            g.attrs["weight_names"] = [f"dense_{i}/kernel:0".encode(), f"dense_{i}/bias:0".encode()]
            g[f"dense_{i}/kernel:0"] = rng.standard_normal(nbytes // 4).astype(np.float32)
            g[f"dense_{i}/bias:0"] = np.zeros(16, np.float32)
    return os.path.getsize(path)


def timed(path: str, probe: bool, read: bool, reps: int) -> float:
    _h5child.ENABLED = probe
    times = []
    for _ in range(reps):
        _h5child._probed.clear()
        start = time.perf_counter()
        with ckpt.load_checkpoint(path) as reader:
            if read:
                for key in reader.get_variable_to_shape_map():
                    reader.get_tensor(key)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def report(directory: str, reps: int) -> None:
    enabled = _h5child.ENABLED
    print(f"**foreign HDF5: first open with libhdf5 probed in a child process, median of {reps}**\n")
    print(fmt_row(["file", "open, no child (ms)", "open, child (ms)", "open + read all, no child (ms)",
                   "open + read all, child (ms)"]))
    print(fmt_row(["---"] * 5))
    try:
        for layers, nbytes in ((8, 4096), (100, 256 << 10), (50, 4 << 20)):
            path = os.path.join(directory, f"keras_{layers}.h5")
            size = write_file(path, layers, nbytes)
            row = [f"{layers} layers, {size / (1 << 20):.1f} MiB"]
            for read in (False, True):
                row += [f"{1000 * timed(path, False, read, reps):.0f}", f"{1000 * timed(path, True, read, reps):.0f}"]
            print(fmt_row([row[0], row[1], row[2], row[3], row[4]]))
            os.remove(path)
    finally:
        _h5child.ENABLED = enabled
    print()
