"""Every relative link in README.md, docs/*.md, tests/README.md and bench/README.md points at a file
that exists and, with a #fragment, at a heading of it (GitHub's anchors)."""

import re
from pathlib import Path

import pytest
from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "tests" / "README.md", REPO / "bench" / "README.md"]
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)")


def unfenced(text: str) -> str:
    """The text outside code fences."""
    return re.sub(r"^ *```.*?^ *```", "", text, flags=re.S | re.M)


def prose(text: str) -> str:
    """The text outside code fences and inline code, where links render."""
    return re.sub(r"`[^`\n]*`", "", unfenced(text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: the rendered text lowercased, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of a markdown file: its headings' slugs, repeats numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for line in unfenced(path.read_text()).splitlines():
        match = re.match(r"^#{1,6} (.*)$", line)
        if match:
            base = slug(match.group(1))
            n = seen.get(base, 0)
            out.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
    return out


def test_slugs_are_githubs():
    # by hand, from GitHub's rendering of these headings
    assert slug("Win rates (evaluate.py)") == "win-rates-evaluatepy"
    assert slug("LoRA (`model.lora`)") == "lora-modellora"
    assert slug("SFT, then DPO, cDPO, IPO and 20 other objectives") == "sft-then-dpo-cdpo-ipo-and-20-other-objectives"


@pytest.mark.parametrize("page", [p for p in PAGES if p.exists()], ids=lambda p: str(p.relative_to(REPO)))
def test_every_local_link_resolves(page):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{target} (no heading #{fragment} in {file.relative_to(REPO)})")
    assert not broken, f"{page.relative_to(REPO)}: {broken}"
