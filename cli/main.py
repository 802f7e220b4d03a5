"""The ``ckpt`` command: a thin click shell over ckpt's public Python API."""

from __future__ import annotations

import click

import ckpt


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(ckpt.__version__, prog_name="ckpt")
def main() -> None:
    """Look inside, compare, convert and verify checkpoints."""
