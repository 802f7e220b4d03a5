"""The command line is a thin shell over ckpt's public API: cli/ imports no internal ckpt module."""

from __future__ import annotations

import ast
import os
import pathlib

import ckpt
from conftest import TESTS

CLI = os.path.join(TESTS, os.pardir, "cli")
INIT = os.path.join(TESTS, os.pardir, "ckpt", "__init__.py")


def public_names() -> set[str]:
    """The names ckpt/__init__.py re-exports (``from .x import Name as Name``), and its version."""
    tree = ast.parse(pathlib.Path(INIT).read_text(encoding="utf-8"))
    names = {"__version__"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names.update(alias.asname for alias in node.names if alias.asname == alias.name)
    return names


def internal_uses(source: str, public: set[str]) -> list[str]:
    """What a module's source takes from ckpt other than its public names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("ckpt.")
                      and not alias.name.startswith("ckpt.cli")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            if node.module == "ckpt":
                found += [f"ckpt.{alias.name}" for alias in node.names if alias.name not in public]
            elif node.module.startswith("ckpt.") and not node.module.startswith("ckpt.cli"):
                found.append(node.module)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ckpt":
            if node.attr not in public:
                found.append(f"ckpt.{node.attr}")
    return found


def test_the_public_names_are_what_ckpt_exports():
    public = public_names()
    assert {"convert", "compare", "list_checkpoints", "tensor_stats", "verify", "CheckpointError"} <= public
    assert public - {"__version__"} <= set(dir(ckpt))


def test_the_check_finds_internal_imports():
    public = public_names()
    source = ("import ckpt\nimport ckpt.storage.atomic\nfrom ckpt.storage.state import STATE_FILE\nfrom ckpt import storage, convert\n"
              "from ckpt.formats import base\nfrom .errors import Failure\nx = ckpt.tools.inspect.jsonable\ny = ckpt.compare\n")
    assert internal_uses(source, public) == ["ckpt.storage.atomic", "ckpt.storage.state", "ckpt.storage", "ckpt.formats",
                                             "ckpt.tools"]


def test_cli_modules_use_only_public_ckpt_names():
    public = public_names()
    modules = sorted(name for name in os.listdir(CLI) if name.endswith(".py"))
    assert "convert_cmd.py" in modules and "main.py" in modules
    for name in modules:
        assert internal_uses(pathlib.Path(CLI, name).read_text(encoding="utf-8"), public) == [], name
