"""The README and docs/ against the tree: every relative link resolves (files, folders and #anchors), every page in
docs/ is listed on its index, and every `wb.<name>` the text uses exists in `workbench`.

Pure and fast: reads Markdown, imports workbench (no torch), starts nothing.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

import workbench

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
_WB_NAME = re.compile(r"(?<![\w.])wb\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")


def _prose(text: str) -> str:
    """The text a reader sees as Markdown: code blocks and code spans hold no links."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to
    hyphens. Code spans count by their text."""
    text = heading.replace("`", "").strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor `page` defines; a repeated heading gets -1, -2, ... as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", page.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def _links(page: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(page.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_the_slug_is_githubs():
    assert slug("Runs, reports and `%%ranks`") == "runs-reports-and-ranks"
    assert slug("The emulated cluster: a cluster on a laptop") == "the-emulated-cluster-a-cluster-on-a-laptop"
    assert slug("Telemetry, native") == "telemetry-native"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_docs_page_is_on_the_index():
    index = DOCS / "README.md"
    listed = {(DOCS / t.partition("#")[0]).resolve() for t in _links(index)}
    missing = [p.name for p in DOCS.glob("*.md") if p != index and p.resolve() not in listed]
    assert not missing, f"docs/README.md does not list {missing}: add a line for each page"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_wb_name_exists(page):
    unknown = []
    for chain in sorted(set(_WB_NAME.findall(page.read_text()))):
        obj = workbench
        for part in chain.split("."):
            if not hasattr(obj, part):
                unknown.append(f"wb.{chain} (no {part!r})")
                break
            obj = getattr(obj, part)
    assert not unknown, f"{page.relative_to(ROOT)} names what workbench does not have: {unknown}"
