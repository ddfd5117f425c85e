"""The shell commands the README and docs/*.md show, in the order a reader meets them.

A reader reads the README first, then the docs pages in the order the README links them
(pages it never links come last, by name). Each ```bash block yields its commands: lines
ending in a backslash continue the command, a quote left open continues it too, ``#``
starts a comment outside quotes, and a command ending in a single ``&`` runs in the
background. The docs test (test_docs_commands.py) runs what this module finds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_FENCE_OPEN = re.compile(r"^(\s*)```bash\s*$")
_FENCE_CLOSE = re.compile(r"^\s*```\s*$")
_DOC_LINK = re.compile(r"\((docs/[A-Za-z0-9_\-]+\.md)")


@dataclass(frozen=True)
class DocCommand:
    """One command as shown: where it is, its text (continuations joined), its block."""

    file: str
    line: int
    text: str
    block: str
    background: bool = False

    def where(self) -> str:
        return f"{self.file}:{self.line}"


def _strip_comment(line: str, quote: str | None) -> tuple[str, str | None]:
    """The line without its comment, and the quote still open at its end."""
    out = []
    prev = " "
    for ch in line:
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and prev.isspace():
            break
        out.append(ch)
        prev = ch
    return "".join(out).rstrip(), quote


def _finish(text: str) -> tuple[str, bool]:
    text = text.strip()
    if text.endswith("&") and not text.endswith("&&"):
        return text[:-1].rstrip(), True
    return text, False


def commands_in_block(lines: list[str], file: str, first_line: int, block: str) -> list[DocCommand]:
    """The commands of one block's lines, the first of which is line ``first_line``."""
    found: list[DocCommand] = []
    parts: list[str] = []
    start = 0
    quote: str | None = None
    for offset, raw in enumerate(lines):
        text, quote = _strip_comment(raw, quote)
        if not parts and not text.strip():
            continue
        if not parts:
            start = first_line + offset
        continued = text.endswith("\\")
        parts.append(text[:-1].strip() if continued else text.strip())
        if continued or quote:
            continue
        joined, background = _finish(" ".join(p for p in parts if p))
        found.append(DocCommand(file, start, joined, block, background))
        parts = []
    if parts:
        joined, background = _finish(" ".join(p for p in parts if p))
        found.append(DocCommand(file, start, joined, block, background))
    return found


def commands_in_file(path: Path, name: str) -> list[DocCommand]:
    """Every command of every ```bash block in one Markdown file, top to bottom; a
    command's block is named FILE:LINE of the block's opening fence."""
    lines = path.read_text().splitlines()
    found: list[DocCommand] = []
    i = 0
    while i < len(lines):
        if not _FENCE_OPEN.match(lines[i]):
            i += 1
            continue
        body_start = i + 1
        j = body_start
        while j < len(lines) and not _FENCE_CLOSE.match(lines[j]):
            j += 1
        found += commands_in_block(lines[body_start:j], name, body_start + 1, f"{name}:{i + 1}")
        i = j + 1
    return found


def reading_order(repo: Path) -> list[str]:
    """README.md, then docs pages as the README first links them, then the rest by name."""
    linked = _DOC_LINK.findall((repo / "README.md").read_text())
    pages = sorted(p.relative_to(repo).as_posix() for p in (repo / "docs").glob("*.md"))
    ordered = [p for p in dict.fromkeys(linked) if p in pages]
    return ["README.md"] + ordered + [p for p in pages if p not in ordered]


def doc_commands(repo: Path) -> list[DocCommand]:
    """Every command the README and docs show, in reading order."""
    return [c for name in reading_order(repo) for c in commands_in_file(repo / name, name)]
