"""Sharded checkpoints written by many processes at once and restored on any number of them.

``distributed.mpi()`` wraps mpi4py (``pip install 'ckpt-numpy[mpi]'``); ``distributed.local()`` is
one process; ``distributed.threads(n)`` simulates n ranks in threads (tests, benchmarks). A
Saver given ``comm=`` saves and restores collectively; see docs/distributed.md.

Example:
    >>> import numpy as np, ckpt, tempfile, os
    >>> from ckpt import distributed
    >>> comm = distributed.local()
    >>> emb = ckpt.Variable(np.ones((4, 2), np.float32), name="emb",
    ...                     shard=ckpt.Shard(global_shape=(4, 2), offset=(0, 0)))
    >>> saver = ckpt.Saver([emb], comm=comm)
    >>> path = saver.save(os.path.join(tempfile.mkdtemp(), "model.msgpack"), global_step=1)
    >>> with ckpt.load_checkpoint(path) as reader:
    ...     reader.get_slice("emb", np.s_[1:3, :]).tolist()
    [[1.0, 1.0], [1.0, 1.0]]
"""

from __future__ import annotations

from .comm import CollectiveTimeoutError as CollectiveTimeoutError
from .comm import Communicator as Communicator
from .comm import LocalCommunicator as LocalCommunicator
from .comm import OutcomeUnknownError as OutcomeUnknownError
from .comm import local as local
from .mpi import MPICommunicator as MPICommunicator
from .mpi import mpi as mpi
from .threads import ThreadCommunicator as ThreadCommunicator
from .threads import threads as threads

__all__ = ["Communicator", "CollectiveTimeoutError", "LocalCommunicator", "MPICommunicator", "OutcomeUnknownError",
           "ThreadCommunicator", "local", "mpi", "threads"]
