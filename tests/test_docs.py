"""The documentation site: MkDocs builds it with every warning an error (broken links, pages outside the navigation,
API docstrings that do not render), every page is in the navigation, and README.md stays a landing page whose links
reach the pages. The commands of every page are walked by test_readme.py and test_readme_tools.py."""

import re
import subprocess
import sys

import pytest

from tests.doc_pages import ROOT, nav_pages, page


def test_every_docs_page_is_in_the_site_navigation():
    assert sorted(nav_pages()) == sorted((ROOT / "docs").glob("*.md"))


def test_readme_is_a_landing_page_whose_links_reach_the_pages():
    readme = page("README.md")
    assert len(readme.splitlines()) < 120, "README.md is the landing page: a topic goes to a page under docs/"
    assert "./setup.sh && .venv/bin/grpo demo" in readme
    assert "./setup.sh && .venv/bin/python -m pytest -q -n 2 --dist loadfile" in readme
    links = re.findall(r"\]\((docs/[^)#]*)", readme)
    pages = {p for p in nav_pages() if p.name != "index.md"}  # the site's home page is the README's twin
    assert {ROOT / link for link in links if link.endswith(".md")} == pages  # one link a page
    assert all((ROOT / link).exists() for link in links), links


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    """mkdocs build --strict, the API page included (mkdocstrings reads the docstrings without importing)."""
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    api = (tmp_path / "site/api/index.html").read_text()
    assert "grpo_microbatch_step" in api and "def train" not in api  # rendered from docstrings, not dumped source
