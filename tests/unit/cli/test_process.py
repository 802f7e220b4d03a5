"""The ``ckpt`` console script as a process of its own (``ckpt.cli.main.run``): what it sets for
the process, and that the files and outputs are those of the library call."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import ckpt

#: Runs the console script's entry point with the given arguments, then (from an atexit handler
#: registered before it, so run after every other) reports what the process looked like at exit.
_PROBE = """
import atexit, gc, os, sys
def report():
    sys.stderr.write(f"\\nPROBE {os.environ.get('OPENBLAS_NUM_THREADS')} {gc.get_freeze_count() > 0}\\n")
atexit.register(report)
sys.argv = ["ckpt", *sys.argv[1:]]
from ckpt.cli.main import run
sys.exit(run())
"""


def probe(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    environ = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    environ.update(env or {})
    proc = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, env=environ,
                          timeout=120)
    line = [part for part in proc.stderr.splitlines() if part.startswith("PROBE ")]
    assert len(line) == 1, proc.stderr
    return proc, line[0].split()[1:]


def save(path: str) -> str:
    rng = np.random.default_rng(29)
    ckpt.Saver({"enc/w": ckpt.Variable(rng.standard_normal((300, 700)).astype(np.float32)),
                "enc/b": ckpt.Variable(rng.standard_normal(700)), "step": ckpt.Variable(np.int64(7))},
               max_to_keep=None).save(path)
    return path


def test_the_process_starts_no_openblas_threads_and_keeps_a_users_setting(tmp_path):
    src = save(str(tmp_path / "m.msgpack"))
    proc, (threads, _) = probe("inspect", src)
    assert proc.returncode == 0 and "enc/w" in proc.stdout
    assert threads == "1"
    _, (threads, _) = probe("inspect", src, env={"OPENBLAS_NUM_THREADS": "3"})
    assert threads == "3"


@pytest.mark.parametrize("exit_code, args", [(0, ("--version",)), (1, ("verify", "missing.h5")),
                                             (2, ("diff", "only-one.h5"))])
def test_exit_freezes_the_leftovers_after_every_atexit_handler_and_keeps_the_exit_status(tmp_path, exit_code,
                                                                                         args):
    proc, (_, frozen) = probe(*args)
    assert proc.returncode == exit_code
    assert frozen == "True"  # reported by the last atexit handler: every handler still ran


@pytest.mark.parametrize("src_name, dst_name", [("m.msgpack", "c.h5"), ("m.msgpack", "c.safetensors"),
                                                ("m.h5", "c.msgpack")])
def test_convert_as_a_process_writes_the_library_calls_bytes(tmp_path, src_name, dst_name):
    src = save(str(tmp_path / src_name))
    proc, _ = probe("convert", src, str(tmp_path / dst_name))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("read back and checked\n")
    library = ckpt.convert(src, str(tmp_path / ("lib-" + dst_name))).path
    with open(tmp_path / dst_name, "rb") as a, open(library, "rb") as b:
        assert a.read() == b.read()


def test_a_damaged_source_still_fails_as_a_process_and_leaves_no_destination(tmp_path):
    src = save(str(tmp_path / "m.msgpack"))
    with ckpt.load_checkpoint(src) as reader:
        offset = reader._reader.data_extents("enc/w")[0][0]
    with open(src, "r+b") as f:
        f.seek(offset + 1000)
        byte = f.read(1)
        f.seek(offset + 1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    proc, _ = probe("convert", src, str(tmp_path / "c.h5"))
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"Error: {src}: ") and "'enc/w'" in proc.stderr
    assert not os.path.exists(tmp_path / "c.h5")


def test_a_conversion_process_loads_no_module_it_does_not_use(tmp_path):
    """msgpack -> h5 of numeric tensors: no h5py (ckpt lays out the HDF5 file itself), no shutil
    (with bz2 and lzma; only a failed sharded conversion removes a tree)."""
    src = save(str(tmp_path / "m.msgpack"))
    code = ("import sys\nfrom ckpt.cli.main import main\n"
            "try:\n    main(['convert', sys.argv[1], sys.argv[2]], standalone_mode=False)\n"
            "finally:\n    print(sorted(m for m in ('h5py', 'shutil', 'bz2', 'lzma') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code, src, str(tmp_path / "c.h5")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"
    with ckpt.load_checkpoint(str(tmp_path / "c.h5")) as reader:
        assert reader.verify() == [] and sorted(reader.tensors) == ["enc/b", "enc/w", "step"]
