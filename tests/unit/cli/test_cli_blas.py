"""The ckpt command asks OpenBLAS for no threads of its own (cli/main.py), unless the user chose."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_RUN = ("import os, sys\n{before}from ckpt.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
        "print(os.environ.get('OPENBLAS_NUM_THREADS'))\n")


@pytest.mark.parametrize(("before", "preset", "expected"), [
    ("", None, "1"),  # a command as people run it: numpy is imported later, with one BLAS thread
    ("", "3", "3"),  # the user's choice stands
    ("import numpy\n", None, "None"),  # numpy already loaded (a program calling main): nothing changes
])
def test_the_command_asks_openblas_for_no_threads(before, preset, expected):
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if preset is not None:
        env["OPENBLAS_NUM_THREADS"] = preset
    out = subprocess.run([sys.executable, "-c", _RUN.format(before=before)], env=env, capture_output=True,
                         text=True, check=True, timeout=60).stdout
    assert out.splitlines()[-1] == expected
