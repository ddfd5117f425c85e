"""The docs test's extractor: what a ```bash block's lines make as commands."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.docs_commands import commands_in_block, commands_in_file, reading_order


def _texts(lines: str) -> list[tuple[int, str, bool]]:
    found = commands_in_block(lines.splitlines(), "X.md", 10, "X.md:9")
    return [(c.line, c.text, c.background) for c in found]


def test_continuation_lines_join_and_the_command_keeps_its_first_line():
    assert _texts("a --x 1 \\\n    --y 2\nb") == [(10, "a --x 1 --y 2", False), (12, "b", False)]


def test_comments_go_but_a_hash_inside_quotes_or_a_word_stays():
    lines = "# only a comment\nmake demo   # the demo\necho '# kept' a#b  # gone"
    assert _texts(lines) == [(11, "make demo", False), (12, "echo '# kept' a#b", False)]


def test_an_open_quote_continues_the_command_and_its_backslashes_join_too():
    lines = "ray exec c.yaml 'fleetrl train \\\n   x=1 \\\n   y=2'\nnext"
    assert _texts(lines) == [(10, "ray exec c.yaml 'fleetrl train x=1 y=2'", False), (13, "next", False)]  # fmt: skip


def test_a_single_ampersand_runs_in_the_background_a_double_one_does_not():
    assert _texts("srv --port 1 &   # bg\na && b") == [(10, "srv --port 1", True), (11, "a && b", False)]  # fmt: skip


def test_blocks_fences_and_other_languages(tmp_path: Path):
    doc = tmp_path / "d.md"
    doc.write_text(
        "text\n```bash\none\n```\n```python\nnot_shell()\n```\n  ```bash\n  two\n  ```\n"
    )
    found = commands_in_file(doc, "d.md")
    assert [(c.line, c.text, c.block) for c in found] == [(3, "one", "d.md:2"), (9, "two", "d.md:8")]  # fmt: skip


def test_reading_order_is_the_readme_then_pages_as_first_linked_then_the_rest(tmp_path: Path):
    (tmp_path / "docs").mkdir()
    for name in ("a", "b", "c"):
        (tmp_path / "docs" / f"{name}.md").write_text("")
    (tmp_path / "README.md").write_text("[c](docs/c.md) then [a](docs/a.md#x), [c](docs/c.md)")
    assert reading_order(tmp_path) == ["README.md", "docs/c.md", "docs/a.md", "docs/b.md"]
