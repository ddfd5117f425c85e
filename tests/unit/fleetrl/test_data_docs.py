"""docs/data.md: its pyarrow example, run as written, makes a file the rollout's validator
takes whole, and its table names exactly the schema's columns."""

from __future__ import annotations

import re
from pathlib import Path

from fleetrl.data.schema import COLUMNS, REQUIRED_COLUMNS, file_problems

DOC = Path(__file__).resolve().parents[3] / "docs" / "data.md"


def test_the_pyarrow_example_writes_a_valid_prompt_file(tmp_path, monkeypatch):
    [code] = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len([line for line in code.splitlines() if line.strip()]) == 5
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(DOC), "exec"), {})
    problems, rows = file_problems(tmp_path / "my_prompts.parquet")
    assert problems == []
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["5", "42"]
    assert rows[0]["prompt"] == [{"role": "user", "content": "What is 2+3?"}]


def test_the_table_lists_the_schemas_columns_and_which_are_required():
    table = re.findall(r"^\| `(\w+)` \| [^|]+ \| (yes|no[^|]*) \|", DOC.read_text(), flags=re.M)
    assert [name for name, _ in table] == list(COLUMNS)
    assert [name for name, required in table if required == "yes"] == list(REQUIRED_COLUMNS)
