"""ckpt end to end: build a model from Modules, train it with numpy, save, restore, inspect,
then grow it by a layer and restore the pretrained layers into the bigger model, and move
pretrained layers into another model by checkpoint scope.

Run:  python examples/quickstart.py [--dir DIRECTORY]

The checkpoints stay in DIRECTORY (default: a new temporary directory) for you to look at
with the ``ckpt`` command; the last lines say where they are and how to remove them.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import sys
import tempfile

import numpy as np

import ckpt


class Dense(ckpt.Module):
    """y = x @ kernel + bias, with Glorot-uniform kernels and zero biases."""

    def __init__(self, n_in: int, n_out: int, name: str | None = None) -> None:
        super().__init__(name=name)
        with self.name_scope:
            self.kernel = ckpt.Variable(ckpt.initializers.GlorotUniform(), shape=(n_in, n_out), name="kernel")
            self.bias = ckpt.Variable(ckpt.initializers.Zeros(), shape=(n_out,), name="bias")


class MLP(ckpt.Module):
    """Dense layers with tanh between them."""

    def __init__(self, sizes: list[int], name: str | None = None) -> None:
        super().__init__(name=name)
        with self.name_scope:
            self.layers = [Dense(a, b, name=f"dense_{i}") for i, (a, b) in enumerate(itertools.pairwise(sizes))]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        for layer in self.layers[:-1]:
            x = np.tanh(x @ layer.kernel + layer.bias)
        return x @ self.layers[-1].kernel + self.layers[-1].bias


def train_step(model: MLP, x: np.ndarray, y: np.ndarray, lr: float = 0.05) -> float:
    """One step of gradient descent on the mean squared error; returns the loss before it."""
    acts = [x]
    for layer in model.layers[:-1]:
        acts.append(np.tanh(acts[-1] @ layer.kernel + layer.bias))
    out = acts[-1] @ model.layers[-1].kernel + model.layers[-1].bias
    grad = 2 * (out - y) / len(x)
    for i in reversed(range(len(model.layers))):
        layer = model.layers[i]
        grad_kernel, grad_bias = acts[i].T @ grad, grad.sum(0)
        if i:
            grad = (grad @ layer.kernel.numpy().T) * (1 - acts[i] ** 2)
        layer.kernel.assign_sub(lr * grad_kernel)  # in place: the variable's buffer never moves
        layer.bias.assign_sub(lr * grad_bias)
    return float(((out - y) ** 2).mean())


def make_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((256, 8)).astype(np.float32)
    y = np.stack([np.sin(x[:, :4].sum(1)), np.cos(x[:, 4:].sum(1)), x[:, 0] * x[:, 1], np.tanh(x[:, 2])], 1)
    return x, y.astype(np.float32)


def main(directory: str) -> None:
    ckpt.random.set_seed(0)  # unseeded initializers become reproducible
    x, y = make_data()

    print("== 1. build and train a 5-layer MLP")
    model = MLP([8, 32, 32, 32, 32, 4], name="mlp")
    print(f"   {len(model.variables)} variables, e.g. {model.variables[1].name} {model.variables[1].shape}")
    saver = ckpt.Saver(model, max_to_keep=3)
    for step in range(1, 301):
        loss = train_step(model, x, y)
        if step % 100 == 0:
            path = saver.save(os.path.join(directory, "mlp.h5"), global_step=step, metadata={"loss": loss})
            print(f"   step {step}: loss {loss:.4f} -> saved {os.path.basename(path)}")
    print(f"   kept: {[os.path.basename(p) for p in saver.last_checkpoints]}")

    print("== 2. restore into a fresh model (deferred init: no random initialization is paid for)")
    with ckpt.deferred_init():
        fresh = MLP([8, 32, 32, 32, 32, 4], name="mlp")
    result = ckpt.Saver(fresh).restore(directory)  # a directory means its latest checkpoint
    same = np.array_equal(fresh(x), model(x))
    print(f"   restored {len(result.restored)} tensors from {os.path.basename(result.path)}; "
          f"predictions identical: {same}")

    print("== 3. inspect the checkpoint without a model")
    with ckpt.load_checkpoint(directory) as reader:
        print(f"   {reader.format} file, metadata {reader.metadata}")
        for key, shape in sorted(reader.get_variable_to_shape_map().items())[:4]:
            print(f"   tensor: {key} ({reader.get_variable_to_dtype_map()[key]}) {shape}")
        print(f"   ... {len(reader.tensors)} tensors in all (from a terminal: {_ckpt_command()} inspect {directory})")

    print("== 4. grow the model to 6 layers and restore the pretrained five")
    with ckpt.deferred_init():
        bigger = MLP([8, 32, 32, 32, 32, 4, 1], name="bigger")
    result = ckpt.Saver(bigger).restore(directory, strict=False)
    print(f"   restored {len(result.restored)} tensors; missing (new layer): {result.missing}")
    ckpt.initialize_variables([v for v in bigger.variables if not v.is_initialized()])
    print(f"   uninitialized after initializing the new layer: {ckpt.report_uninitialized_variables(bigger.variables)}")
    target = y.sum(1, keepdims=True)
    first = train_step(bigger, x, target, lr=0.01)
    for _ in range(99):
        last = train_step(bigger, x, target, lr=0.01)
    pretrained = saver.last_checkpoints[-1]
    path = ckpt.Saver(bigger, format="msgpack").save(os.path.join(directory, "bigger"), global_step=100)
    print(f"   trained on: loss {first:.4f} -> {last:.4f}; saved {os.path.basename(path)}")
    print(f"   latest checkpoint in the directory: {os.path.basename(ckpt.latest_checkpoint(directory))}")

    print("== 5. transfer learning by scope: two pretrained layers into another model")
    with ckpt.deferred_init():
        encoder = MLP([8, 32, 32, 2], name="encoder")
    # checkpoint scope -> Module: "layers/0/kernel" in the file goes to encoder.layers[0].kernel
    pairs = ckpt.init_from_checkpoint(pretrained, {"layers/0/": encoder.layers[0], "layers/1/": encoder.layers[1]})
    ckpt.initialize_variables(encoder.layers[2].variables)
    print(f"   from {os.path.basename(pretrained)}: {sorted(key for key, _ in pairs)}")
    print(f"   encoder's first layer equals the trained one: "
          f"{np.array_equal(encoder.layers[0].kernel.numpy(), model.layers[0].kernel.numpy())}")


def _ckpt_command() -> str:
    """How to run the ckpt command installed next to this Python (".venv/bin/ckpt")."""
    script = os.path.join(os.path.dirname(sys.executable), "ckpt")
    if not os.path.exists(script):
        return "ckpt"
    relative = os.path.relpath(script)
    return relative if not relative.startswith(os.pardir) else script


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="where to write checkpoints (default: a new temporary directory)")
    args = parser.parse_args()
    target_dir = args.dir or tempfile.mkdtemp(prefix="ckpt-quickstart-")
    os.makedirs(target_dir, exist_ok=True)
    main(target_dir)
    command, quoted = _ckpt_command(), shlex.quote(target_dir)
    print(f"== the checkpoints are left in {target_dir}; look inside them with the ckpt command:")
    print(f"   {command} ls {quoted}")
    print(f"   {command} inspect {quoted} --stats")
    print(f"   {command} diff {shlex.quote(os.path.join(target_dir, 'mlp-200.h5'))} "
          f"{shlex.quote(os.path.join(target_dir, 'mlp-300.h5'))}")
    print(f"== remove them when done: rm -r {quoted}")
