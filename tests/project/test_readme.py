"""Every Python block of the README runs as written, in order, in a fresh process, and its
comments say what it does. (The sharded-checkpoint block runs as one MPI process.)"""

from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
import sys

from test_docs import DOCS, ROOT, python_blocks

# What the README's blocks left behind, read back by the same process once they have run.
FACTS = '''
import json as _json
_torch = ckpt.load_file(torch_file)
print(_json.dumps({
    "v": float(v.numpy()),
    "layer_keys": [k for k, _ in layer.named_variables()],
    "mlp_names": [v.name for v in model.layers[1].variables],
    "path": path,
    "sharded": sharded,
    "emb": ckpt.load_checkpoint("sharded_run").get_variable_to_shape_map(),
    "latest": ckpt.latest_checkpoint("run"),
    "bigger": bigger.name,
    "missing": result.missing,
    "same_layers": all((a.numpy() == b.numpy()).all() for a, b in zip(model.variables[:4], bigger.variables[:4])),
    "initialized": ckpt.report_uninitialized_variables(bigger.variables),
    "names_keys": [k for k, _ in ckpt.list_variables(names)],
    "loaded": sorted(loaded),
    "step": int(loaded["step"]),
    "torch_kernel": (layer1.kernel.numpy() == _torch["fc1.weight"].T).all().item(),
    "torch_bias": (layer1.bias.numpy() == _torch["fc1.bias"]).all().item(),
    "listed": [(r.path, r.metrics) for r in ckpt.list_checkpoints("train_run")],
    "best": best,
    "steps": [r.step for r in ckpt.list_checkpoints("train_run")],
    "w": w.numpy().tolist(),
    "train": [k for k, _ in ckpt.list_variables("train")],
    "train_latest": ckpt.latest_checkpoint("train"),
    "train_steps": [train_steps, resumed_from, evaluated],
    "resumed": [int(global_step), json.loads(rng_state.numpy()) == rng.bit_generator.state],
    "averaged": [averaged, ckpt.load_variable(averaged, "train/w").tolist()],
    "incremental": [written, usage, ckpt.load_variable(ckpt.latest_checkpoint("tune"), "head").tolist()[0][0]],
    "preempted": (step, guard.requested, guard.signal == signal.SIGTERM, signal.getsignal(signal.SIGTERM) == signal.SIG_DFL),
}))
'''


def test_every_readme_python_block_runs_as_written(tmp_path):
    blocks = python_blocks("README.md")
    assert len(blocks) >= 5
    fixture = os.path.join("tests", "fixtures", "foreign", "torch_state.pt")
    os.makedirs(tmp_path / os.path.dirname(fixture))
    shutil.copy(os.path.join(ROOT, fixture), tmp_path / fixture)
    script = tmp_path / "readme.py"
    script.write_text("\n".join(blocks) + FACTS, encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout.splitlines()[-1])
    assert facts["v"] == 3.0  # v.assign(2); v.assign_add(1.0)
    assert facts["layer_keys"] == ["bias", "kernel"]
    assert facts["mlp_names"] == ["mlp/dense_1/bias:0", "mlp/dense_1/kernel:0"]
    assert facts["path"] == "run/model-1000.h5" and facts["latest"] == "run/model-1000.h5"
    assert facts["sharded"] == "sharded_run/model-100.msgpack" and facts["emb"] == {"bias": [64], "emb": [1000, 64]}
    assert facts["bigger"] == "mlp_1"
    assert facts["missing"] == ["layers/2/bias", "layers/2/kernel"]
    assert facts["same_layers"] and facts["initialized"] == []
    assert facts["names_keys"][:2] == ["mlp/dense/bias", "mlp/dense/kernel"]
    assert facts["loaded"] == ["embedding/table", "step"] and facts["step"] == 1000
    assert facts["torch_kernel"] and facts["torch_bias"]
    assert facts["best"] == "train_run/model-200.h5" and facts["w"] == [4.0] * 4  # restored latest: step 400
    assert facts["steps"] == [300, 400, 500, 600, 800]  # 800: saved when the guard saw the SIGTERM
    assert facts["preempted"] == [800, True, True, True]
    assert facts["averaged"] == ["weights/averaged.h5", [4.0] * 4]
    assert facts["listed"][:2] == [["model-300.h5", {"val_loss": 0.6, "acc": 0.4}],
                               ["model-400.h5", {"val_loss": 0.7, "acc": 1 - 0.7}]]
    assert sorted(os.listdir(tmp_path)) == ["pretrained", "readme.py", "run", "sharded_run", "tests", "train",
                                            "train_run", "tune", "weights"]
    written, usage, head = facts["incremental"]
    assert 0 < written <= 256 * 8 * 4 + 1024 and abs(head - 0.3) < 1e-6  # the head's chunk (or its delta) only
    assert [row[0] for row in usage] == ["model-1.msgpack", "model-2.msgpack"]  # max_to_keep=2
    assert all(shared >= 256 * 256 * 4 for _, _, shared in usage)  # both reference the backbone's chunks
    assert facts["train_latest"] == "train/model-3.h5" and facts["resumed"] == [3, True]
    assert facts["train_steps"] == [[[1, 2, 3], 3], "train/model-3.h5", "train/model-3.h5"]
    assert facts["train"] == ["model/layers/0/bias", "model/layers/0/kernel", "model/layers/1/bias",
                              "model/layers/1/kernel", "optimizer/momentum/layers/0/bias",
                              "optimizer/momentum/layers/0/kernel", "optimizer/momentum/layers/1/bias",
                              "optimizer/momentum/layers/1/kernel", "rng", "step"]


def _distribution_name() -> str:
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        return re.search(r'^name = "([^"]+)"$', f.read(), flags=re.M).group(1)


def test_every_install_line_names_the_checkout_or_our_distribution():
    """`pip install ckpt` installs an unrelated project of that name (with the same import package and
    command): README, docs and install hints in the code say `.`/`.[extra]` or our distribution's name."""
    assert _distribution_name() == "ckpt-numpy"
    sources = DOCS + [os.path.join(d, f) for top in ("ckpt", "formats", "cli", "benchmarks", "examples")
                      for d, _, files in os.walk(os.path.join(ROOT, top)) for f in files if f.endswith(".py")]
    wrong = []
    for source in sources:
        with open(source, encoding="utf-8") as f:
            text = f.read()
        # the requirement after "pip install" (options skipped), and each "name[extra]" written alone
        named = re.findall(r"pip install (?:-[\w-]+ )*[\"'`]?([\w.-]*)\[", text)
        named += re.findall(r"[\"'`(]([\w-]+)\[(?:mpi|s3|gcs|orbax|test|bench)\]", text)
        wrong += [f"{os.path.relpath(source, ROOT)}: {name}[...]" for name in named
                  if name not in (".", "", _distribution_name())]
    assert not wrong, wrong
