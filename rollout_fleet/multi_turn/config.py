"""``rollout.multi_turn``: the environment a sample converses with, and the turn limit."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from rollout_fleet.multi_turn.environment import check_env_name


class MultiTurnConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    env: Annotated[
        str,
        Meta(
            description="Environment that answers each generated turn: a built-in name (calculator) or 'module:function' (rollout_fleet/multi_turn/environment.py); '' = off, one completion per sample. The response's budget is rollout.max_new_tokens, generated and environment tokens together."
        ),
    ] = ""
    max_turns: Annotated[
        int,
        Meta(
            ge=1,
            description="Generated turns per sample at most; a conversation the environment would continue after the last one ends as 'length'.",
        ),
    ] = 4
    env_timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            description="An environment step running longer than this fails its sample (the group is dropped and counted).",
        ),
    ] = 10.0
    env_workers: Annotated[
        int, Meta(ge=1, description="Environment steps running at once, each in its own thread.")
    ] = 4

    def __post_init__(self) -> None:
        if self.env:
            check_env_name(self.env)

    @property
    def enabled(self) -> bool:
        return bool(self.env)
