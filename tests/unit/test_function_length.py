"""The house rule "no function over 100 lines outside tests/", enforced over the repository.

A function's length is its whole definition, decorators excluded: ``end_lineno - lineno + 1``
of its ``def`` (nested functions and methods count on their own, and inside their parent).
Every Python file below the repository root is read, but tests/ and hidden folders (.venv,
.git, caches). A failure names each offender as ``file:function:length``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 100
EXCLUDED_TOP = {"tests"}


def long_functions(source: str, name: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``name:function:length`` of every function in ``source`` longer than ``limit`` lines."""
    return [
        f"{name}:{node.name}:{node.end_lineno - node.lineno + 1}"
        for node in ast.walk(ast.parse(source, filename=name))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > limit
    ]


def project_files(root: Path) -> Iterator[Path]:
    """The repository's Python files outside tests/ and hidden folders."""
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] in EXCLUDED_TOP or any(p.startswith(".") or p == "__pycache__" for p in parts):
            continue
        yield path


def test_no_function_outside_tests_is_over_100_lines():
    files = list(project_files(REPO))
    assert len(files) > 100, f"only {len(files)} Python files found below {REPO}"
    offenders = [
        found
        for path in files
        for found in long_functions(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    ]
    assert offenders == [], (
        f"functions over {MAX_FUNCTION_LINES} lines (split each into named steps): "
        + ", ".join(offenders)
    )


def _function(header: str, indent: int, body_lines: int) -> str:
    pad = " " * indent
    return f"{pad}{header}:\n" + "".join(f"{pad}    x = {i}\n" for i in range(body_lines))


def test_the_rule_counts_a_functions_whole_definition_and_names_it():
    source = (
        _function("def fits()", 0, 99)  # 100 lines: allowed
        + "class C:\n"
        + _function("async def too_long(self)", 4, 100)  # 101 lines, a method
    )
    assert long_functions(source, "m.py") == ["m.py:too_long:101"]
