"""``rollout.agent``: an agent program as the rollout, and the gateway it reaches the fleet through."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from rollout_fleet.agents.entrypoint import check_entrypoint_spec


class AgentConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    entrypoint: Annotated[
        str,
        Meta(
            description="The agent: 'path/to/file.py:function' or 'module:function', called as function(base_url=..., api_key=..., sample=row) for every episode (async, or sync in a thread); it returns a float reward, or None for the run's reward pipeline to score the last assistant message. rollout.n episodes of a prompt form a group. '' = off (docs/agents.md)."
        ),
    ] = ""
    max_concurrency: Annotated[
        int, Meta(ge=1, description="Episodes running at once across the rollout worker.")
    ] = 64
    timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            description="An episode whose agent has not returned after this long fails (counted; nothing of it trains).",
        ),
    ] = 300.0
    host: Annotated[
        str,
        Meta(
            description="Address the gateway binds and hands agents in base_url; '' = 127.0.0.1 on a local run, the node's IP on a cluster (every route needs a key either way)."
        ),
    ] = ""
    port: Annotated[int, Meta(ge=0, le=65535, description="Gateway port; 0 = a free one.")] = 0
    tool_format: Annotated[
        Literal["auto", "hermes", "llama3_json", "none"],
        Meta(
            description="How tool calls are parsed from the policy's text: auto = from its chat template (hermes <tool_call>, llama3 JSON; a template with neither is refused at start), none = tools are refused."
        ),
    ] = "auto"
    model_name: Annotated[
        str,
        Meta(
            description="The model id GET /v1/models lists; a request may name any model (the policy answers)."
        ),
    ] = "policy"
    health_check_interval_s: Annotated[
        float,
        Meta(
            gt=0,
            description="Seconds between the rollout role's probes of the gateway; one that does not answer is restarted and its episodes in flight fail (counted).",
        ),
    ] = 5.0
    health_check_timeout_s: Annotated[
        float,
        Meta(gt=0, description="A gateway probe taking longer than this counts as failed."),
    ] = 5.0
    health_check_failures: Annotated[
        int,
        Meta(
            ge=1,
            description="Failed probes in a row after which the gateway is restarted (a loaded machine can delay one).",
        ),
    ] = 3

    def __post_init__(self) -> None:
        if self.entrypoint:
            check_entrypoint_spec(self.entrypoint)

    @property
    def enabled(self) -> bool:
        return bool(self.entrypoint)
