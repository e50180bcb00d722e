"""The README is a short front page whose first commands are the ones users and CI run, and every relative
link in the README and docs/ leads to a file (and heading) that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
QUICKSTART = "bash scripts/setup.sh && .venv/bin/finetune quickstart"
TESTS = "bash scripts/setup.sh && .venv/bin/python -m pytest -q -n auto --dist loadfile tests"
MAX_WORDS = 950

# [text](target) and ![alt](target); the target ends at whitespace (an optional "title" follows) or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def doc_files() -> list[Path]:
    return [README, *sorted((REPO / "docs").rglob("*.md"))]


def prose_lines(path: Path, keep_code: bool = False) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans removed (kept with keep_code)."""
    out, fenced = [], False
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((no, line if keep_code else re.sub(r"`[^`]*`", "", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    # A heading's code span is part of its anchor on GitHub (its backticks are dropped as punctuation).
    return {slug(line.lstrip("#")) for _, line in prose_lines(path, keep_code=True) if re.match(r"#{1,6} ", line)}


def command_block() -> list[str]:
    """The README's first fenced block, which only the title may precede."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if FENCE.match(line))
    before = [line for line in lines[:start] if line.strip()]
    assert len(before) <= 1 and all(line.startswith("# ") for line in before), (
        f"README.md: only the title may come before the two commands, found {before}")
    end = next(i for i in range(start + 1, len(lines)) if FENCE.match(lines[i]))
    return lines[start + 1:end]


def test_readme_starts_with_the_two_commands():
    block = command_block()
    assert len(block) == 2, f"README.md: the first code block must hold exactly the two commands, found {block}"
    commands = [line.split("#", 1)[0].strip() for line in block]
    assert commands == [QUICKSTART, TESTS]


def test_readme_is_a_short_front_page():
    words = len(README.read_text(encoding="utf-8").split())  # what `wc -w` counts
    assert words < MAX_WORDS, f"README.md has {words} words; move detail into docs/ (limit {MAX_WORDS})"


def test_ci_runs_the_readmes_test_command():
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    assert TESTS in ci, f".ci/run must run the README's test command: {TESTS}"


def relative_links() -> list[tuple[Path, int, str]]:
    found = []
    for path in doc_files():
        for no, line in prose_lines(path):
            for target in LINK.findall(line):
                if not re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
                    found.append((path, no, target))
    return found


def test_links_are_found():
    # A broken LINK pattern would pass every check below by finding nothing.
    targets = {t for _, _, t in relative_links()}
    assert "docs/layout.md" in targets and "../bench/RESULTS.md" in targets


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path):
    broken = []
    for source, no, target in relative_links():
        if source != path:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (source.parent / file_part).resolve() if file_part else source
        where = f"{source.relative_to(REPO)}:{no}: ({target})"
        if not dest.exists():
            broken.append(f"{where} no such file")
        elif REPO not in dest.parents and dest != REPO:
            broken.append(f"{where} points outside the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{where} no heading '#{anchor}' in {dest.relative_to(REPO)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


# A placeholder left where a measurement or text was to go: a line that is one ALL_CAPS_NAME alone (MEASURED_TABLE),
# the usual markers, or a template's braces. Code blocks and `code spans` are not prose (environment variables).
PLACEHOLDER = re.compile(r"^\s*[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\s*$|\b(?:TODO|TBD|FIXME|XXX)\b|\{\{[^}]*\}\}")


def placeholders(path: Path) -> list[str]:
    return [f"{path.name}:{no}: {line.strip()}" for no, line in prose_lines(path)
            if PLACEHOLDER.search(line)]


def test_the_placeholder_pattern_finds_what_it_is_for(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("## Measured\n\nMEASURED_TABLE\n\nsteps: TBD\n\n```\nOMP_NUM_THREADS=1\n```\nset `HF_HUB_OFFLINE`\n")
    assert [x.split(": ", 1)[1] for x in placeholders(page)] == ["MEASURED_TABLE", "steps: TBD"]


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_placeholder_is_left(path):
    found = placeholders(path)
    assert not found, "placeholders left (fill them from a run):\n" + "\n".join(found)
