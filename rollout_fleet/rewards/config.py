"""Reward section of the run config: your own reward function, a reward-model fleet, and how
their scores combine with the rule scorers.

A sample's reward is ``rule_weight`` × rule score + ``model.weight`` × model score, where the
rule score comes from ``custom_function`` (for the rows it claims) or the built-in scorer of
the row's ``data_source``, and the model score from reward-model servers (``model.path``
places a fleet of them; ``model.urls`` scores on servers already running). Scoring happens on
the rollout side, per group as its samples finish, before the trajectory is sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from rollout_fleet.config import engine_range


class CustomFunctionConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    path: Annotated[
        str,
        Meta(
            description="Python file defining your reward function (verl's custom_reward_function.path); empty = the built-in scorers by data_source."
        ),
    ] = ""
    name: Annotated[
        str,
        Meta(
            description="Function in that file (verl's default name). Called with keywords data_source, solution_str, ground_truth, extra_info; a function taking data_sources, solution_strs, ground_truths, extra_infos scores a whole group at once; async functions are awaited."
        ),
    ] = "compute_score"
    data_sources: Annotated[
        list[str],
        Meta(
            description="data_source values (a trailing * matches a prefix) the function scores; empty = every row. Other rows keep the built-in scorers."
        ),
    ] = []
    reward_kwargs: Annotated[
        dict[str, str | int | float | bool],
        Meta(
            description="Extra keyword arguments passed to every call (verl's custom_reward_function.reward_kwargs)."
        ),
    ] = {}


class RewardModelConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    path: Annotated[
        str,
        Meta(
            description="Reward-model folder (a Hugging Face AutoModelForSequenceClassification with one label, tokenizer included, as `fleetrl rm train` writes); empty = no model score. With urls empty, a fleet of num_engines servers is placed for it."
        ),
    ] = ""
    urls: Annotated[
        list[str],
        Meta(
            description="Reward servers already running (SGLang with --is-embedding, or `fleetrl engine`); path still names the model and its tokenizer. Empty = place a fleet."
        ),
    ] = []
    api_key_env: Annotated[
        str,
        Meta(
            description="Environment variable holding the bearer key of the servers in urls (the one `fleetrl engine` reads too; a placed fleet gets the run's own key)."
        ),
    ] = "FLEETRL_API_KEY"
    weight: Annotated[
        float, Meta(description="Weight of the model score in the sample's reward.")
    ] = 1.0
    backend: Annotated[
        Literal["auto", "embedded", "sglang"],
        Meta(
            description="Servers of a placed fleet: the embedded engine (CPU) or SGLang with --is-embedding (GPU); auto = rollout.backend."
        ),
    ] = "auto"
    num_engines: Annotated[
        int,
        Meta(ge=1, description="Reward-model servers placed (on nodes with ray.reward_resource)."),
    ] = 1
    min_engines: Annotated[
        int,
        Meta(
            ge=0,
            description="With rollout.elastic: the fewest reward servers (servers whose node left are not replaced down to this many). 0 = num_engines.",
        ),
    ] = 0
    max_engines: Annotated[
        int,
        Meta(
            ge=0,
            description="With rollout.elastic: the most reward servers, the top of `fleetrl fleet scale --reward-engines` and of the servers placed on reward nodes that join the cluster. 0 = num_engines.",
        ),
    ] = 0
    cpus_per_engine: Annotated[
        float, Meta(ge=0, description="Ray CPUs reserved per reward server.")
    ] = 1.0
    gpus_per_engine: Annotated[
        float, Meta(ge=0, description="Ray GPUs per reward server (SGLang tensor parallel size).")
    ] = 0.0
    mem_fraction_static: Annotated[
        float, Meta(gt=0, le=1, description="SGLang --mem-fraction-static of a reward server.")
    ] = 0.85
    sglang_extra_args: Annotated[
        list[str],
        Meta(description="Extra SGLang arguments for reward servers, appended verbatim."),
    ] = []
    max_length: Annotated[
        int,
        Meta(
            ge=0,
            description="Longest prompt + response the reward model reads, in its own tokens; longer inputs keep their last tokens (0 = the model's max_position_embeddings).",
        ),
    ] = 0
    apply_chat_template: Annotated[
        Literal["auto", "on", "off"],
        Meta(
            description="Render prompt + response with the reward model's own chat template (auto: when the prompt is chat messages and its tokenizer has a template)."
        ),
    ] = "auto"
    normalize: Annotated[
        bool,
        Meta(
            description="Standardise scores with the mean and std stored in the reward model's config (written by `fleetrl rm train`)."
        ),
    ] = True
    clip: Annotated[
        float,
        Meta(
            ge=0,
            description="Clip the (normalised) model score to [-clip, clip] (0 = no clip; OpenRLHF's default is 10).",
        ),
    ] = 10.0
    batch_size: Annotated[int, Meta(ge=1, description="Most texts in one /classify request.")] = 64
    request_timeout_s: Annotated[
        float, Meta(gt=0, description="Timeout of one /classify request.")
    ] = 60.0
    max_attempts: Annotated[
        int,
        Meta(
            ge=1,
            description="Attempts per batch across the servers (failover to the next one) before its samples fail.",
        ),
    ] = 4
    retry_backoff_s: Annotated[
        float, Meta(ge=0, description="Pause before a failed /classify is retried.")
    ] = 0.5

    @property
    def engine_range(self) -> tuple[int, int]:
        """(fewest, most) placed servers: ``min_engines`` and ``max_engines``, 0 read as
        ``num_engines``."""
        return engine_range(self.num_engines, self.min_engines, self.max_engines)

    def api_key(self, env: Mapping[str, str]) -> str | None:
        """The bearer key of the servers in ``urls``: ``env[api_key_env]`` (None: unset)."""
        return env.get(self.api_key_env) or None


class RewardConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    custom_function: CustomFunctionConfig = msgspec.field(default_factory=CustomFunctionConfig)
    rule_weight: Annotated[
        float,
        Meta(
            description="Weight of the rule score (custom function or built-in scorer); 0 with a reward model = the model alone (no rule scorer is needed then)."
        ),
    ] = 1.0
    model: RewardModelConfig = msgspec.field(default_factory=RewardModelConfig)
    max_failed_groups: Annotated[
        int,
        Meta(
            ge=0,
            description="Stop the run after this many groups in a row whose every sample's reward failed (the function raised, timed out or returned no number on all of them, or the reward servers could not score them): one line quoting the last error, exit status 1, a checkpoint written to resume from once the reward is fixed. A group with any sample scored ends the streak; each failed group is dropped and counted (reward/groups_failed). 0 = never stop.",
        ),
    ] = 200

    @property
    def uses_model(self) -> bool:
        return bool(self.model.path or self.model.urls)

    @property
    def places_fleet(self) -> bool:
        """Whether the run places reward servers of its own (a path, no urls)."""
        return bool(self.model.path) and not self.model.urls
