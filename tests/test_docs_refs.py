"""Cross-references in the docs and docstrings resolve.

- every citation of `method.md` with a section ("method.md section 2", "method.md §6", "(method.md 2, 7)", also
  wrapped over two lines) names a section that docs/method.md has (`## N. Title`);
- every relative markdown link in README.md and docs/*.md points to a file or folder that exists.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHOD = ROOT / "docs" / "method.md"
# Where citations live: the package, the docs, the README, benchmarks, presets and tests (this file's own
# examples are not citations).
CITING = ("src", "docs", "bench", "configs", "tests")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt"}

SECTION_HEADING = re.compile(r"^## (\d+)\. \S", re.MULTILINE)
# Between "method.md" and the section: spaces, a line break with the next line's comment marker or
# indentation. The section is "section N", "sections N and M", "§N" or a bare "N", optionally a list.
_GAP = r"[ \t]*(?:\n[ \t]*(?:#[ \t]*)?)?"
_ONE = r"(?:§[ \t]*)?\d+"
CITATION = re.compile(
    r"method\.md" + _GAP + r"(?:sections?[ \t]+|(?=§)|(?=\d))"
    r"(?P<list>" + _ONE + r"(?:[ \t]*(?:,|and|&)" + _GAP + _ONE + r")*)(?![\d.])"
)
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`+[^`\n]*`+")


def method_sections(text: str) -> set[int]:
    """The section numbers of method.md's `## N. Title` headings."""
    return {int(n) for n in SECTION_HEADING.findall(text)}


def citations(text: str) -> list[tuple[int, int]]:
    """(line, section) for every section of method.md the text cites."""
    out = []
    for m in CITATION.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        out.extend((line, int(n)) for n in re.findall(r"\d+", m.group("list")))
    return out


def citing_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for top in CITING:
        files += [p for p in sorted((ROOT / top).rglob("*")) if p.suffix in SUFFIXES and p.is_file()]
    return [p for p in files if p.resolve() != Path(__file__).resolve() and "__pycache__" not in p.parts]


def all_citations() -> list[tuple[str, int, int]]:
    """(file, line, section) for every citation in the repository's sources and docs."""
    out = []
    for path in citing_files():
        rel = path.relative_to(ROOT).as_posix()
        out += [(rel, line, n) for line, n in citations(path.read_text(encoding="utf-8", errors="replace"))]
    return out


def dangling(cited: list[tuple[str, int, int]], sections: set[int]) -> list[str]:
    return [f"{f}:{line}: method.md section {n}" for f, line, n in cited if n not in sections]


def local_links(text: str) -> list[tuple[int, str]]:
    """(line, target) of every relative link outside code, without its #anchor."""
    blanked = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    blanked = INLINE_CODE.sub(lambda m: "x" * len(m.group(0)), blanked)
    out = []
    for m in LINK.finditer(blanked):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue  # a URL (http:, mailto:) or an anchor on the same page
        out.append((blanked.count("\n", 0, m.start()) + 1, target.split("#", 1)[0].split("?", 1)[0]))
    return out


def test_citation_forms_are_parsed() -> None:
    text = (
        '"""X (method.md section 3).\n'
        "Y (method.md §5), Z (method.md 2, 7), sections (method.md sections 4 and 6).\n"
        "# wrapped method.md\n"
        "#   §1: across a comment line\n"
        "docs/method.md without a section, method.md.\n"
    )
    assert citations(text) == [(1, 3), (2, 5), (2, 2), (2, 7), (2, 4), (2, 6), (3, 1)]


def test_method_md_has_numbered_sections() -> None:
    sections = method_sections(METHOD.read_text(encoding="utf-8"))
    assert sections == set(range(1, max(sections) + 1)), f"docs/method.md sections {sorted(sections)}: a gap"


def test_every_method_md_citation_names_an_existing_section() -> None:
    cited = all_citations()
    # The parser must find the citations the sources are known to hold, not silently nothing.
    assert {f for f, _, _ in cited} >= {
        "src/mappa/training/rl.py",
        "src/mappa/training/rewards.py",
        "docs/workflows.md",
    }
    assert dangling(cited, method_sections(METHOD.read_text(encoding="utf-8"))) == []


def test_removing_a_cited_section_is_caught() -> None:
    text = METHOD.read_text(encoding="utf-8")
    without_3 = re.sub(r"^## 3\. .*?(?=^## 4\. )", "", text, flags=re.MULTILINE | re.DOTALL)
    assert 3 not in method_sections(without_3)
    missing = dangling(all_citations(), method_sections(without_3))
    assert any(m.startswith("src/mappa/coach/__init__.py:1:") for m in missing), missing


def test_relative_markdown_links_resolve() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for line, target in local_links(page.read_text(encoding="utf-8")):
            if target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT).as_posix()}:{line}: {target}")
    assert broken == []


def test_link_parser_skips_code_and_urls() -> None:
    text = "[a](x.md#s) [b](https://e.org) [c](#top)\n```\n[d](gone.md)\n```\n`[e](gone.md)` ![f](img.png)\n"
    assert local_links(text) == [(1, "x.md"), (5, "img.png")]
