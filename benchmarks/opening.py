"""Case ``open``: opening a checkpoint of many small tensors (issue 29's target: ≤ 2x the time of
safetensors' ``safe_open`` of the same tensors).

"Opening" is what any reader must do before reading a tensor: read and check the index. ckpt's
side is ``ckpt.load_checkpoint(path)`` plus ``len()`` (every key known), safetensors' side is
``safe_open(path)`` plus ``keys()``. The systems are interleaved, one opening each per round, so
that load on a shared machine falls on both; medians are reported.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

import ckpt

from .run import fmt_row


def _open_ckpt(path: str) -> None:
    with ckpt.load_checkpoint(path) as reader:
        len(reader)


def _open_safetensors(path: str) -> None:
    from safetensors import safe_open

    with safe_open(path, framework="np") as f:
        f.keys()


def open_case(label: str, directory: str, count: int, reps: int) -> str:
    """Median opening time of ``count`` 64-byte tensors in HDF5, msgpack and safetensors."""
    try:
        from safetensors.numpy import save_file
    except ImportError:
        return "**open**: skipped (safetensors is not installed: pip install '.[bench]')"
    rng = np.random.default_rng(2)
    model = {f"layer{i // 4}/w{i % 4}": rng.standard_normal(16).astype(np.float32) for i in range(count)}
    variables = {k: ckpt.Variable(v, name=k) for k, v in model.items()}
    paths = {fmt: ckpt.Saver(variables, max_to_keep=None, format=fmt).save(os.path.join(directory, f"open.{ext}"))
             for fmt, ext in (("hdf5", "h5"), ("msgpack", "msgpack"))}
    paths["safetensors"] = os.path.join(directory, "open.safetensors")
    save_file(model, paths["safetensors"])
    openers = {fmt: (_open_safetensors if fmt == "safetensors" else _open_ckpt) for fmt in paths}
    times: dict[str, list[float]] = {fmt: [] for fmt in paths}
    for _ in range(max(reps * 4, 20)):  # milliseconds each: many rounds, interleaved
        for fmt, opener in openers.items():
            start = time.perf_counter()
            opener(paths[fmt])
            times[fmt].append(time.perf_counter() - start)
    medians = {fmt: statistics.median(t) for fmt, t in times.items()}
    lines = [f"**open ({label}): load_checkpoint + len() of {count:,} tensors of 64 B, against safetensors' "
             "safe_open + keys(), interleaved medians**", "",
             fmt_row(["format", "open ms", "time / safe_open", "target", ""]), fmt_row(["---"] * 5)]
    for fmt in ("hdf5", "msgpack"):
        ratio = medians[fmt] / medians["safetensors"]
        lines.append(fmt_row([fmt, f"{1000 * medians[fmt]:.1f}", f"{ratio:.2f}x", "≤ 2x",
                              "met" if ratio <= 2 else "NOT met"]))
    lines.append(fmt_row(["safetensors", f"{1000 * medians['safetensors']:.1f}", "1.00x", "", ""]))
    for path in paths.values():
        os.remove(path)
    return "\n".join(lines)
