"""Every example in a docstring of ckpt, ckpt.formats and ckpt.cli runs and shows what it says."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest


def _modules() -> list[str]:
    names = []
    for package in ("ckpt", "ckpt.formats", "ckpt.cli"):  # installs nest formats/ and cli/ in ckpt
        module = importlib.import_module(package)
        names += [package] + [info.name for info in pkgutil.walk_packages(module.__path__, package + ".")]
    return sorted(set(names))


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
