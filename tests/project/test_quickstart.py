"""The README's main job: examples/quickstart.py runs end to end and does what it prints."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import ckpt
from conftest import TESTS, ROOT

EXAMPLE = os.path.join(TESTS, os.pardir, "examples", "quickstart.py")


def test_quickstart_runs_end_to_end(tmp_path):
    out = subprocess.run([sys.executable, EXAMPLE, "--dir", str(tmp_path)], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "predictions identical: True" in out
    assert "missing (new layer): ['layers/5/bias', 'layers/5/kernel']" in out
    assert "uninitialized after initializing the new layer: []" in out
    assert sorted(p for p in os.listdir(tmp_path) if not p.startswith(".")) == \
        ["bigger-100.msgpack", "checkpoint", "mlp-100.h5", "mlp-200.h5", "mlp-300.h5"]
    assert ckpt.latest_checkpoint(tmp_path) == str(tmp_path / "bigger-100.msgpack")
    assert ("layers/5/kernel", [4, 1]) in ckpt.list_variables(tmp_path)
    assert "from mlp-300.h5: ['layers/0/bias', 'layers/0/kernel', 'layers/1/bias', 'layers/1/kernel']" in out
    assert "encoder's first layer equals the trained one: True" in out


def test_quickstart_ends_with_ckpt_commands_that_work_and_names_what_it_leaves(tmp_path):
    root = ROOT
    out = subprocess.run([sys.executable, EXAMPLE], capture_output=True, text=True, timeout=120, check=True,
                         cwd=root).stdout.splitlines()
    left = next(line for line in out if line.startswith("== the checkpoints are left in "))
    directory = left[len("== the checkpoints are left in "):].partition(";")[0]
    try:
        assert out[-1] == f"== remove them when done: rm -r {shlex.quote(directory)}"
        commands = [shlex.split(line) for line in out[out.index(left) + 1:-1]]
        assert [c[1] for c in commands] == ["ls", "inspect", "diff"]
        for command in commands:
            assert command[0].endswith("ckpt") and os.path.exists(os.path.join(root, command[0]))
            done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=root)
            assert done.returncode in ((0, 1) if command[1] == "diff" else (0,)), done.stderr
            assert done.stdout and done.stderr == ""
    finally:
        shutil.rmtree(directory)
