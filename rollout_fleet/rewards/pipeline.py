"""A sample's reward: rule score and model score, combined, or the reason it failed.

The rollout worker calls two steps, so scoring overlaps generation::

    as each sample finishes:    rule = await pipeline.rule_score(prompt, text)
    once its group's n finish:  rewards = await pipeline.score_group(prompt, texts, rules)

``rule_score`` runs the row's single (or async) rule function right away;
``score_group`` runs what needs the whole group, concurrently: a batched custom
function (one call per group) and the reward model (one batched ``/classify``
call for the group's n responses). Both happen on the rollout side while other
groups generate; the learner never waits for a score.

Combining (``reward`` section of the run config)::

    reward = rule_weight × rule_score + model.weight × model_score

with ``model_score`` the normalised, clipped score (model_scorer.py), and no
model term without a reward model. With a reward model and ``rule_weight = 0`` no
rule scorer is required: a row without one has no rule score, and where one
exists its score is still computed and reported (the RLHF demo is judged by the
rule, never by the reward model), and its failure does not fail the sample.

A sample *fails* (``SampleReward.error``) when a term its reward needs failed:
the rule function raised, timed out or returned a non-finite value, the
data_source has no scorer, or the reward model could not score it (a model weighted
0 is watched, not needed: its failures are counted and fail no sample). A failed
sample is sent with its group, marked (``Trajectory.reward_error``), and trains
nothing; the worker drops a group whose every sample failed.

Per sample, ``metrics`` (into ``Trajectory.reward_metrics``) holds the rule
function's extras (``acc``, ...), ``rule_score``, ``model_score`` and
``model_score_raw``. ``stats()`` gives cumulative counters and, for the scores
and latencies, means over the samples scored since the previous ``stats()``
(the driver reads once per step: per-step means).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetrl.config import ConfigError
from fleetrl.data.reader import PromptItem
from fleetrl.models.reward_folder import RewardFolderError
from rollout_fleet.rewards.config import RewardConfig
from rollout_fleet.rewards.custom import RewardLoadError, load_custom_reward
from rollout_fleet.rewards.judge import JudgeAccess
from rollout_fleet.rewards.model_scorer import (
    ClientFactory,
    ModelScore,
    ModelScorer,
    build_model_scorer,
    default_client_factory,
)
from rollout_fleet.rewards.runner import RewardResult, RewardRunner

RULE_SCORE = "rule_score"
MODEL_SCORE = "model_score"
MODEL_SCORE_RAW = "model_score_raw"


@dataclass(frozen=True)
class SampleReward:
    score: float  # the combined reward; a 0.0 placeholder when it failed
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # why the reward failed: the sample trains nothing
    rule_s: float = 0.0  # seconds in the rule function
    group_s: float = 0.0  # seconds scoring what needed the whole group (model, batched rule)

    @property
    def failed(self) -> bool:
        return self.error is not None


class _Means:
    """Sums and counts since the last ``pop`` (per-step means of the role metrics)."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)

    def add(self, name: str, value: float) -> None:
        self._sums[name] += value
        self._counts[name] += 1

    def pop(self) -> dict[str, float]:
        out = {f"reward/{k}/mean": self._sums[k] / self._counts[k] for k in self._sums}
        self._sums.clear()
        self._counts.clear()
        return out


class RewardPipeline:
    """Rule and model scores of a group, combined (see the module docstring)."""

    def __init__(
        self,
        rules: RewardRunner,
        model: ModelScorer | None = None,
        *,
        rule_weight: float = 1.0,
        model_weight: float = 1.0,
    ) -> None:
        if model is None and rule_weight == 0:
            raise ValueError("reward.rule_weight is 0 and there is no reward model: no reward")
        self.rules = rules
        self.model = model
        self.rule_weight = rule_weight
        self.model_weight = model_weight
        # without a reward model, or with the rule weighed in, every row needs a rule score;
        # a model weighted 0 is watched, not trained on: its failures fail no sample
        self.rule_required = model is None or rule_weight != 0
        self.model_required = model is not None and model_weight != 0
        self.samples_scored = 0
        self.samples_failed = 0
        self.rule_failed = 0
        self.model_failed = 0
        self.groups_scored = 0
        self._means = _Means()

    async def rule_score(self, prompt: PromptItem, response: str) -> RewardResult | None:
        """The sample's rule score as it finishes; None when it waits for its group (a
        batched function) or no rule applies (none exists and none is required)."""
        source = prompt.data_source
        if self.rules.uses_custom(source) and self.rules.custom is not None:
            if self.rules.custom.batched:
                return None
        elif not self.rule_required and not self.rules.has_scorer(source):
            return None
        return await self.rules.score(source, response, prompt.ground_truth, prompt.extra_info)

    async def score_group(
        self,
        prompt: PromptItem,
        responses: Sequence[str],
        rules: Sequence[RewardResult | None],
        *,
        record: bool = True,
    ) -> list[SampleReward]:
        """Every sample's reward (never raises for a failing function or server);
        ``record=False`` (validation) leaves the run's counters and means alone."""
        started = time.monotonic()
        waiting = [
            i
            for i, r in enumerate(rules)
            if r is None and self.rules.has_scorer(prompt.data_source)
        ]
        batch_rules = self._batch_rules(prompt, [responses[i] for i in waiting])
        models = self._model_scores(prompt, responses)
        batched, model_scores = await asyncio.gather(batch_rules, models)
        rule_results = list(rules)
        for i, result in zip(waiting, batched, strict=True):
            rule_results[i] = result
        group_s = time.monotonic() - started
        out = [
            self._combine(rule, model, group_s)
            for rule, model in zip(rule_results, model_scores, strict=True)
        ]
        if record:
            self._record(out, rule_results, model_scores, group_s)
        return out

    async def _batch_rules(self, prompt: PromptItem, texts: list[str]) -> list[RewardResult]:
        if not texts:
            return []
        n = len(texts)
        return await self.rules.score_batch(
            [prompt.data_source] * n, texts, [prompt.ground_truth] * n, [prompt.extra_info] * n
        )

    async def _model_scores(
        self, prompt: PromptItem, texts: Sequence[str]
    ) -> list[ModelScore | None]:
        if self.model is None:
            return [None] * len(texts)
        return list(await self.model.score(prompt.raw_prompt, texts))

    def _combine(
        self, rule: RewardResult | None, model: ModelScore | None, group_s: float
    ) -> SampleReward:
        metrics: dict[str, float] = {}
        errors: list[str] = []
        score = 0.0
        rule_s = 0.0
        if rule is not None:
            metrics.update(rule.metrics)
            rule_s = rule.elapsed_s
            if rule.failed:
                if self.rule_required:
                    errors.append(f"rule: {rule.error}")
            else:
                metrics[RULE_SCORE] = rule.score
                score += self.rule_weight * rule.score
        if model is not None:
            if model.failed:
                if self.model_required:
                    errors.append(str(model.error))
            else:
                metrics[MODEL_SCORE] = model.score
                metrics[MODEL_SCORE_RAW] = float(model.raw if model.raw is not None else 0.0)
                score += self.model_weight * model.score
        if errors:
            return SampleReward(0.0, metrics, "; ".join(errors), rule_s, group_s)
        return SampleReward(score, metrics, None, rule_s, group_s)

    def _record(
        self,
        rewards: list[SampleReward],
        rules: list[RewardResult | None],
        models: list[ModelScore | None],
        group_s: float,
    ) -> None:
        self.groups_scored += 1
        self._means.add("group_latency_s", group_s)
        for reward, rule, model in zip(rewards, rules, models, strict=True):
            self.samples_scored += 1
            self.samples_failed += reward.failed
            if rule is not None:
                self.rule_failed += rule.failed
                self._means.add("rule_latency_s", rule.elapsed_s)
                if not rule.failed:
                    self._means.add(RULE_SCORE, rule.score)
            if model is not None:
                self.model_failed += model.failed
                if not model.failed:
                    self._means.add(MODEL_SCORE, model.score)
                    self._means.add(MODEL_SCORE_RAW, float(model.raw or 0.0))
            if not reward.failed:
                self._means.add("score", reward.score)

    def stats(self) -> dict[str, float]:
        out = {
            "reward/samples_scored": float(self.samples_scored),
            "reward/samples_failed": float(self.samples_failed),
            "reward/rule_failed": float(self.rule_failed),
            "reward/groups_scored": float(self.groups_scored),
            **self.rules.stats(),
            **self._means.pop(),
        }
        if self.model is not None:
            out["reward/model_failed"] = float(self.model_failed)
            out.update(self.model.stats())
        return out

    async def aclose(self) -> None:
        self.rules.close()
        if self.model is not None:
            await self.model.aclose()


def build_reward_pipeline(
    config: RewardConfig,
    *,
    timeout_s: float,
    max_workers: int,
    model_servers: Mapping[str, str] | None = None,
    reward_api_key: str | None = None,
    engines: Callable[[], Mapping[str, str]] | None = None,
    engine_api_key: str | None = None,
    client_factory: ClientFactory = default_client_factory,
) -> RewardPipeline:
    """The pipeline the ``reward`` section describes (custom function loaded, reward-model
    client built for ``model_servers``); a ``ConfigError`` names the key of what is wrong."""
    custom_cfg = config.custom_function
    custom = None
    if custom_cfg.path:
        try:
            custom = load_custom_reward(custom_cfg.path, custom_cfg.name, custom_cfg.reward_kwargs)
        except RewardLoadError as err:
            raise ConfigError("reward.custom_function.path", str(err)) from err
    model = None
    if config.uses_model:
        try:
            model = build_model_scorer(
                config.model, model_servers or {}, reward_api_key, client_factory=client_factory
            )
        except (RewardFolderError, OSError) as err:
            raise ConfigError("reward.model.path", str(err)) from err
    scorer = model
    judge = JudgeAccess(
        reward_servers=(lambda: scorer.servers) if scorer is not None else dict,
        reward_api_key=reward_api_key,
        engines=engines or dict,
        engine_api_key=engine_api_key,
        reward_model_tokenizer=model.tokenizer if model is not None else None,
    )
    rules = RewardRunner(
        timeout_s,
        max_workers,
        custom,
        custom_sources=custom_cfg.data_sources,
        judge=judge,
    )
    return RewardPipeline(
        rules, model, rule_weight=config.rule_weight, model_weight=config.model.weight
    )


def validation_metrics(scored: Sequence[tuple[str, SampleReward]]) -> dict[str, float]:
    """``val/score`` (combined), ``val/rule_score`` and ``val/model_score``: the mean over the
    samples whose reward was scored, overall and per data source; failures counted."""
    out: dict[str, float] = {"val/num_reward_failed": float(sum(r.failed for _, r in scored))}
    series: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for source, reward in scored:
        if reward.failed:
            continue
        values: dict[str, Any] = {"score": reward.score}
        for key in (RULE_SCORE, MODEL_SCORE, MODEL_SCORE_RAW):
            if key in reward.metrics:
                values[key] = reward.metrics[key]
        for key, value in values.items():
            series[key]["mean"].append(value)
            series[key][source or "unknown"].append(value)
    for key, by_source in series.items():
        for source, values in sorted(by_source.items()):
            out[f"val/{key}/{source}"] = sum(values) / len(values)
    return out
