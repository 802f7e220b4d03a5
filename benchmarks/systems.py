"""The systems compared: ckpt's two formats, peers, and the raw I/O limit.

Each system saves a ``{key: array}`` model to one file and restores it, into the existing
arrays where its API allows (ckpt, h5py, raw) and through its own loading API otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

import ckpt

Model = dict[str, np.ndarray]


class System:
    """A way of saving and restoring a model; subclasses fill in the three operations."""

    name = ""
    ext = ""
    in_place = False  # restores into the existing arrays

    def prepare(self, model: Model, variables: dict[str, ckpt.Variable]) -> None:
        """Once per model, untimed (e.g. building a Saver); ``model`` holds the variables' buffers."""

    def save(self, path: str, model: Model) -> None:
        raise NotImplementedError

    def restore(self, path: str, model: Model) -> Any:
        raise NotImplementedError

    def restore_one(self, path: str, key: str, out: np.ndarray) -> Any:
        raise NotImplementedError


class CkptSystem(System):
    """ckpt.Saver.save / Saver.restore into existing variables (fsync included)."""

    in_place = True

    def __init__(self, fmt: str, ext: str) -> None:
        self.name, self.ext, self.fmt = f"ckpt {fmt}", ext, fmt

    def prepare(self, model: Model, variables: dict[str, ckpt.Variable]) -> None:
        self.variables = variables
        self.saver = ckpt.Saver(variables, max_to_keep=None, format=self.fmt)

    def save(self, path: str, model: Model) -> None:
        self.saver.save(path)

    def restore(self, path: str, model: Model) -> Any:
        return self.saver.restore(path)

    def restore_one(self, path: str, key: str, out: np.ndarray) -> Any:
        return ckpt.Saver({key: self.variables[key]}).restore(path)


class RawSystem(System):
    """The limit: one write per tensor (and fsync when durable), readinto preallocated arrays."""

    ext = "bin"
    in_place = True

    def __init__(self, durable: bool) -> None:
        self.durable = durable
        self.name = "raw write+fsync" if durable else "raw write"

    def save(self, path: str, model: Model) -> None:
        with open(path, "wb", buffering=0) as f:
            for arr in model.values():
                f.write(memoryview(arr).cast("B"))
            if self.durable:
                os.fsync(f.fileno())

    def restore(self, path: str, model: Model) -> Any:
        with open(path, "rb", buffering=0) as f:
            for arr in model.values():
                f.readinto(memoryview(arr).cast("B"))

    def restore_one(self, path: str, key: str, out: np.ndarray) -> Any:
        offset = 0
        for k, arr in self.layout.items():
            if k == key:
                break
            offset += arr.nbytes
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            f.readinto(memoryview(out).cast("B"))

    def prepare(self, model: Model, variables: dict[str, ckpt.Variable]) -> None:
        self.layout = model


class SafetensorsSystem(System):
    """safetensors.numpy: save_file / load_file, safe_open for one tensor."""

    name, ext = "safetensors", "safetensors"

    def __init__(self, durable: bool = False) -> None:
        self.durable = durable  # ckpt fsyncs every save; this variant does the same for fairness
        if durable:
            self.name = "safetensors+fsync"

    def save(self, path: str, model: Model) -> None:
        from safetensors.numpy import save_file

        save_file(model, path)
        if self.durable:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def restore(self, path: str, model: Model) -> Any:
        from safetensors.numpy import load_file

        return load_file(path)

    def restore_one(self, path: str, key: str, out: np.ndarray) -> Any:
        from safetensors import safe_open

        with safe_open(path, framework="np") as f:
            return f.get_tensor(key)


class NpzSystem(System):
    """np.savez / np.load."""

    name, ext = "numpy npz", "npz"

    def save(self, path: str, model: Model) -> None:
        with open(path, "wb") as f:
            np.savez(f, **model)

    def restore(self, path: str, model: Model) -> Any:
        with np.load(path) as z:
            return {k: z[k] for k in z.files}

    def restore_one(self, path: str, key: str, out: np.ndarray) -> Any:
        with np.load(path) as z:
            return z[key]


class H5pySystem(System):
    """Plain h5py: a create_dataset loop; read_direct into the existing arrays."""

    name, ext, in_place = "h5py", "h5", True

    def save(self, path: str, model: Model) -> None:
        import h5py

        with h5py.File(path, "w") as f:
            for k, arr in model.items():
                f.create_dataset(k, data=arr)

    def restore(self, path: str, model: Model) -> Any:
        import h5py

        with h5py.File(path, "r") as f:
            for k, arr in model.items():
                f[k].read_direct(arr)

    def restore_one(self, path: str, key: str, out: np.ndarray) -> Any:
        import h5py

        with h5py.File(path, "r") as f:
            f[key].read_direct(out)


class FlaxStyleSystem(System):
    """flax.serialization's approach: packb of {key: {shape, dtype, bytes}}; unpack it all to read."""

    name, ext = "flax-style msgpack", "fmsgpack"

    def save(self, path: str, model: Model) -> None:
        import msgpack

        doc = {k: {"shape": list(a.shape), "dtype": a.dtype.name, "data": a.tobytes()} for k, a in model.items()}
        with open(path, "wb") as f:
            f.write(msgpack.packb(doc, use_bin_type=True))

    def restore(self, path: str, model: Model) -> Any:
        import msgpack

        with open(path, "rb") as f:
            doc = msgpack.unpackb(f.read(), raw=False, max_bin_len=2 ** 32 - 1)
        return {k: np.frombuffer(v["data"], v["dtype"]).reshape(v["shape"]) for k, v in doc.items()}

    def restore_one(self, path: str, key: str, out: np.ndarray) -> Any:
        return self.restore(path, {})[key]


class TorchSystem(System):
    """torch.save / torch.load(weights_only=True) of tensors sharing the numpy buffers."""

    name, ext = "torch", "pt"

    def save(self, path: str, model: Model) -> None:
        import torch

        torch.save({k: torch.from_numpy(a) for k, a in model.items()}, path)

    def restore(self, path: str, model: Model) -> Any:
        import torch

        return torch.load(path, weights_only=True)

    def restore_one(self, path: str, key: str, out: np.ndarray) -> Any:
        import torch

        return torch.load(path, weights_only=True, mmap=True)[key].clone()


def _installed(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def all_systems() -> list[System]:
    """Every system available here; peers whose package is missing are left out."""
    systems: list[System] = [CkptSystem("hdf5", "h5"), CkptSystem("msgpack", "msgpack"),
                             RawSystem(durable=False), RawSystem(durable=True)]
    optional: list[tuple[str, Callable[[], System]]] = [
        ("safetensors", SafetensorsSystem), ("safetensors", lambda: SafetensorsSystem(durable=True)),
        ("numpy", NpzSystem), ("h5py", H5pySystem),
        ("msgpack", FlaxStyleSystem), ("torch", TorchSystem)]
    systems += [make() for module, make in optional if _installed(module)]
    return systems
