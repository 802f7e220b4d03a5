"""Regenerate the sample checkpoints in this directory, deterministically.

    python sample_checkpoints/generate.py [--out DIRECTORY]

Writes, in both formats where it says so:

* mlp.h5, mlp.msgpack: a 784-64-10 MLP trained with plain numpy on generated 28x28 digit
  images (5x7 font glyphs, scaled, shifted, thickened and noised; see ``make_digits``);
* dtypes.h5, dtypes.msgpack: one tensor of every dtype ckpt supports, plus scalars, empty
  tensors, NaN payloads and infinities, with the values of ``every_dtype``;
* blocks.h5, blocks.msgpack: the tensors of ``block_tensors``, written with checksum blocks of
  SMALL_BLOCK bytes instead of 1 MiB, so that small files pin the block checksum layout;
* compressed.msgpack: ``block_tensors`` again, compressed (``compression="zstd"``, msgpack format
  version 4) with SMALL_BLOCK-byte chunks, so small files pin the byte-plane layout;
* sharded.msgpack/: the same tensors as a sharded checkpoint of 2 shard files (each tensor split
  by rows) and its commit record (version 2);
* slots.h5: the tensors of ``slot_tensors`` (TF1's Adam slot and EMA shadow names, keys that are
  also scopes of other keys), so a small file pins HDF5's layout for them;
* steps/: a Saver's directory: softmax regression on 7x7 pooled digits saved every 100 steps
  with max_to_keep=3, so model-300/400/500.msgpack and the state file remain.

v1/ (msgpack format version 1, HDF5 layout version 1) and v2/ (msgpack format version 2) hold
files of versions ckpt no longer writes, as earlier ckpt versions wrote them; this script leaves
them alone.

Seeds are fixed, BLAS runs on one thread, and the state file's clock is pinned, so two runs
write byte-identical files. tests/unit/formats/test_sample_checkpoints.py reads them back.
"""

from __future__ import annotations

import argparse
import os
import shutil
from unittest import mock

if __name__ == "__main__":  # (not when tests import this file's definitions)
    # one BLAS thread: a fixed summation order, so training gives the same bits on every run
    for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

import ckpt  # noqa: E402
from ckpt.storage.atomic import replace_atomically  # noqa: E402
from ckpt.formats import base, ckpt_sharded  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
#: 2025-01-01T00:00:00Z: the steps directory's clock starts here, one second per step.
EPOCH = 1735689600.0
SEED = 0
TRAIN, TEST = 6000, 1000
EPOCHS, LEARNING_RATE = 5, 0.3
#: Bytes per checksum block in blocks.h5 / blocks.msgpack (ckpt writes 1 MiB blocks).
SMALL_BLOCK = 4096

# 5x7 glyphs of the digits 0-9
FONT = {
    0: ["01110", "10001", "10011", "10101", "11001", "10001", "01110"],
    1: ["00100", "01100", "00100", "00100", "00100", "00100", "01110"],
    2: ["01110", "10001", "00001", "00010", "00100", "01000", "11111"],
    3: ["11111", "00010", "00100", "00010", "00001", "10001", "01110"],
    4: ["00010", "00110", "01010", "10010", "11111", "00010", "00010"],
    5: ["11111", "10000", "11110", "00001", "00001", "10001", "01110"],
    6: ["00110", "01000", "10000", "11110", "10001", "10001", "01110"],
    7: ["11111", "00001", "00010", "00100", "01000", "01000", "01000"],
    8: ["01110", "10001", "10001", "01110", "10001", "10001", "01110"],
    9: ["01110", "10001", "10001", "01111", "00001", "00010", "01100"],
}


def make_digits(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Return ``n`` noisy 28x28 digit images (float32 in [0, 1], flattened to 784) and labels.

    Each glyph is scaled x3 to 21x15, shifted by up to 3 pixels each way, sometimes thickened
    by a pixel, dimmed, and covered in Gaussian noise.
    """
    rng = np.random.default_rng(seed)
    glyphs = np.stack([np.kron(np.array([[int(c) for c in row] for row in FONT[d]], np.float32),
                               np.ones((3, 3), np.float32)) for d in range(10)])
    labels = rng.integers(0, 10, size=n)
    shifts = rng.integers(-3, 4, size=(n, 2))
    thick = rng.random(n) < 0.5
    scale = rng.uniform(0.5, 1.0, size=n).astype(np.float32)
    noise = rng.normal(0.0, 0.35, size=(n, 28, 28)).astype(np.float32)
    images = np.zeros((n, 28, 28), np.float32)
    for i in range(n):
        glyph = glyphs[labels[i]]
        if thick[i]:
            glyph = np.maximum(glyph, np.roll(glyph, 1, axis=1))
        top, left = 3 + shifts[i, 0], 6 + shifts[i, 1]
        images[i, top:top + 21, left:left + 15] = glyph * scale[i]
    images = np.clip(images + noise, 0.0, 1.0)
    return images.reshape(n, 784), labels


class Dense(ckpt.Module):
    """y = x @ kernel + bias."""

    def __init__(self, n_in: int, n_out: int, name: str | None = None) -> None:
        super().__init__(name=name)
        with self.name_scope:
            self.kernel = ckpt.Variable(ckpt.initializers.GlorotUniform(), shape=(n_in, n_out), name="kernel")
            self.bias = ckpt.Variable(ckpt.initializers.Zeros(), shape=(n_out,), name="bias")


class MLP(ckpt.Module):
    """784 -> 64 (ReLU) -> 10 logits."""

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name=name)
        with self.name_scope:
            self.hidden = Dense(784, 64, name="hidden")
            self.logits = Dense(64, 10, name="logits")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return mlp_logits({k: v.numpy() for k, v in self.named_variables()}, x)


def mlp_logits(weights: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """The MLP's forward pass from a {key: array} map (what a checkpoint holds)."""
    h = np.maximum(x @ weights["hidden/kernel"] + weights["hidden/bias"], 0.0)
    return h @ weights["logits/kernel"] + weights["logits/bias"]


def _softmax_grad(logits: np.ndarray, y: np.ndarray) -> np.ndarray:
    """d(mean cross-entropy)/d(logits)."""
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    return p / len(y)


def train_mlp(x: np.ndarray, y: np.ndarray, epochs: int = EPOCHS, lr: float = LEARNING_RATE,
              batch: int = 64) -> MLP:
    """Minibatch SGD on cross-entropy, updating the variables in place."""
    ckpt.random.set_seed(SEED)
    model = MLP(name="mlp")
    order_rng = np.random.default_rng(SEED + 1)
    params = [model.hidden.kernel, model.hidden.bias, model.logits.kernel, model.logits.bias]
    for _ in range(epochs):
        order = order_rng.permutation(len(x))
        for start in range(0, len(x), batch):
            idx = order[start:start + batch]
            xb, yb = x[idx], y[idx]
            pre = xb @ model.hidden.kernel + model.hidden.bias
            h = np.maximum(pre, 0.0)
            g = _softmax_grad(h @ model.logits.kernel + model.logits.bias, yb)
            gh = (g @ model.logits.kernel.numpy().T) * (pre > 0)
            grads = [xb.T @ gh, gh.sum(0), h.T @ g, g.sum(0)]
            for var, grad in zip(params, grads):
                var.assign_sub(lr * grad)
    return model


def accuracy(logits: np.ndarray, y: np.ndarray) -> float:
    return float((logits.argmax(1) == y).mean())


def every_dtype() -> dict[str, np.ndarray]:
    """The tensors of dtypes.h5 / dtypes.msgpack: every supported dtype and awkward values."""
    out: dict[str, np.ndarray] = {}
    for name in ckpt.dtypes.NAMES:
        dtype = ckpt.dtypes.as_dtype(name)
        if name == "string":
            value = np.array([[b"abc", b"", b"nul\x00"], [b"\xff\xfe", b"x" * 40, "\u00fcn\u00efcode".encode()]],
                             dtype=object)
        elif name == "bool":
            value = np.array([[True, False, True], [False, False, True]])
        elif name.startswith("complex"):
            value = np.array([[1 + 2j, -0.5j, 0], [np.inf, complex(np.nan, 1), 3.25]], dtype=dtype)
        elif name.startswith(("int", "uint")):
            info = np.iinfo(dtype)
            value = np.array([[info.min, info.max, 0], [1, 2, 3]], dtype=dtype)
        else:
            value = np.array([[0.0, -0.0, 1.5], [-2.25, np.inf, np.nan]], dtype=dtype)
        out[f"dtypes/{name}"] = value
    out["shapes/scalar"] = np.array(3.5, dtype=np.float32)
    out["shapes/scalar_string"] = np.array(b"only", dtype=object)
    out["shapes/empty"] = np.zeros((0, 4), dtype=np.float64)
    out["shapes/rank4"] = np.arange(2 * 3 * 4 * 5, dtype=np.int16).reshape(2, 3, 4, 5)
    out["values/nan_payloads"] = np.array([0x7FC00001, 0xFF800000, 0x00000001], dtype=np.uint32).view(np.float32)
    out["values/bf16_specials"] = np.array([np.inf, -np.inf, np.nan, -0.0], dtype=ckpt.dtypes.bfloat16)
    return out


def block_tensors() -> dict[str, np.ndarray]:
    """The tensors of blocks.h5 / blocks.msgpack: several SMALL_BLOCK blocks each (the last one
    short or not), and two that have no block checksums (one block; strings)."""
    rng = np.random.default_rng(SEED + 2)
    return {"blocks/float32": rng.standard_normal((100, 50)).astype(np.float32),  # 20000 bytes: 5 blocks
            "blocks/int64": np.arange(1024, dtype=np.int64).reshape(32, 32),  # 8192 bytes: exactly 2
            "blocks/bfloat16": rng.standard_normal((60, 70)).astype(ckpt.dtypes.bfloat16),  # 8400 bytes: 3
            "blocks/one_block": np.arange(10, dtype=np.float64),
            "blocks/string": np.array([b"x" * 3000, b"y" * 3000], dtype=object)}


def write_blocks_file(path: str) -> None:
    """blocks.h5 / blocks.msgpack: ``block_tensors`` with SMALL_BLOCK-byte checksum blocks."""
    write_file(path, sorted(block_tensors().items()), {"block_bytes": SMALL_BLOCK}, block_bytes=SMALL_BLOCK)


def slot_tensors() -> dict[str, np.ndarray]:
    """The tensors of slots.h5: TF1's names for Adam's slots and EMA shadows, beside the variables
    they belong to ("dense/kernel" is a tensor and the scope of "dense/kernel/Adam")."""
    rng = np.random.default_rng(SEED + 3)
    tensors = {"global_step": np.int64(100), "beta1_power": np.float32(0.9 ** 100)}
    for name, shape in (("dense/kernel", (4, 3)), ("dense/bias", (3,))):
        for suffix in ("", "/Adam", "/Adam_1", "/ExponentialMovingAverage"):
            tensors[name + suffix] = rng.standard_normal(shape).astype(np.float32)
    tensors["dense"] = np.array([b"not a scope only"], dtype=object)  # a tensor two levels up
    return tensors


def write_slots_file(path: str) -> None:
    """slots.h5: ``slot_tensors``, the HDF5 layout of keys that are also scopes (docs/formats.md)."""
    write_file(path, sorted(slot_tensors().items()), {"description": "TF1 slot and shadow names"})


def write_compressed_file(path: str) -> None:
    """compressed.msgpack: ``block_tensors`` compressed, in SMALL_BLOCK-byte chunks."""
    write_file(path, sorted(block_tensors().items()), {"block_bytes": SMALL_BLOCK}, block_bytes=SMALL_BLOCK,
               compression="zstd")


def write_sharded(directory: str) -> None:
    """sharded.msgpack/: ``block_tensors`` in 2 shard files, as ``ckpt convert --shards 2`` writes them
    (with a fixed save id, so the names repeat)."""
    shutil.rmtree(directory, ignore_errors=True)
    tensors = block_tensors()
    ckpt_sharded.write_single_process(
        directory, [(key, value.dtype, value.shape) for key, value in sorted(tensors.items())],
        lambda key, offset, shape: tensors[key][offset[0]:offset[0] + shape[0]], {"parts": 2}, parts=2, step=9,
        save_id="5a3d0c1e2b4f6789")


def write_file(path: str, tensors: list[tuple[str, np.ndarray]], metadata: dict, block_bytes: int | None = None,
               compression: str | None = None) -> None:
    """Write one checkpoint file (no state file: these files stand alone); ``block_bytes``: its
    checksum block size, where not the format's default."""
    fmt = base.format_for_path(path)
    if block_bytes is not None:
        fmt = type(fmt)(block_bytes=block_bytes)
    with replace_atomically(path) as tmp:
        fmt.write(tmp, tensors, metadata, compression=compression)


def pooled(x: np.ndarray) -> np.ndarray:
    """28x28 images -> 7x7 means of 4x4 blocks, flattened to 49."""
    return x.reshape(-1, 7, 4, 7, 4).mean(axis=(2, 4)).reshape(-1, 49)


def write_steps(directory: str, x: np.ndarray, y: np.ndarray) -> None:
    """Train softmax regression on pooled digits, saving every 100 steps (max_to_keep=3)."""
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    with ckpt.name_scope("softmax"):
        kernel = ckpt.Variable(np.zeros((49, 10), np.float32), name="kernel")
        bias = ckpt.Variable(np.zeros(10, np.float32), name="bias")
    step = ckpt.Variable(np.int64(0), name="global_step", trainable=False)
    saver = ckpt.Saver([kernel, bias, step], max_to_keep=3)
    xs = pooled(x)
    clock = [EPOCH]
    with mock.patch("time.time", lambda: clock[0]):
        for i in range(1, 501):
            idx = np.arange(i * 32, i * 32 + 32) % len(xs)
            g = _softmax_grad(xs[idx] @ kernel + bias, y[idx])
            kernel.assign_sub(0.5 * (xs[idx].T @ g))
            bias.assign_sub(0.5 * g.sum(0))
            step.assign(i)
            if i % 100 == 0:
                clock[0] = EPOCH + i
                acc = accuracy(xs @ kernel + bias, y)
                saver.save(os.path.join(directory, "model.msgpack"), global_step=i,
                           metadata={"train_accuracy": round(acc, 4)})
    os.remove(os.path.join(directory, ".checkpoint.lock"))  # the Saver's lock file, not data


def main(out: str) -> None:
    x, y = make_digits(TRAIN + TEST, SEED)
    x_train, y_train, x_test, y_test = x[:TRAIN], y[:TRAIN], x[TRAIN:], y[TRAIN:]
    model = train_mlp(x_train, y_train)
    test_acc = accuracy(model(x_test), y_test)
    metadata = {"model": "MLP 784-64-10, ReLU", "dataset": "generate.py make_digits(7000, seed=0)",
                "train_examples": TRAIN, "test_examples": TEST, "epochs": EPOCHS,
                "test_accuracy": round(test_acc, 4)}
    tensors = [(key, var.numpy()) for key, var in model.named_variables()]
    dtypes = sorted(every_dtype().items())
    for ext in (".h5", ".msgpack"):
        write_file(os.path.join(out, "mlp" + ext), tensors, metadata)
        write_file(os.path.join(out, "dtypes" + ext), dtypes, {"description": "every dtype ckpt supports"})
        write_blocks_file(os.path.join(out, "blocks" + ext))
    write_compressed_file(os.path.join(out, "compressed.msgpack"))
    write_slots_file(os.path.join(out, "slots.h5"))
    write_steps(os.path.join(out, "steps"), x_train, y_train)
    write_sharded(os.path.join(out, "sharded.msgpack"))
    print(f"MLP test accuracy on {TEST} generated digits: {test_acc:.4f}; files in {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=HERE, help="where to write (default: this directory)")
    main(parser.parse_args().out)
