"""The documentation cites only files the repository has."""

from __future__ import annotations

import glob
import os
import re
from conftest import TESTS

ROOT = os.path.join(TESTS, os.pardir)
DOCS = [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md")),
        *glob.glob(os.path.join(ROOT, "*", "README.md"))]


def test_every_markdown_file_a_doc_names_exists():
    missing = []
    for doc in DOCS:
        with open(doc, encoding="utf-8") as f:
            text = f.read()
        for name in set(re.findall(r"[\w./-]+\.md\b", text)):
            here = os.path.join(os.path.dirname(doc), name)
            if not os.path.exists(here) and not os.path.exists(os.path.join(ROOT, name)):
                missing.append(f"{os.path.relpath(doc, ROOT)} names {name}")
    assert not missing, missing


def python_blocks(doc: str) -> list[str]:
    """The ```python blocks of a markdown file under ROOT, in order."""
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_formats_md_plain_msgpack_recipe_runs(tmp_path):
    import crc32c
    import numpy as np

    import ckpt

    path = str(tmp_path / "plain.msgpack")
    big = np.arange(600_000, dtype=np.float32)  # a padding object before it; three checksum blocks
    ckpt.Saver({"a": ckpt.Variable([1, 2]), "big": ckpt.Variable(big)}).save(path)
    (recipe,) = [b for b in python_blocks("docs/formats.md") if "msgpack.Unpacker" in b]
    scope = {"path": path}
    exec(recipe, scope)
    assert scope["header"] == {"format": "ckpt-msgpack", "version": 3}
    raw, mib = big.tobytes(), 1 << 20  # the block checksums: crc32c of each MiB, little-endian uint32s
    assert scope["index"]["block_bytes"] == mib and scope["index"]["block_crcs"] == {
        "big": b"".join(crc32c.crc32c(raw[i:i + mib]).to_bytes(4, "little") for i in range(0, len(raw), mib))}
    assert scope["footer"][0] == b"ckpt-idx" and set(scope["index"]["tensors"]) == {"a", "big"}
    assert scope["payloads"][0] == np.array([1, 2], np.int32).tobytes()
    assert scope["payloads"][-1] == big.tobytes() and not any(scope["payloads"][1])  # padding


def test_formats_md_compressed_tensor_recipe_decodes(tmp_path):
    import msgpack
    import numpy as np

    import ckpt

    path = tmp_path / "z.msgpack"
    values = (np.random.default_rng(0).standard_normal(300_000) * 0.02).astype(np.float32)  # two chunks
    ckpt.save_file({"w": values}, path, compression="zstd")
    (recipe,) = [b for b in python_blocks("docs/formats.md") if "def tensor_bytes" in b]
    scope: dict = {}
    exec(recipe, scope)
    data = path.read_bytes()
    *_, index, _ = msgpack.unpackb(data, raw=False)
    assert index["version"] == 4 and "w" in index["compressed"]
    assert scope["tensor_bytes"](data, index, "w", 4) == values.tobytes()


def test_formats_md_incremental_recipe_runs():
    (recipe,) = [b for b in python_blocks("docs/formats.md") if 'index["chunk_dir"]' in b]
    scope: dict[str, object] = {}
    exec(recipe, scope)
    assert scope["header"] == {"format": "ckpt-incremental", "version": 3}
    assert len(scope["placed"]) == 1  # type: ignore[arg-type]  # the one chunk, in the save's pack
    assert scope["index"]["hash"] == "sha256" and scope["index"]["chunk_dir"] == ".ckpt-chunks"


def test_guides_md_blocks_run_in_order(tmp_path, monkeypatch):
    """docs/guides.md's Python blocks run one after another in an empty directory (their own asserts
    check what the prose says: resume, strict=False, the two key styles)."""
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    blocks = python_blocks("docs/guides.md")
    assert len(blocks) == 3
    for block in blocks:
        exec(compile(block, "docs/guides.md", "exec"), scope)
    assert scope["ckpt"].latest_step("resume_run") == 20
