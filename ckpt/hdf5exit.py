"""Let a checkpoint written or read from an atexit handler exit cleanly, however late h5py loads.

h5py registers its exit hook (``_unregister_converters``) when it is imported. Imported inside an
atexit handler ("checkpoint on exit" in a process that never touched HDF5 before), it registers
that hook while the handlers run, and CPython never calls a handler added then: libhdf5's own exit
code later calls h5py's converters in a finalized interpreter (SIGSEGV, after the checkpoint was
committed). ``import ckpt`` registers :func:`unregister_late_converters` first, so it runs after
every handler the user registers later and does h5py's part if h5py is loaded by then.

Example:
    >>> import ckpt.hdf5exit  # done by ``import ckpt``; nothing to call
"""

from __future__ import annotations

import atexit
import sys

__all__ = ["unregister_late_converters"]


def unregister_late_converters() -> None:
    """Run h5py's exit hook if h5py is loaded (calling it again after h5py's own run is harmless:
    it unregisters what is no longer registered)."""
    h5py = sys.modules.get("h5py")
    unregister = getattr(h5py, "_unregister_converters", None)
    if unregister is not None:
        unregister()


atexit.register(unregister_late_converters)
