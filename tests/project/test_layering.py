"""The core's import structure: no import cycles dodged by function-local imports, and one place
that tells local paths from object-store URLs on the read side (docs/storage.md)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest
from conftest import OUTSIDE_CHECKOUT

import ckpt
import ckpt.cli
import ckpt.formats

CKPT = pathlib.Path(ckpt.__file__).parent
FORMATS = pathlib.Path(ckpt.formats.__file__).parent  # installed as ckpt.formats (formats/ in the checkout)


def _function_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    found.append((inner.lineno, ast.unparse(inner)))
    return found


#: Where the installed packages' sources are: ckpt/, and formats/ and cli/ installed inside it.
PACKAGES = {"ckpt": CKPT, "ckpt.formats": FORMATS, "ckpt.cli": pathlib.Path(ckpt.cli.__file__).parent}


def _installed_modules() -> dict[str, pathlib.Path]:
    """Every installed module's dotted name -> its source file."""
    modules = {}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if package == "ckpt" and parts[0] in ("formats", "cli"):
                continue  # a checkout that links formats/ and cli/ into ckpt/: counted under their own names
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            modules[".".join((package, *parts))] = path
    return modules


def _import_graph(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the installed modules it imports, imports inside functions included; ``from pkg
    import sub`` is an edge to the submodule pkg.sub, not to pkg/__init__."""
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        base = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                parts = base.split(".")
                target = ".".join(parts[:len(parts) - node.level + 1] + [node.module] if node.module else
                                  parts[:len(parts) - node.level + 1]) if node.level else node.module or ""
                subs = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in modules]
                found = subs if len(subs) == len(node.names) else [target, *subs]
            elif isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            else:
                continue
            edges[name].update(t for t in found if t in modules and t != name)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_among_installed_modules():
    """Layers point down (docs/architecture, DESIGN.md): no module imports, even inside a function,
    a module that imports it back, directly or through others."""
    modules = _installed_modules()
    assert "ckpt.saving.saver" in modules and "ckpt.formats.base" in modules and "ckpt.cli.errors" in modules
    assert _cycles(_import_graph(modules)) == []


#: The size a source file may grow to before it is split by job (issue 25: small modules a newcomer reads).
MAX_LINES = 600


def test_no_installed_source_file_is_over_600_lines():
    long = {name: n for name, path in _installed_modules().items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"split these by job: {long}"


def test_storage_sits_below_the_formats():
    """Formats read and write through storage's blobs; storage asks its Catalog about formats
    (ckpt.saving.stores hands it the registry) and imports no format module, even inside a function."""
    edges = _import_graph(_installed_modules())
    upward = sorted(f"{m} -> {t}" for m, targets in edges.items() if m.startswith("ckpt.storage")
                    for t in targets if t.startswith(("ckpt.formats", "ckpt.saving", "ckpt.tools")))
    assert upward == []


@pytest.mark.parametrize("name", sorted(_installed_modules()))  # every module: ckpt/, formats/, cli/
def test_function_local_imports_say_why(name):
    """A function-local import is there for start-up cost, an optional dependency or a format
    module that loads on use, and says so on its line or the line above; one that only dodges an
    import cycle, or is there out of habit, belongs at module level (issue 12, issue 25)."""
    path = _installed_modules()[name]
    lines = path.read_text(encoding="utf-8").splitlines()
    for lineno, text in _function_imports(path):
        context = lines[lineno - 2] + lines[lineno - 1]
        assert "#" in context and any(w in context for w in ("lazy", "only", "imported")), \
            f"{path}:{lineno}: {text} has no one-line reason"


@pytest.mark.parametrize("module", ["ckpt.storage.state", "ckpt.storage.local", "ckpt.saving.locations", "ckpt.saving.stores", "ckpt.storage.remote",
                                    "ckpt.formats.base", "ckpt.tools.listing", "ckpt.tools.conversion", "ckpt.saving.reader",
                                    "ckpt.formats.keras", "ckpt.formats.h5plain"])
def test_each_core_module_imports_first_in_a_fresh_interpreter(module):
    """A cycle shows as an ImportError when its modules load in the wrong order: load each first."""
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, timeout=60, cwd=OUTSIDE_CHECKOUT,
                   capture_output=True)


def test_state_py_knows_nothing_of_stores_or_urls():
    """The state file's module sits below the stores: it imports neither them nor the URL code."""
    source = (CKPT / "storage" / "state.py").read_text(encoding="utf-8")
    assert "storage.local" not in source and "is_url" not in source and "storage.remote" not in source


def test_formats_do_not_ask_whether_a_path_is_a_url():
    """Formats read through open_blob; only the blob factory (_blobs.open_blob, re-exported as
    base.open_blob) and the sharded format's two layouts (a directory, or a commit-record object)
    look at URLs."""
    formats_dir = FORMATS
    asking = sorted(p.name for p in formats_dir.glob("*.py") if "is_url(" in p.read_text(encoding="utf-8"))
    assert asking == ["_blobs.py", "ckpt_sharded.py"]
    assert (formats_dir / "_blobs.py").read_text(encoding="utf-8").count("is_url(") == 1


def _message_strings(path: pathlib.Path) -> list[str]:
    """The string literals of a module that are not docstrings (the parts of f-strings included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs]


def test_the_checksum_failure_is_worded_in_one_place():
    """Every checksum failure a user sees is worded by ckpt.errors.checksum_error/checksum_message
    (``_sstable``'s own errors are not CheckpointErrors: tensorflow.py wraps them, naming the file)."""
    roots = [CKPT, FORMATS, pathlib.Path(ckpt.cli.__file__).parent]
    phrases = ("fails its checksum", "fail their checksum", "fails its crc", "fails the zip", "fails its CRC")
    # a set: an installed ckpt/ holds formats/ and cli/ too (rglob of CKPT finds them again)
    writing = sorted({f"{p.parent.name}/{p.name}" for root in roots for p in root.rglob("*.py")
                      if any(phrase in text for text in _message_strings(p) for phrase in phrases)})
    assert writing == ["ckpt/errors.py", "formats/_sstable.py"]
