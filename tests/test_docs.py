"""The documentation cites only files the repository has."""

from __future__ import annotations

import glob
import os
import re

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
DOCS = [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md")),
        *glob.glob(os.path.join(ROOT, "*", "README.md"))]


def test_every_markdown_file_a_doc_names_exists():
    missing = []
    for doc in DOCS:
        text = open(doc, encoding="utf-8").read()
        for name in set(re.findall(r"[\w./-]+\.md\b", text)):
            here = os.path.join(os.path.dirname(doc), name)
            if not os.path.exists(here) and not os.path.exists(os.path.join(ROOT, name)):
                missing.append(f"{os.path.relpath(doc, ROOT)} names {name}")
    assert not missing, missing
