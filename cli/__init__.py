"""The ``ckpt`` command line, installed as ``ckpt.cli``."""

from .main import main as main
