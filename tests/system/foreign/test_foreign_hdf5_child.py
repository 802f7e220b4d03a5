"""Foreign HDF5 is first read by libhdf5 in a child process: a crash or a hang there refuses the file
without taking the user's process down."""

from __future__ import annotations

import pathlib
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

import ckpt
from ckpt.formats import _h5child
from conftest import OUTSIDE_CHECKOUT, TESTS

FIXTURES = os.path.join(TESTS, "fixtures", "foreign")


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(_h5child, "ENABLED", True)
    monkeypatch.setattr(_h5child, "_probed", set())


@pytest.mark.parametrize("name", ["keras_legacy_model.h5", "keras3.weights.h5", "keras_legacy_bf16.h5"])
def test_the_child_reads_real_files_cleanly(name):
    """The child's own script must succeed on sound files (else the probe would silently do nothing)."""
    path = os.path.join(FIXTURES, name)
    done = subprocess.run([sys.executable, "-I", "-c", _h5child._CHILD, path, "100"], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()


def test_a_crash_in_the_child_refuses_the_file(tmp_path, fresh, monkeypatch):
    monkeypatch.setattr(_h5child, "_CHILD", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(ckpt.CorruptCheckpointError, match="libhdf5 crashed \\(SIGSEGV\\).*not opened"):
        ckpt.load_checkpoint(os.path.join(FIXTURES, "keras_legacy_model.h5"))


def test_a_hang_in_the_child_refuses_the_file(fresh, monkeypatch):
    monkeypatch.setattr(_h5child, "_CHILD", "import time; time.sleep(60)")
    monkeypatch.setattr(_h5child, "TIMEOUT", 0.5)
    with pytest.raises(ckpt.CorruptCheckpointError, match="did not finish .* child process"):
        ckpt.load_checkpoint(os.path.join(FIXTURES, "keras3.weights.h5"))


def test_each_file_is_probed_once_while_unchanged(tmp_path, fresh, monkeypatch):
    path = str(tmp_path / "w.h5")
    with h5py.File(path, "w") as f:
        f["w"] = np.arange(3.0)
    calls = []
    run = subprocess.run
    monkeypatch.setattr(_h5child.subprocess, "run", lambda *a, **k: calls.append(a) or run(*a, **k))
    for _ in range(3):
        assert ckpt.load_variable(path, "w").tolist() == [0.0, 1.0, 2.0]
    assert len(calls) == 1
    with h5py.File(path, "a") as f:  # changed: probed again
        f["v"] = np.zeros(2)
    ckpt.load_variable(path, "v")
    assert len(calls) == 2


def test_ckpt_files_and_keras_zips_are_not_probed(tmp_path, fresh, monkeypatch):
    monkeypatch.setattr(_h5child, "_CHILD", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    path = ckpt.Saver({"w": ckpt.Variable([1.0])}).save(str(tmp_path / "mine.h5"))
    assert ckpt.load_variable(path, "w").tolist() == [1.0]  # ckpt's own HDF5 is verified first instead
    assert ckpt.list_variables(os.path.join(FIXTURES, "keras3_model.keras"))  # the zip's CRC-32 checked first


def test_a_python_error_in_the_child_is_left_to_the_reader(tmp_path, fresh):
    path = tmp_path / "junk.h5"
    raw = bytearray(pathlib.Path(os.path.join(FIXTURES, "keras3.weights.h5")).read_bytes())
    raw[2000:2400] = b"\x00" * 400
    path.write_bytes(bytes(raw))
    with pytest.raises(ckpt.CheckpointError):
        with ckpt.load_checkpoint(str(path)) as reader:
            for key in reader.get_variable_to_shape_map():
                reader.get_tensor(key)


def test_a_file_that_crashes_libhdf5_is_refused_in_the_users_process():
    """hdf5_segfault.h5: keras_legacy_model.h5 with 4 bits flipped, found by fuzzing; libhdf5 segfaults
    reading it. Opened in a separate interpreter here, so a failure of the isolation cannot take the
    test run down with it."""
    path = os.path.join(FIXTURES, "hdf5_segfault.h5")
    code = ("import sys, ckpt\n"
            "try:\n"
            "    ckpt.load_checkpoint(sys.argv[1])\n"
            "except ckpt.CorruptCheckpointError as exc:\n"
            "    print(exc)\n"
            "    sys.exit(3)\n")
    env = {k: v for k, v in os.environ.items() if k != "CKPT_HDF5_CHILD"}
    done = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, env=env,
                          cwd=OUTSIDE_CHECKOUT)
    assert done.returncode == 3, (done.returncode, done.stderr[-2000:])
    assert "libhdf5 crashed (SIGSEGV)" in done.stdout


def test_a_file_that_hangs_libhdf5_is_refused(fresh, monkeypatch):
    """hdf5_hang.h5: keras_legacy_model.h5 with bits flipped, found by fuzzing; libhdf5 spins on it for
    well over a minute. The probe's time limit refuses it and the child is killed."""
    monkeypatch.setattr(_h5child, "TIMEOUT", 3.0)
    with pytest.raises(ckpt.CorruptCheckpointError, match="did not finish reading this file within 3 s"):
        ckpt.load_checkpoint(os.path.join(FIXTURES, "hdf5_hang.h5"))
