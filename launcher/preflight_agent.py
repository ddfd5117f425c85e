"""Preflight of ``rollout.agent``: the agent loads and the policy's chat template can serve it.

- ``rollout.agent.entrypoint``: the file or module imports (here, in the driver: its top
  level runs again in the rollout role) and its function takes ``base_url``, ``api_key``,
  ``sample``;
- the policy's tokenizer (when ``model.path`` exists: a tiny model is built later) has a
  chat template that renders an assistant turn's content verbatim, and a tool-call format
  the gateway parses, or ``rollout.agent.tool_format`` names one.
"""

from __future__ import annotations

from pathlib import Path

from launcher.config import RunConfig
from launcher.preflight_findings import Finding


def check_agent(cfg: RunConfig) -> list[Finding]:
    from rollout_fleet.agents.entrypoint import AgentLoadError, load_agent

    agent = cfg.rollout.agent
    if not agent.enabled:
        return []
    try:
        load_agent(agent.entrypoint)
    except AgentLoadError as err:
        return [Finding(key="rollout.agent.entrypoint", problem=str(err),
                        fix="fix the file, or point the key at function(base_url, api_key, sample)")]  # fmt: skip
    if not (Path(cfg.model.path) / "config.json").is_file():
        return []
    return _check_template(cfg)


def _check_template(cfg: RunConfig) -> list[Finding]:
    from fleetrl.models.loading import load_tokenizer
    from rollout_fleet.gateway.rendering import ChatRenderer, TemplateError
    from rollout_fleet.gateway.tool_parsers import UnknownToolFormat, detect_tool_format

    tokenizer = load_tokenizer(cfg.model.path)
    renderer = ChatRenderer(tokenizer)
    try:
        renderer.check_template()
        if cfg.rollout.agent.tool_format == "auto":
            detect_tool_format(getattr(tokenizer, "chat_template", None), renderer.name)
    except (TemplateError, UnknownToolFormat) as err:
        return [Finding(key="rollout.agent.tool_format", problem=str(err),
                        fix="use a policy whose chat template has tool calls, or set the key")]  # fmt: skip
    return []
