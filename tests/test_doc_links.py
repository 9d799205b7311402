"""The README and docs/ point only inside the repository: every relative link resolves to a file of the checkout
(and a `#anchor` to a heading of the page it names), and nothing sends a reader to ../shared or DESIGN.md, which
users do not have (the design lives in docs/design.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))   # code blocks hold commands, not links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]   # no http:, mailto:, ...


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {slug(m) for m in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


def test_the_pages_have_links_to_check() -> None:
    assert (REPO / "docs" / "design.md") in PAGES
    assert "docs/design.md" in links(REPO / "README.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves_inside_the_repository(page: Path) -> None:
    bad = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_relative_to(REPO):
            bad.append(f"{target}: outside the repository")
        elif not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert bad == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_page_points_at_the_shared_folder(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert "../shared" not in text and "DESIGN.md" not in text and "DESIGN allows" not in text


def test_the_package_does_not_point_at_the_shared_folder() -> None:
    hits = [str(p.relative_to(REPO)) for p in sorted((REPO / "npufuse").rglob("*"))
            if p.suffix in (".py", ".toml", ".tsv") and "../shared" in p.read_text(encoding="utf-8")]
    assert hits == []
