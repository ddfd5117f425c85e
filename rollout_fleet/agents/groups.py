"""A group of agent episodes, from ``rollout.n`` runs of the agent to the trajectories sent.

::

    n episodes of one prompt, concurrently (AgentRollout.run_episode)
      failed episodes ──► left out, counted by cause; every episode failed ──► SampleFailed:
                          the worker drops the group, counted, as a group whose engines failed
      the others: reward = the agent's float, or (None) the run's reward pipeline on the
                  episode's last reply: rule score as it finishes, then score_group over
                  those episodes in one go (batched function, reward model)
      ──► one Trajectory per leaf branch of each episode, every branch with its episode's
          reward; group_size = the trajectories sent (the buffer hands the group out whole)

A group trains without its failed episodes rather than being dropped: an agent
that fails on one sample in n (a tool that times out, a framework that raises
on odd output) would otherwise throw away the other n-1 and bias the data
toward prompts whose episodes never fail. GRPO's group statistics are then over
the episodes that finished; a group left with one trajectory has advantage 0.
An episode whose agent rewrote its history has several trajectories, so it
counts several times in its group's mean and std.
"""

from __future__ import annotations

import asyncio
from typing import Any

from buffer.wire import Trajectory
from rollout_fleet.agents.rollout import AgentRollout, EpisodeOutcome
from rollout_fleet.rewards.pipeline import SampleReward
from rollout_fleet.sample_runner import SampleFailed
from rollout_fleet.trajectory import build_trajectory
from rollout_fleet.validation import ValResult


class EpisodesFailed(SampleFailed):
    """Every episode of a group failed: nothing of it can train."""


class AgentGroups:
    """Runs a group's episodes and scores them (see the module docstring)."""

    def __init__(self, agents: AgentRollout, rewards: Any, group_size: int) -> None:
        self.agents = agents
        self.rewards = rewards
        self.group_size = group_size

    async def run(self, group_id: str, prompt: Any, sampling: dict[str, Any]) -> list[Trajectory]:
        """The group's trajectories; ``EpisodesFailed`` when none of its episodes finished."""
        outcomes = await asyncio.gather(
            *(
                self.agents.run_episode(group_id, i, prompt, sampling)
                for i in range(self.group_size)
            )
        )
        done = [o for o in outcomes if not o.failed]
        if not done:
            raise EpisodesFailed(
                f"group {group_id}: all {len(outcomes)} agent episodes failed "
                f"(first: {outcomes[0].detail})"
            )
        rewards = await self.episode_rewards(prompt, done)
        trajectories: list[Trajectory] = []
        count = sum(len(o.leaves) for o in done)
        for outcome, reward in zip(done, rewards, strict=True):
            for leaf in outcome.leaves:
                trajectories.append(build_trajectory(
                    leaf, group_id=group_id, sample_index=len(trajectories), group_size=count,
                    score=reward.score, data_source=prompt.data_source, prompt_index=prompt.index,
                    reward_metrics=reward.metrics,
                    timings={"episode_s": outcome.seconds, "reward_s": reward.rule_s,
                             "reward_group_s": reward.group_s, "calls": float(outcome.calls)},
                    temperature=sampling["temperature"], reward_error=reward.error or "",
                    episode=outcome.uid,
                ))  # fmt: skip
        return trajectories

    async def validate(self, group_id: str, position: int, prompt: Any,
                       sampling: dict[str, Any]) -> ValResult:  # fmt: skip
        """One validation episode, scored as training scores it (``EpisodesFailed`` if it failed);
        its sample is the episode's longest trajectory."""
        outcome = await self.agents.run_episode(group_id, 0, prompt, sampling)
        if outcome.failed:
            raise EpisodesFailed(f"validation episode {outcome.uid}: {outcome.detail}")
        (reward,) = await self.episode_rewards(prompt, [outcome], record=False)
        longest = max(outcome.leaves, key=lambda leaf: len(leaf.output_ids))
        return ValResult(position, prompt, longest, reward, outcome.calls)

    async def episode_rewards(
        self, prompt: Any, done: list[EpisodeOutcome], *, record: bool = True
    ) -> list[SampleReward]:
        """Per finished episode: the agent's reward, or the pipeline's score of its last reply."""
        pending = [o for o in done if o.reward is None]
        scored: dict[str, SampleReward] = {}
        if pending:
            texts = [o.last_reply for o in pending]
            rules = await asyncio.gather(*(self.rewards.rule_score(prompt, t) for t in texts))
            results = await self.rewards.score_group(prompt, texts, list(rules), record=record)
            scored = {o.uid: result for o, result in zip(pending, results, strict=True)}
        return [
            scored[o.uid] if o.reward is None
            else SampleReward(score=o.reward, metrics={"agent_reward": o.reward})
            for o in done
        ]  # fmt: skip
