"""What `import ckpt` costs: its public names load on first use (ckpt/__init__.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import ckpt
from conftest import OUTSIDE_CHECKOUT, TESTS


def test_import_ckpt_loads_no_numpy_and_no_format():
    code = ("import sys, ckpt\nheavy = ('numpy', 'h5py', 'msgpack', 'ml_dtypes', 'crc32c', 'ckpt.formats')\n"
            "print(sorted(m for m in sys.modules if m.startswith(heavy)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         cwd=OUTSIDE_CHECKOUT)
    assert out.stdout.strip() == "[]"


def test_every_public_name_resolves_and_is_declared_for_type_checkers():
    with open(ckpt.__file__, encoding="utf-8") as f:
        source = f.read()
    declared = set(re.findall(r"^    from \.[\w.]* import \w+ as (\w+)$", source, flags=re.MULTILINE))
    assert declared == set(ckpt._LAZY)
    for name in ckpt._LAZY:
        assert getattr(ckpt, name) is not None and name in dir(ckpt)
    assert ckpt.Saver.__module__ == "ckpt.saving.saver" and ckpt.dtypes.__name__ == "ckpt.dtypes"


def test_reading_a_ckpt_file_imports_only_its_format(tmp_path):
    """The registry's formats are lazy: recognising a ckpt HDF5 file imports the HDF5 format
    and nothing of the foreign formats (nor the child-process probe's subprocess); crc32c loads without its
    package's importlib.metadata."""
    path = tmp_path / "m.h5"
    ckpt.Saver({"w": ckpt.Variable([0.0, 1.0, 2.0], dtype="float64")}).save(str(path))
    code = ("import sys, ckpt\n"
            f"with ckpt.load_checkpoint({str(path)!r}) as r:\n"
            "    assert r.get_tensor('w').tolist() == [0.0, 1.0, 2.0]\n"
            "print(sorted(m for m in sys.modules if m.startswith(('ckpt.formats.', 'importlib.metadata', 'h5py'))"
            " or m in ('crc32c', 'subprocess')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         cwd=OUTSIDE_CHECKOUT)
    loaded = set(eval(out.stdout))  # a list of module names
    assert "ckpt.formats.hdf5" in loaded
    foreign = {f"ckpt.formats.{m}" for m in ("torch", "tensorflow", "keras", "flax", "orbax", "safetensors",
                                             "sharded", "ckpt_sharded", "msgpack")}
    assert not loaded & (foreign | {"importlib.metadata", "crc32c", "h5py", "subprocess"}), loaded


def test_built_in_formats_are_format_classes_whose_modules_load_on_first_use():
    """The registry holds the built-ins' Format classes (formats/builtin.py), registered like a plugin's;
    registering them imports none of the format modules (hdf5, msgpack, keras, ...)."""
    code = ("import sys\nfrom ckpt.formats import base\n"
            "print(sorted(f.name for f in base.formats() if type(f).__module__ == 'ckpt.formats.builtin'))\n"
            "print(sorted(m for m in sys.modules if m.startswith('ckpt.formats.') and '._' not in m))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         cwd=OUTSIDE_CHECKOUT)
    names, loaded = map(eval, out.stdout.splitlines())  # two lists of names
    assert names == sorted(["hdf5", "msgpack", "ckpt-sharded", "ckpt-incremental", "safetensors", "pytorch", "flax", "tensorflow",
                            "sharded", "orbax", "keras"])
    assert loaded == ["ckpt.formats.base", "ckpt.formats.builtin"]


def test_a_saver_loads_h5py_only_when_it_writes_hdf5():
    """Creating a Saver loads no format library (an atexit save that loads h5py late still exits
    cleanly: ckpt/hdf5exit.py, tests/unit/saving/test_async_save.py)."""
    code = ("import sys, ckpt\n"
            "ckpt.Saver({'v': ckpt.Variable(1.0)}, format='msgpack')\n"
            "ckpt.Saver({'v': ckpt.Variable(1.0)})\n"
            "print('h5py' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         cwd=OUTSIDE_CHECKOUT)
    assert out.stdout.split() == ["False"]


def test_python_started_in_the_clone_root_finds_formats_and_cli_beside_the_source_ckpt():
    """Started in a clone's root, `import ckpt` imports the source ckpt/ (the root is first on sys.path);
    ckpt.formats and ckpt.cli are then formats/ and cli/ beside it (ckpt/_sourcetree.py)."""
    root = os.path.abspath(os.path.join(TESTS, os.pardir))
    # an editable install's finder maps the same folders: drop it, as after the README's `pip install .`
    code = ("import sys\n"
            "sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, '__module__', '').startswith('__editable')]\n"
            "import ckpt, ckpt.cli.main, ckpt.formats.hdf5\n"
            "assert ckpt.Saver.__module__ == 'ckpt.saving.saver'\n"
            "print(ckpt.__file__, ckpt.formats.__file__, ckpt.cli.__file__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [os.path.join(root, *p) for p in
                                  (("ckpt", "__init__.py"), ("formats", "__init__.py"), ("cli", "__init__.py"))]


def test_import_ckpt_loads_no_import_machinery_it_does_not_need():
    """`import ckpt` checks whether it is a source tree without importlib.abc, which would load
    importlib.resources, tempfile, shutil, bz2, lzma and random: ~10 ms of every command's start."""
    root = os.path.abspath(os.path.join(TESTS, os.pardir))
    code = ("import sys, ckpt\n"
            "print(sorted(m for m in sys.modules if m.startswith(('importlib.abc', 'importlib.resources', "
            "'tempfile', 'shutil'))))\n"
            "import importlib.util\n"  # the source tree's finder still finds formats/ beside ckpt/
            "print(importlib.util.find_spec('ckpt.formats').origin)\n")
    # -S: no site-packages (no editable finder, whose own imports would hide ours); cwd: ckpt is the source
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60, cwd=root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", os.path.join(root, "formats", "__init__.py")]


def test_an_installed_ckpt_or_a_stray_folder_is_not_a_source_tree(tmp_path):
    from ckpt._sourcetree import source_root

    for folder in ("ckpt/formats", "formats", "cli"):  # an installed ckpt/ holds formats/ itself
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "__init__.py").touch()
    assert source_root(str(tmp_path / "ckpt")) is None
    (tmp_path / "ckpt" / "formats" / "__init__.py").unlink()
    (tmp_path / "ckpt" / "formats").rmdir()
    assert source_root(str(tmp_path / "ckpt")) is None  # no pyproject.toml: not a project's root
    (tmp_path / "pyproject.toml").touch()
    assert source_root(str(tmp_path / "ckpt")) == str(tmp_path)


def test_plain_inspect_does_not_load_the_statistics(tmp_path):
    """`ckpt inspect` of a small file starts as fast as it can: the statistics (and their
    histogram and chunk pool) load only for --stats."""
    path = tmp_path / "m.h5"
    ckpt.Saver({"w": ckpt.Variable([0.0, 1.0, 2.0], dtype="float64")}).save(str(path))
    code = ("import sys\nfrom ckpt.cli import main\n"
            "try:\n"
            f"    main([sys.argv[1], {str(path)!r}])\n"
            "except SystemExit as exc:\n"
            "    assert not exc.code, exc.code\n"
            "print(sorted(m for m in sys.modules if m.startswith(('ckpt.tools.stats', 'ckpt.tools.histogram', "
            "'ckpt.tools.chunks'))))\n")
    for args, expected in ((["inspect"], "[]"), (["inspect", "--stats"], None)):
        out = subprocess.run([sys.executable, "-c", code.replace("sys.argv[1], ", ", ".join(map(repr, args)) + ", ")],
                             capture_output=True, text=True, timeout=60, check=True, cwd=OUTSIDE_CHECKOUT)
        loaded = out.stdout.strip().splitlines()[-1]
        if expected is None:
            assert "ckpt.tools.stats" in loaded, out.stdout
        else:
            assert loaded == expected, out.stdout
