"""Every relative link in README.md and docs/ (history included) resolves: to a file that
exists, and where it names a #heading of a markdown file, to one of that file's headings (as
GitHub makes their anchors). The docs were moved around (docs/history/); this keeps them whole."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[3]
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.M)
FENCE = re.compile(r"^\s*```.*?^\s*```[^\n]*$", re.S | re.M)


def _slug(heading: str) -> str:
    t = re.sub(r"<[^>]+>", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", t).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        m = None if fence else re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            s = _slug(m.group(2))
            n = seen.get(s, 0)
            out.add(s if n == 0 else f"{s}-{n}")
            seen[s] = n + 1
    return out


def _broken(md: Path, root: Path = ROOT) -> list[str]:
    # fenced blocks are code, not links (blanked, so line numbers hold)
    text = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), md.read_text(encoding="utf-8"))
    found = []
    for m in [*LINK.finditer(text), *REF.finditer(text)]:
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto:, ...
            continue
        path, _, frag = target.partition("#")
        dest = md if not path else (md.parent / unquote(path)).resolve()
        where = f"{md.relative_to(root)}:{text.count(chr(10), 0, m.start()) + 1}"
        if not dest.exists():
            found.append(f"{where}: missing file: {target}")
        elif frag and dest.suffix == ".md" and frag not in _anchors(dest):
            found.append(f"{where}: missing heading: {target}")
    return found


def test_every_relative_link_in_the_docs_resolves():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert len(docs) > 10
    assert [b for md in docs for b in _broken(md)] == []


def test_the_checker_sees_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n[ok](#title) [gone](b.md) [bad](#nope)\n"
                                   "```\n[in code](c.md)\n```\n")
    assert _broken(tmp_path / "a.md", tmp_path) == ["a.md:2: missing file: b.md",
                                           "a.md:2: missing heading: #nope"]
