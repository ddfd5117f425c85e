"""What a validation pass reports: its metrics, and the samples a user reads.

``RolloutWorker.validate`` scores one sample per held-out prompt; ``summarize`` turns the
scored samples into metrics, with verl's names where verl has them
(``val-core/<data_source>/reward/mean@1``, or ``.../acc/mean@1`` when the reward function
returns ``acc``, its other values under ``val-aux/``; ``val-aux/num_turns/*``) beside
fleetrl's own (``val/num_samples``, ``val/num_failed``, ``val/response_length/mean``,
``val/policy_version/*``, and the reward pipeline's ``val/score/*``, ``val/rule_score/*``,
``val/model_score/*``, ``val/num_reward_failed``: rollout_fleet/rewards/pipeline.py). A
sample whose reward failed counts only in ``val/num_reward_failed``. ``pick_samples`` is
``trainer.log_val_generations``: the same seeded choice of prompts at every validation,
so an answer can be followed from step to step, each a ``ValSample``
(launcher/generations.py writes them to ``<run dir>/generations.jsonl`` and wandb), the
prompt with the special tokens the policy read.

Left out: several samples per prompt (verl's ``mean@N``/``best@N`` for N > 1).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from fleetrl.data.reader import PromptItem
from rollout_fleet.rewards.pipeline import SampleReward, validation_metrics
from rollout_fleet.trajectory import SampleProgress


class ValSample(msgspec.Struct, frozen=True, kw_only=True):
    """One validation prompt and the policy's answer, as ``generations.jsonl`` holds it."""

    index: int  # the prompt's position in the validation set (the same every time)
    data_source: str
    prompt: str  # as the model read it: chat template rendered, special tokens removed
    response: str
    ground_truth: str
    score: float
    response_length: int  # tokens
    finish_reason: str  # stop | length | abort
    policy_version_min: int  # the weights that generated it (a version per token)
    policy_version_max: int
    turns: int = 1
    reward_metrics: dict[str, float] = {}  # the reward function's other values (acc, ...)


class Validation(msgspec.Struct, frozen=True, kw_only=True):
    """A validation pass: its metrics (logged) and the samples chosen to be read."""

    metrics: dict[str, float] = {}
    samples: list[ValSample] = []


@dataclass
class ValResult:
    """One scored validation sample, as the worker gets it back."""

    position: int
    prompt: PromptItem
    sample: SampleProgress
    reward: SampleReward
    turns: int = 1

    @property
    def score(self) -> float:
        return self.reward.score

    @property
    def reward_metrics(self) -> dict[str, float]:
        return self.reward.metrics


def summarize(results: Sequence[ValResult], failed: int, multi_turn: bool) -> dict[str, float]:
    out: dict[str, float] = {
        "val/num_samples": float(len(results)),
        "val/num_failed": float(failed),
    }
    if not results:
        return out
    out["val/response_length/mean"] = statistics.fmean(r.sample.num_generated for r in results)
    versions = [v for r in results for v in r.sample.token_versions]
    if versions:  # which weights validated: should be the version just published
        out["val/policy_version/min"] = float(min(versions))
        out["val/policy_version/max"] = float(max(versions))
    if multi_turn:
        turns = [r.turns for r in results]
        out["val-aux/num_turns/mean"] = statistics.fmean(turns)
        out["val-aux/num_turns/min"] = float(min(turns))
        out["val-aux/num_turns/max"] = float(max(turns))
    out.update(validation_metrics([(r.prompt.data_source, r.reward) for r in results]))
    by_source: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        if r.reward.failed:
            continue
        values = by_source[r.prompt.data_source or "unknown"]
        values["reward"].append(r.score)
        for key, value in r.reward_metrics.items():
            values[key].append(value)
    for source, per_var in sorted(by_source.items()):
        core = "acc" if "acc" in per_var else "reward"  # verl's choice of the core variable
        for var, values in per_var.items():
            section = "val-core" if var == core else "val-aux"
            out[f"{section}/{source}/{var}/mean@1"] = statistics.fmean(values)
    return out


def pick_samples(
    results: Sequence[ValResult],
    total: int,
    count: int,
    seed: int,
    decode: Callable[..., str],
) -> list[ValSample]:
    """``count`` samples of the ``total`` prompts, the same positions at every validation.

    ``decode(ids, skip_special_tokens=...)`` is the tokenizer's: the prompt is written as
    the policy read it, its special tokens (BOS, the template's markers) included; the
    response as text."""
    if count <= 0 or total <= 0:
        return []
    chosen = set(np.random.default_rng(seed).permutation(total)[:count].tolist())
    picked = sorted((r for r in results if r.position in chosen), key=lambda r: r.position)
    return [
        ValSample(
            index=r.position,
            data_source=r.prompt.data_source,
            prompt=decode([int(t) for t in r.prompt.prompt_ids], skip_special_tokens=False),
            response=decode(r.sample.output_ids, skip_special_tokens=True),
            ground_truth=r.prompt.ground_truth,
            score=r.score,
            response_length=r.sample.num_generated,
            finish_reason=r.sample.finish_reason,
            policy_version_min=min(r.sample.token_versions, default=-1),
            policy_version_max=max(r.sample.token_versions, default=-1),
            turns=r.turns,
            reward_metrics=dict(r.reward_metrics),
        )
        for r in picked
    ]
