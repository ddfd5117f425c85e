"""What the rollout worker needs of its collaborators, as protocols.

``RolloutWorker`` (``rollout_fleet/worker.py``) is given where trajectories go, what the
buffer reports for admission, the delivery ledger, the reward pipeline and a tokenizer;
these name the part of each it uses, so tests and other deployments can hand it their own.
"""

from __future__ import annotations

from typing import Any, Protocol

from buffer.wire import Trajectory
from fleetrl.data.reader import PromptItem
from rollout_fleet.rewards.pipeline import SampleReward


class TrajectorySink(Protocol):
    """Where finished trajectories go (``buffer.transport.TrajectorySender``)."""

    def send(self, traj: Trajectory) -> Any: ...


class AdmissionCounters(Protocol):
    """The admission inputs the buffer reports (``buffer.wire.AdmissionState``): the
    counters and the rule's parameters, so B and η have one source of truth."""

    policy_version: int
    accepted_groups: int
    max_staleness: int
    groups_per_version: int
    max_concurrent: int


class SentLedger(Protocol):
    """What the worker needs of ``rollout_fleet.delivery.DeliveryLedger``."""

    def sent_unconfirmed(self) -> int: ...

    def reconcile(self, *, sent_only: bool = False) -> int: ...

    def forget(self, group_id: str) -> None: ...


class GroupRewards(Protocol):
    """``rollout_fleet.rewards.pipeline.RewardPipeline``: never raises for a failing reward."""

    async def rule_score(self, prompt: PromptItem, response: str) -> Any: ...

    async def score_group(
        self,
        prompt: PromptItem,
        responses: list[str],
        rules: list[Any],
        *,
        record: bool = True,
    ) -> list[SampleReward]: ...

    def stats(self) -> dict[str, float]: ...


class Detokenizer(Protocol):
    """The worker's tokenizer; with multi-turn on it must also have ``apply_chat_template``
    and ``encode`` (``rollout_fleet.multi_turn.chat_turns.ChatTokenizer``)."""

    eos_token_id: int | None

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...
