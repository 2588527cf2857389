"""The documentation's links lead somewhere: every relative link in README.md, docs/ and results/
names a file or folder of the repository (a moved or renamed doc breaks this test, not a reader)."""

import glob
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_relative_links_in_the_docs_exist():
    pages = [os.path.join(REPO, "README.md"), *glob.glob(os.path.join(REPO, "docs", "*.md")),
             *glob.glob(os.path.join(REPO, "results", "*.md"))]
    broken, checked = [], 0
    for page in pages:
        text = open(page, encoding="utf-8").read()
        for target in LINK.findall(text):
            if target.startswith(("http://", "https://", "#", "mailto:")):
                continue
            path = os.path.normpath(os.path.join(os.path.dirname(page), target.split("#")[0]))
            checked += 1
            if not os.path.exists(path):
                broken.append(f"{os.path.relpath(page, REPO)} -> {target}")
    assert checked > 10 and not broken, broken
