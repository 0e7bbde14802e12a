"""The extras tables (README, docs/getting-started.md, docs/hf.md) agree with
pyproject.toml and with each other: every extra has a row in the first two, each row
names the extra's packages, and a row reads the same wherever it appears."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.pyproject_toml import project

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = project()["optional-dependencies"]
HEADER = "| extra | brings | for |"
COMPLETE = ("README.md", "docs/getting-started.md")
PAGES = (*COMPLETE, "docs/hf.md")


def rows(page: str) -> dict[str, str]:
    """extra -> its row, links made relative to docs/ (README links docs/x.md)."""
    text = (ROOT / page).read_text(encoding="utf-8")
    assert HEADER in text, f"{page} has no extras table"
    body = text[text.index(HEADER):].split("\n\n", 1)[0].splitlines()[2:]
    out = {}
    for line in body:
        name = re.match(r"\|\s*`([\w-]+)`\s*\|", line)
        assert name, f"{page}: a row that names no extra: {line}"
        out[name.group(1)] = line.replace("](docs/", "](")
    return out


@pytest.mark.parametrize("page", COMPLETE)
def test_every_extra_has_a_row_and_no_row_names_an_unknown_one(page):
    assert set(rows(page)) == set(EXTRAS), page


@pytest.mark.parametrize("page", PAGES)
def test_each_row_names_its_extras_first_package(page):
    for extra, line in rows(page).items():
        assert extra in EXTRAS, f"{page}: `{extra}` is not an extra of pyproject.toml"
        first = re.split(r"[<>=\[ ]", EXTRAS[extra][0])[0].lower()
        brings = line.split("|")[2].lower()
        assert first.split("-")[0] in brings, f"{page}: `{extra}` brings {EXTRAS[extra]}"


def test_a_row_reads_the_same_on_every_page():
    canonical = rows(PAGES[0])
    for page in PAGES[1:]:
        for extra, line in rows(page).items():
            assert line == canonical[extra], f"{page}: `{extra}` differs from README's"


def test_every_install_line_in_the_docs_names_a_real_extra():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    named = {(p.name, m) for p in pages
             for group in re.findall(r"(?:sailfin|\.)\[([\w,-]+)\]", p.read_text("utf-8"))
             for m in group.split(",")}
    unknown = sorted((page, m) for page, m in named if m not in EXTRAS)
    assert not unknown, unknown
