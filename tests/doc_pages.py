"""The project's documentation as the tests read it: README.md (the landing page) and the site's pages under docs/
in mkdocs.yml's order, so a recipe's commands keep their order across the pages a user follows."""

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def nav_pages() -> list[Path]:
    """docs/ pages in the site's navigation order."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    return [ROOT / "docs" / next(iter(entry.values())) for entry in nav]


def page(name: str) -> str:
    """One page's text: `README.md`, or a docs/ page by file name (`tools.md`)."""
    return (ROOT / ("README.md" if name == "README.md" else f"docs/{name}")).read_text()


PAGES = [ROOT / "README.md", *nav_pages()]
DOCS = "\n".join(p.read_text() for p in PAGES)  # every page a user reads, README first
