"""Model scores: a group's responses scored by reward-model servers in one batched call.

``ModelScorer.score(messages, responses)`` builds each sample's input ids in the
reward model's own tokens (rollout_fleet/rewards/model_input.py), sends them in one
``client.score`` call (the client batches them into ``/classify`` requests, retries
and fails over between servers: rollout_fleet/rewards/model_client.py), then per
sample: raw score -> standardised with the reward model's statistics when
``normalize`` (``(raw - mean) / std``, as OpenRLHF) -> clipped to ``±clip``.

Failures fail samples, never the run: the client giving up on the batch
(``RewardServerError``, or a transport error it let through) or answering with
the wrong number of scores fails the group's samples; a non-finite score fails
its sample. The caller marks them (the sample trains nothing) and counts them.

``build_model_scorer`` builds the scorer around a client (``client_factory``): in a run,
the one client of the role's ``RewardServers`` (rollout_fleet/rewards/servers.py), whose
servers are ``reward.model.urls`` or a reward fleet placed for ``reward.model.path`` that
tells the client each time it starts or replaces a server.

Tokenizing runs on one thread of its own: off the event loop, and never two
calls on the tokenizer at once. Left out: caching scores of identical responses.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fleetrl.log import get_logger
from fleetrl.models.reward_folder import RewardStats, check_reward_folder, read_reward_stats
from rollout_fleet.rewards.config import RewardModelConfig
from rollout_fleet.rewards.model_input import RewardModelInputs

log = get_logger(__name__)

# What a client may raise when a batch cannot be scored: RewardServerError is a
# RuntimeError; OSError and TimeoutError in case a transport error gets through it.
CLIENT_FAILURES = (RuntimeError, OSError, TimeoutError)


class ScoreClient(Protocol):
    """``rollout_fleet.rewards.model_client.RewardModelClient``."""

    @property
    def servers(self) -> dict[str, str]: ...

    def set_servers(self, servers: Mapping[str, str]) -> None: ...

    async def score(self, input_ids: list[list[int]]) -> list[float]: ...

    def stats(self) -> dict[str, float]: ...

    async def aclose(self) -> None: ...


ClientFactory = Callable[..., ScoreClient]


@dataclass(frozen=True)
class ModelScore:
    """One sample's model score: ``score`` normalised and clipped, ``raw`` as served."""

    score: float = 0.0
    raw: float | None = None
    error: str | None = None  # why the sample has no model score

    @property
    def failed(self) -> bool:
        return self.error is not None


def servers_from_urls(urls: Sequence[str]) -> dict[str, str]:
    """``reward.model.urls`` as a servers mapping: ``reward-url-0``, ``reward-url-1``, ... in
    order (a placed reward fleet names its servers ``reward-0``...)."""
    return {f"reward-url-{i}": url.rstrip("/") for i, url in enumerate(urls)}


class ModelScorer:
    """Scores groups on reward-model servers (see the module docstring)."""

    def __init__(
        self,
        client: ScoreClient,
        inputs: RewardModelInputs,
        *,
        stats: RewardStats | None = None,
        clip: float = 0.0,
    ) -> None:
        if clip < 0:
            raise ValueError(f"reward model clip must be >= 0, got {clip}")
        self.client = client
        self.inputs = inputs
        self.normalization = stats
        self.clip = clip
        self._tokenize = ThreadPoolExecutor(1, thread_name_prefix="reward-tokenize")
        self.batches = 0
        self.batches_failed = 0
        self.samples_failed = 0
        self.non_finite = 0

    @property
    def servers(self) -> dict[str, str]:
        """The servers scored on now (a reward fleet tells the client as they change)."""
        return dict(self.client.servers)

    @property
    def tokenizer(self) -> Any:
        return self.inputs.tokenizer

    def set_servers(self, servers: Mapping[str, str]) -> None:
        """The fleet replaced or added a server: score on ``servers`` from now on."""
        self.client.set_servers(servers)

    def finish(self, raw: float) -> float:
        """Raw score -> normalised (with the folder's statistics) -> clipped."""
        score = raw
        if self.normalization is not None:
            score = (raw - self.normalization.mean) / self.normalization.std
        if self.clip > 0:
            score = min(max(score, -self.clip), self.clip)
        return score

    async def score(
        self, messages: Sequence[dict[str, str]] | str, responses: Sequence[str]
    ) -> list[ModelScore]:
        """One model score per response to ``messages`` (never raises for server trouble)."""
        if not responses:
            return []
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(
            self._tokenize, lambda: [self.inputs.input_ids(messages, r) for r in responses]
        )
        self.batches += 1
        try:
            raw = await self.client.score(ids)
        except CLIENT_FAILURES as err:
            error = str(err) if str(err).startswith("reward model") else f"reward model: {err}"
            return self._batch_failed(len(responses), error)
        if len(raw) != len(responses):
            return self._batch_failed(
                len(responses),
                f"reward model: {len(raw)} scores for {len(responses)} inputs",
            )
        out = []
        for value in raw:
            value = float(value)
            if not math.isfinite(value):
                self.non_finite += 1
                self.samples_failed += 1
                out.append(
                    ModelScore(raw=value, error=f"reward model score is not finite: {value}")
                )
            else:
                out.append(ModelScore(score=self.finish(value), raw=value))
        return out

    def _batch_failed(self, count: int, error: str) -> list[ModelScore]:
        self.batches_failed += 1
        self.samples_failed += count
        if self.batches_failed <= 20 or self.batches_failed % 1000 == 0:
            log.warning("%s (%d batches failed so far)", error, self.batches_failed)
        return [ModelScore(error=error)] * count

    def stats(self) -> dict[str, float]:
        out = {
            "reward/model_batches": float(self.batches),
            "reward/model_batches_failed": float(self.batches_failed),
            "reward/model_samples_failed": float(self.samples_failed),
            "reward/model_non_finite": float(self.non_finite),
            "reward/model_inputs_truncated": float(self.inputs.num_truncated),
        }
        out.update({k: float(v) for k, v in self.client.stats().items()})
        return out

    async def aclose(self) -> None:
        await self.client.aclose()
        self._tokenize.shutdown(wait=False, cancel_futures=True)


def model_max_length(folder: str | Path) -> int:
    """The reward model's context (``max_position_embeddings`` of its config.json)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    length = config.get("max_position_embeddings")
    if not isinstance(length, int) or length < 1:
        raise ValueError(
            f"reward model {folder}: config.json has no max_position_embeddings; "
            "set reward.model.max_length"
        )
    return length


def default_client_factory(servers: Mapping[str, str], **kwargs: Any) -> ScoreClient:
    from rollout_fleet.rewards.model_client import RewardModelClient

    return RewardModelClient(servers, **kwargs)


def build_model_scorer(
    config: RewardModelConfig,
    servers: Mapping[str, str],
    api_key: str | None,
    *,
    client_factory: ClientFactory = default_client_factory,
) -> ModelScorer:
    """The scorer of ``reward.model``: its folder's tokenizer, statistics and context, and a
    client for ``servers``. Raises ``RewardFolderError`` / ``ValueError`` naming the folder."""
    from fleetrl.models.loading import load_tokenizer

    check_reward_folder(config.path)
    stats = read_reward_stats(config.path) if config.normalize else None
    if config.normalize and stats is None:
        log.warning(
            "reward.model.normalize is on but %s holds no score statistics: raw scores are used "
            "(as OpenRLHF does without them); `fleetrl rm train` writes them",
            config.path,
        )
    inputs = RewardModelInputs(
        load_tokenizer(config.path),
        apply_chat_template=config.apply_chat_template,
        max_length=config.max_length or model_max_length(config.path),
    )
    client = client_factory(
        dict(servers),
        api_key=api_key,
        batch_size=config.batch_size,
        request_timeout_s=config.request_timeout_s,
        max_attempts=config.max_attempts,
        retry_backoff_s=config.retry_backoff_s,
    )
    return ModelScorer(client, inputs, stats=stats, clip=config.clip)
