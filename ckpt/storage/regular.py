"""Opening a local file for reading without ever blocking on something that is not a file.

A FIFO named like a checkpoint (or like the state file) would make ``open()`` wait for a writer
for ever; every local read of ckpt goes through :func:`open_regular`.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "f")
    >>> open(path, "wb").close()
    >>> with open_regular(path) as f:
    ...     f.read()
    b''
"""

from __future__ import annotations

import errno
import io
import os
import stat

from ckpt.errors import UnsupportedCheckpointError

__all__ = ["open_regular"]

#: What a path is when it is neither a regular file nor a directory (stat's file types).
_NOT_FILES = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
              (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def open_regular(path: str) -> io.FileIO:
    """Open a local file for unbuffered reads, refusing anything but a regular file.

    open() of a FIFO waits for a writer for ever (a device may too): the file is opened
    non-blocking and its descriptor checked with fstat, so what is checked is what is read.

    Raises:
        UnsupportedCheckpointError: a FIFO, socket or device, named with the path.
        IsADirectoryError: a directory (what open() raises for one).
        OSError: what os.open raises (FileNotFoundError, PermissionError, ...).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a socket (or a device without its driver) cannot be opened
            _refuse_special(path, os.stat(path).st_mode)
        raise
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        _refuse_special(path, mode)
        os.set_blocking(fd, True)
        f = open(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise
    f.name = path  # error messages and ResourceWarnings name the file, not the descriptor
    return f


def _refuse_special(path: str, mode: int) -> None:
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        what = next((name for test, name in _NOT_FILES if test(mode)), "not a regular file")
        raise UnsupportedCheckpointError(f"{path}: {what}, not a checkpoint file; ckpt reads regular files "
                                         "and directories")
