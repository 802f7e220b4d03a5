"""The ``ckpt`` command: a thin click shell over ckpt's public Python API.

Every failure is one "Error: ..." line on stderr (plus an indented "closest keys:" line for
a key that was not found), never a traceback: exit 1 for a checkpoint problem, 2 for a
usage error, 130 for Ctrl-C; a closed output pipe ends the command quietly with 0.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import importlib

import click

import ckpt

from .errors import error_json, error_lines

#: name -> (module defining the command, its one-line help). A command's module (numpy, the
#: formats) is imported only when that command runs: `ckpt --help` and `--version` import neither.
#: tests/unit/cli/test_cli.py checks the help lines against the commands' own.
COMMANDS = {
    "average": ("average_cmd", "Average checkpoints into one: the weighted mean of their float tensors."),
    "convert": ("convert_cmd", "Convert a checkpoint between formats; extract or rename keys."),
    "diff": ("diff_cmd", "Compare two checkpoints: keys, dtypes, shapes, values and metadata."),
    "inspect": ("inspect_cmd", "Show a checkpoint's tensors, values or statistics."),
    "ls": ("ls_cmd", "List a directory's checkpoints."),
    "verify": ("verify_cmd", "Check a checkpoint's structure and every checksum."),
}

#: The exit status of a command stopped by Ctrl-C (128 + SIGINT, as shells report it).
INTERRUPTED = 130

# click >= 8.2 raises this for a bare "ckpt" (older versions print the help and exit 0)
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


def _no_blas_threads() -> None:
    """Ask OpenBLAS for no threads of its own where numpy is not imported yet and the user did not
    choose: no command wants them (the statistics and diff keep their dot products on the calling
    thread), and numpy's import starts one per core that spins for a while (~30 ms of CPU a command,
    more on a free core), competing with the command's own threads."""
    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


class _Shell(click.Group):
    """A click group whose errors, usage errors included, are single "Error:" lines, and whose
    commands load when they are run."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(COMMANDS) | set(self.commands))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            module = importlib.import_module(f".{COMMANDS[cmd_name][0]}", __package__)
            self.add_command(getattr(module, cmd_name))
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][1] if name in COMMANDS and name not in self.commands
                 else self.commands[name].get_short_help_str(formatter.width))
                for name in self.list_commands(ctx)
                if name in COMMANDS or not self.commands[name].hidden]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            result = super().invoke(ctx)
            sys.stdout.flush()  # here, not at exit: a reader gone ("ckpt ... | head") is no failure
            return result
        except BrokenPipeError:
            _silence_stdout()
            raise click.exceptions.Exit(0) from None

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        _no_blas_threads()
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except _NO_ARGS_IS_HELP as exc:  # bare "ckpt": help, as click shows it
            exc.show()
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            message = exc.format_message()
            ctx = getattr(exc, "ctx", None)
            if isinstance(exc, click.UsageError) and ctx is not None:
                message += f" (see '{ctx.command_path} --help')"
            arguments = sys.argv[1:] if args is None else list(args)
            options = arguments[:arguments.index("--")] if "--" in arguments else arguments
            if "--json" in options:
                click.echo(error_json(message, exc), err=True)  # JSON consumers get JSON errors too
            else:
                for line in error_lines(message):
                    click.echo(line, err=True)
            sys.exit(exc.exit_code)
        except click.Abort as exc:
            click.echo("Aborted!", err=True)
            sys.exit(INTERRUPTED if isinstance(exc.__cause__, KeyboardInterrupt) else 1)
        except KeyboardInterrupt:  # outside the command (click hands on the late ones)
            click.echo("Aborted!", err=True)
            sys.exit(INTERRUPTED)
        sys.exit(code if isinstance(code, int) else 0)


def _silence_stdout() -> None:
    """Point stdout at /dev/null: the reader is gone, and Python's own flush at exit must not
    report the broken pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass  # no real stdout (an embedding, a test runner): nothing will flush to the pipe
    finally:
        os.close(devnull)


@click.group(cls=_Shell, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(ckpt.__version__, prog_name="ckpt")
def main() -> None:
    """Look inside, compare, convert and verify checkpoints.

    PATH is a checkpoint file (HDF5 or msgpack, or any registered format) or a directory,
    meaning its latest checkpoint. Exit status: 0 success (also when the output's reader
    stops early, "ckpt ... | head"), 1 a checkpoint problem (missing, unreadable, corrupted,
    key not found), 2 a usage error, 130 stopped by Ctrl-C; ckpt diff: 0 same, 1 different,
    2 trouble.
    """
