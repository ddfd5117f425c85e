"""Preflight of rollout.agent: a file that does not load, and a policy template without a tool
format, are findings naming the key before anything starts."""

from __future__ import annotations

from launcher.config import load_run_config
from launcher.preflight_agent import check_agent


def _cfg(*overrides):
    return load_run_config(None, list(overrides))


def test_an_agent_file_that_does_not_load_is_a_finding(tmp_path):
    bad = tmp_path / "agent.py"
    bad.write_text("import nothing_here\n")
    (finding,) = check_agent(_cfg(f"rollout.agent.entrypoint={bad}:run"))
    assert finding.key == "rollout.agent.entrypoint" and "fails to import" in finding.problem


def test_a_template_without_tool_calls_is_a_finding(tmp_path, tiny_model_dir):
    good = tmp_path / "agent.py"
    good.write_text("def run(base_url, api_key, sample):\n    return None\n")
    cfg = _cfg(f"rollout.agent.entrypoint={good}:run", f"model.path={tiny_model_dir}")
    (finding,) = check_agent(cfg)
    assert finding.key == "rollout.agent.tool_format"
    assert check_agent(_cfg(f"rollout.agent.entrypoint={good}:run", f"model.path={tiny_model_dir}",
                            "rollout.agent.tool_format=none")) == []  # fmt: skip
