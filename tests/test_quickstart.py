"""The README's main job: examples/quickstart.py runs end to end and does what it prints."""

from __future__ import annotations

import os
import subprocess
import sys

import ckpt

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "quickstart.py")


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
