"""Opening HDF5 files ckpt did not write: libhdf5 first reads them in a child process.

libhdf5 is not safe on damaged input (a flipped bit can make it crash or hang), and a file ckpt
did not write carries nothing ckpt could verify first. So before the reader opens such a file in
the user's process, a child Python process opens it with h5py, walks every group, dataset and
attribute, and reads every dataset (datasets larger than ``READ_LIMIT`` bytes: their first and
last elements, which makes libhdf5 load their chunk index). If libhdf5 kills the child (a
signal) or the child does not finish within ``timeout``, the file is refused with a
CorruptCheckpointError and never opened in the user's process. A child that raises an ordinary
Python exception is not a crash: the in-process reader then reports that error precisely.

A file is probed once per process while it stays the same (device, inode, size, mtime). Set
``ENABLED = False`` (or the environment variable ``CKPT_HDF5_CHILD=0``) to open files directly.

Example:
    >>> import h5py, numpy as np, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "k.h5")
    >>> with h5py.File(path, "w") as f:
    ...     f["w"] = np.ones(3)
    >>> probe(path)  # returns quietly: libhdf5 read the whole file in a child
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from ckpt.errors import CorruptCheckpointError

#: Whether foreign HDF5 files are probed in a child process before being opened.
ENABLED = os.environ.get("CKPT_HDF5_CHILD", "1") != "0"
#: Datasets up to this size are read whole by the child; larger ones at their first and last element.
READ_LIMIT = 64 << 20
#: Seconds the child may take: this, plus one per 100 MB of file.
TIMEOUT = 30.0

_CHILD = r"""
import sys
import h5py
limit = int(sys.argv[2])
def walk(group):
    for name in group:
        link = group.get(name, getlink=True)
        if not isinstance(link, h5py.HardLink):
            continue
        obj = group[name]
        for key in obj.attrs:
            obj.attrs[key]
        if isinstance(obj, h5py.Group):
            walk(obj)
        elif isinstance(obj, h5py.Dataset) and obj.shape is not None and obj.size:
            if obj.id.get_storage_size() <= limit:
                obj[()]
            else:
                obj[(0,) * len(obj.shape)]
                obj[tuple(d - 1 for d in obj.shape)]
with h5py.File(sys.argv[1], "r") as f:
    for key in f.attrs:
        f.attrs[key]
    walk(f)
"""
_probed: set[tuple[int, int, int, int]] = set()
_lock = threading.Lock()


def probe(path: str) -> None:
    """Read ``path`` with libhdf5 in a child process; raise CorruptCheckpointError if it crashes or hangs."""
    if not ENABLED or not sys.executable:
        return
    try:
        st = os.stat(path)
    except OSError:
        return  # the reader's own open reports it
    identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _lock:
        if identity in _probed:
            return
    timeout = TIMEOUT + st.st_size / 100e6
    try:
        done = subprocess.run([sys.executable, "-I", "-c", _CHILD, path, str(READ_LIMIT)], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CorruptCheckpointError(
            f"{path}: libhdf5 did not finish reading this file within {timeout:.0f} s in a child process (it hangs "
            "on some damaged files); the file was not opened") from None
    except OSError:
        return  # no child process possible here (e.g. no fork/exec): open the file directly
    if done.returncode < 0:
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = f"signal {-done.returncode}"
        raise CorruptCheckpointError(
            f"{path}: libhdf5 crashed ({name}) reading this file in a child process; the file is damaged and was "
            "not opened")
    if done.returncode == 0:
        with _lock:
            _probed.add(identity)
