"""ckpt.formats and ckpt.cli when ckpt is imported from a clone's root.

Python started in the root of a clone puts the root first on sys.path, so `import ckpt` finds
the source folder ckpt/ instead of the installed package. There formats/ and cli/ (installed
as ckpt.formats and ckpt.cli) sit beside ckpt/, not in it. ckpt/__init__.py calls
`install_if_source_tree`, which adds a finder for exactly those two packages — and only when
ckpt/ has no formats/ of its own and its parent is this project's source tree, so an installed
package is left alone. Their submodules are then found through their own `__path__`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importlib.abc would load importlib.resources, tempfile, shutil, ...: ~10 ms of every start
    from importlib.machinery import ModuleSpec
    from types import ModuleType

#: package name -> the folder beside ckpt/ that holds it in the source tree (pyproject.toml's package-dir)
SIBLINGS = {"ckpt.formats": "formats", "ckpt.cli": "cli"}


class SourceTreeFinder:
    """Finds ckpt.formats and ckpt.cli in the folders beside a source ckpt/ (a meta path finder:
    ``find_spec`` is the whole protocol, so no importlib.abc base class)."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        folder = SIBLINGS.get(fullname)
        if folder is None:
            return None
        from importlib.util import spec_from_file_location  # lazy: only a source tree gets here

        where = os.path.join(self.root, folder)
        return spec_from_file_location(fullname, os.path.join(where, "__init__.py"),
                                       submodule_search_locations=[where])


def source_root(package_dir: str) -> str | None:
    """The source tree holding `package_dir` (a ckpt/ folder), or None for an installed package."""
    if os.path.isdir(os.path.join(package_dir, "formats")):  # installed: the packages are inside
        return None
    root = os.path.dirname(package_dir)
    needed = [os.path.join(root, "pyproject.toml")]
    needed += [os.path.join(root, folder, "__init__.py") for folder in SIBLINGS.values()]
    return root if all(os.path.isfile(p) for p in needed) else None


def install_if_source_tree(package_dir: str) -> None:
    """Append a SourceTreeFinder to sys.meta_path when `package_dir` is a source ckpt/ (once).

    Appended, not prepended: an editable install's finder, which maps the same folders, answers first.
    """
    root = source_root(package_dir)
    if root is None or any(isinstance(f, SourceTreeFinder) and f.root == root for f in sys.meta_path):
        return
    sys.meta_path.append(SourceTreeFinder(root))
