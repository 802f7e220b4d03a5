"""What `import ckpt` costs: its public names load on first use (ckpt/__init__.py)."""

from __future__ import annotations

import re
import subprocess
import sys

import ckpt
from conftest import OUTSIDE_CHECKOUT


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
    assert ckpt.Saver.__module__ == "ckpt.saver" and ckpt.dtypes.__name__ == "ckpt.dtypes"
