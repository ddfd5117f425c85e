"""Cross-section rules of the run config, checked once at load (``validate_run``).

Each field is checked by its own struct (type, range, accepted values); the rules
here tie fields of different sections together: combinations that every field
accepts on its own but that the run would hit late, as a stall or an error
inside a Ray actor minutes after the start. Each rule refuses with a
``ConfigError`` whose one line names the key, the key it conflicts with, the
values given, why, and the fix; the CLI turns it into exit status 2.

Left out: what depends on the machine (CUDA present, free disk, credentials:
``launcher.preflight``) and on files (the model folder's real context length:
a folder given by ``model.path`` is read by the engine, which refuses an
over-long request with a message naming both numbers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from fleetrl.config import ConfigError, raise_all
from launcher.config import RunConfig
from learner.config import MIS_MODES

Rule = Callable[[RunConfig], Iterator[ConfigError]]
RULES: list[Rule] = []  # checked whenever a run config is loaded
TRAINING_RULES: list[Rule] = []  # checked too before `fleetrl train` starts anything


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def training_rule(fn: Rule) -> Rule:
    TRAINING_RULES.append(fn)
    return fn


def refuse(key: str, other: str, got: str, why: str) -> ConfigError:
    """``config error at <key> (with <other>): got <got>; <why>``."""
    return ConfigError(f"{key} (with {other})", f"got {got}; {why}")


def validate_run(cfg: RunConfig, *, training: bool = False) -> RunConfig:
    """Return ``cfg``, or raise every cross-section problem at once (``ConfigErrors``, which
    carries ``cfg``: preflight checks it too and reports everything in one go).

    ``training`` adds the rules only a training run needs (``config show`` of a
    partial config stays possible).
    """
    problems = [p for check in RULES + (TRAINING_RULES if training else []) for p in check(cfg)]
    raise_all(problems, config=cfg)
    return cfg


@rule
def capacity_holds_a_batch(cfg: RunConfig) -> Iterator[ConfigError]:
    # the store stops reading trajectories at capacity, and a step waits for
    # train_batch_size whole groups: with fewer slots the learner waits forever
    cap, batch = cfg.buffer.capacity_groups, cfg.data.train_batch_size
    if cap < batch:
        yield refuse(
            "buffer.capacity_groups",
            "data.train_batch_size",
            f"{cap} < {batch} groups",
            "the buffer blocks producers before it holds one batch, so the run stalls; "
            f"set buffer.capacity_groups >= {batch}",
        )


@rule
def gae_has_a_critic(cfg: RunConfig) -> Iterator[ConfigError]:
    learner = cfg.learner
    if learner.algorithm.adv_estimator == "gae" and learner.critic.enabled == "off":
        yield refuse(
            "learner.critic.enabled",
            "learner.algorithm.adv_estimator",
            "'off' with 'gae'",
            "GAE needs value estimates from a critic; "
            "set learner.critic.enabled to auto or on, or pick grpo/rloo",
        )


@rule
def critic_init_from_has_a_critic(cfg: RunConfig) -> Iterator[ConfigError]:
    critic = cfg.learner.critic
    builds_critic = critic.enabled == "on" or (
        critic.enabled == "auto" and cfg.learner.algorithm.adv_estimator == "gae"
    )
    if critic.init_from and not builds_critic:
        yield refuse(
            "learner.critic.init_from",
            "learner.critic.enabled",
            f"{critic.init_from!r} with enabled={critic.enabled!r} and adv_estimator="
            f"{cfg.learner.algorithm.adv_estimator!r}",
            "no critic is built, so nothing starts from the reward model; use "
            "adv_estimator=gae or critic.enabled=on, or leave init_from empty",
        )


@training_rule
def critic_init_from_is_a_reward_model(cfg: RunConfig) -> Iterator[ConfigError]:
    from fleetrl.models.reward_folder import RewardFolderError, check_reward_folder

    if cfg.learner.critic.init_from:
        try:
            check_reward_folder(cfg.learner.critic.init_from)
        except RewardFolderError as err:
            yield ConfigError("learner.critic.init_from", str(err))


@rule
def context_fits_prompt_and_response(cfg: RunConfig) -> Iterator[ConfigError]:
    # the tiny model built for the run has tiny.max_positions; every request with
    # prompt + max_new_tokens beyond it is refused by the engine, sample by sample
    if not cfg.model.create_tiny:
        return
    need = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    have = cfg.model.tiny.max_positions
    if need > have:
        yield refuse(
            "model.tiny.max_positions",
            "data.max_prompt_length + rollout.max_new_tokens",
            f"{have} < {cfg.data.max_prompt_length} + {cfg.rollout.max_new_tokens}",
            "the engine refuses every request longer than the model's context; raise "
            f"model.tiny.max_positions to >= {need} or lower the other two",
        )


@rule
def nccl_needs_cuda(cfg: RunConfig) -> Iterator[ConfigError]:
    if cfg.weight_sync.backend == "nccl" and cfg.trainer.device == "cpu":
        yield refuse(
            "weight_sync.backend",
            "trainer.device",
            "'nccl' with 'cpu'",
            "NCCL broadcasts CUDA tensors only; set weight_sync.backend=gloo (or auto)",
        )


@rule
def gpu_servers_need_a_gpu(cfg: RunConfig) -> Iterator[ConfigError]:
    """GPU servers (SGLang, vLLM) on GPUs; co-located only where they take a push by handle."""
    from rollout_fleet.engine_kinds import engine_kind, server_backends

    rollout = cfg.rollout
    kind = engine_kind(rollout.backend)
    if not kind.gpu_server:
        return
    if cfg.trainer.device == "cpu":
        yield refuse(
            "rollout.backend",
            "trainer.device",
            f"'{rollout.backend}' with 'cpu'",
            f"{kind.label} servers run on GPUs; use rollout.backend=embedded on CPU",
        )
    if rollout.gpus_per_engine <= 0:
        yield refuse(
            "rollout.gpus_per_engine",
            "rollout.backend",
            f"{rollout.gpus_per_engine} with '{rollout.backend}'",
            f"a {kind.label} engine needs a GPU share; set rollout.gpus_per_engine > 0 "
            "(its tensor-parallel size when >= 1)",
        )
    if rollout.colocated and not kind.by_handle:
        others = [b for b in server_backends() if engine_kind(b).by_handle]
        yield refuse(
            "rollout.placement",
            "rollout.backend",
            f"'colocated' with '{rollout.backend}'",
            f"co-located engines take each version by handle, which fleetrl does not do with "
            f"{kind.label}; use rollout.placement=disaggregated with {kind.label} "
            f"(or rollout.backend={' or '.join(others)})",
        )


@rule
def the_engines_receive_on_the_sync_backend(cfg: RunConfig) -> Iterator[ConfigError]:
    """A broadcast the engines' ranks can receive (vLLM's workers take NCCL only, from a learner
    on a GPU of its own)."""
    from rollout_fleet.engine_kinds import engine_kind

    kind = engine_kind(cfg.rollout.backend)
    if "gloo" in kind.sync_backends or cfg.trainer.device == "cpu":
        return  # a CPU learner with GPU servers: gpu_servers_need_a_gpu says it
    wanted = " or ".join(kind.sync_backends)
    if cfg.weight_sync.backend == "gloo":
        yield refuse(
            "weight_sync.backend",
            "rollout.backend",
            f"'gloo' with '{cfg.rollout.backend}'",
            f"{kind.label}'s workers receive weights over {wanted} only; "
            "set weight_sync.backend=auto (or nccl)",
        )
    elif cfg.learner.gpus_per_rank <= 0:
        yield refuse(
            "learner.gpus_per_rank",
            "rollout.backend",
            f"{cfg.learner.gpus_per_rank} with '{cfg.rollout.backend}'",
            f"{kind.label}'s workers receive weights over {wanted}, from a learner on a GPU; "
            "set learner.gpus_per_rank > 0",
        )


@rule
def sglang_reward_servers_need_a_gpu(cfg: RunConfig) -> Iterator[ConfigError]:
    from rollout_fleet.engine_kinds import engine_kind
    from rollout_fleet.rewards.fleet import reward_backend

    model = cfg.reward.model
    if not cfg.reward.places_fleet or not engine_kind(reward_backend(model, cfg.rollout)).gpu_server:  # fmt: skip
        return
    if model.gpus_per_engine <= 0:
        yield refuse(
            "reward.model.gpus_per_engine",
            "reward.model.backend",
            f"{model.gpus_per_engine} with 'sglang' ({model.backend})",
            "an SGLang reward server runs on a GPU; set reward.model.gpus_per_engine > 0 "
            "(its tensor-parallel size when >= 1), or reward.model.backend=embedded",
        )


@rule
def cuda_learner_gets_a_gpu(cfg: RunConfig) -> Iterator[ConfigError]:
    # Ray hides every GPU from an actor that reserved none: CUDA fails inside it
    if cfg.trainer.device == "cuda" and cfg.learner.gpus_per_rank <= 0:
        yield refuse(
            "learner.gpus_per_rank",
            "trainer.device",
            "0 with 'cuda'",
            "Ray shows no GPU to a learner rank that reserved none; "
            "set learner.gpus_per_rank > 0 (e.g. 1)",
        )


@rule
def equal_score_filter_has_groups(cfg: RunConfig) -> Iterator[ConfigError]:
    # a group of one sample always has equal scores: every group would be dropped
    if cfg.buffer.filter_equal_scores and cfg.rollout.n < 2:
        yield refuse(
            "buffer.filter_equal_scores",
            "rollout.n",
            f"true with n={cfg.rollout.n}",
            "every group of one sample has equal scores, so all are dropped and the run "
            "stalls; set rollout.n >= 2 or buffer.filter_equal_scores=false",
        )


@rule
def overlong_buffer_fits_the_response_cap(cfg: RunConfig) -> Iterator[ConfigError]:
    buffer_len = cfg.learner.algorithm.overlong_buffer_len
    if buffer_len and buffer_len >= cfg.rollout.max_new_tokens:
        yield refuse(
            "learner.algorithm.overlong_buffer_len",
            "rollout.max_new_tokens",
            f"{buffer_len} >= {cfg.rollout.max_new_tokens}",
            "the punishment starts max_new_tokens - overlong_buffer_len tokens in, so the"
            " buffer must be shorter than the cap (DAPO: 4096 of 20480)",
        )


@rule
def masked_is_window_is_open(cfg: RunConfig) -> Iterator[ConfigError]:
    corr = cfg.learner.correction
    if corr.mode in MIS_MODES and corr.is_low >= corr.is_high:
        yield refuse(
            "learner.correction.is_low",
            "learner.correction.is_high",
            f"{corr.is_low} >= {corr.is_high} with mode {corr.mode!r}",
            "masked IS keeps weights inside [is_low, is_high], so every token would be "
            "masked; set is_low < is_high",
        )


@rule
def multi_turn_prompts_are_chat_rendered(cfg: RunConfig) -> Iterator[ConfigError]:
    # the environment's replies are appended as chat-template deltas over the prompt's
    # rendering: a prompt of joined contents has no template rendering to extend
    if cfg.rollout.multi_turn.enabled and not cfg.data.apply_chat_template:
        yield refuse(
            "rollout.multi_turn.env",
            "data.apply_chat_template",
            f"{cfg.rollout.multi_turn.env!r} with false",
            "environment replies are tokenized as the chat template renders them after the "
            "prompt, so the prompt must be chat-rendered too; set data.apply_chat_template=true",
        )


@rule
def agent_rollouts_are_chat_rendered(cfg: RunConfig) -> Iterator[ConfigError]:
    # an agent's calls are chat messages the gateway renders with the template; a
    # conversation is either an environment's (multi_turn) or the agent's, not both
    agent = cfg.rollout.agent
    if agent.enabled and cfg.rollout.multi_turn.enabled:
        yield refuse(
            "rollout.agent.entrypoint",
            "rollout.multi_turn.env",
            f"{agent.entrypoint!r} with {cfg.rollout.multi_turn.env!r}",
            "an episode is the agent's conversation; set one of them",
        )
    if agent.enabled and not cfg.data.apply_chat_template:
        yield refuse(
            "rollout.agent.entrypoint",
            "data.apply_chat_template",
            f"{agent.entrypoint!r} with false",
            "the gateway renders every call with the chat template, as the reader renders "
            "prompts; set data.apply_chat_template=true",
        )


@training_rule
def data_to_train_on(cfg: RunConfig) -> Iterator[ConfigError]:
    data = cfg.data
    if not data.train_files:
        yield ConfigError(
            "data.train_files",
            "got []; the fleet has no prompts to generate from; give Parquet files "
            "(verl schema), or one file path with data.synth_task to generate it",
        )
    elif data.synth_task and (len(data.train_files) != 1 or len(data.val_files) > 1):
        yield refuse(
            "data.train_files",
            "data.synth_task",
            f"{len(data.train_files)} train and {len(data.val_files)} val files",
            "a synthetic task is written to one train file and at most one val file",
        )


@rule
def reward_has_a_source(cfg: RunConfig) -> Iterator[ConfigError]:
    reward = cfg.reward
    if reward.rule_weight == 0 and not reward.uses_model:
        yield refuse(
            "reward.rule_weight",
            "reward.model",
            "0 without reward.model.path or reward.model.urls",
            "every reward would be 0, so nothing is learned; give a reward model or a "
            "non-zero reward.rule_weight",
        )


@rule
def critic_warmup_has_a_critic(cfg: RunConfig) -> Iterator[ConfigError]:
    learner = cfg.learner
    critic_on = learner.critic.enabled == "on" or (
        learner.critic.enabled == "auto" and learner.algorithm.adv_estimator == "gae"
    )
    if learner.critic.warmup_steps and not critic_on:
        yield refuse(
            "learner.critic.warmup_steps",
            "learner.algorithm.adv_estimator",
            f"{learner.critic.warmup_steps} without a critic "
            f"({learner.algorithm.adv_estimator!r}, critic {learner.critic.enabled!r})",
            "the warm-up trains only the critic, so without one no step would train; "
            "set it to 0, or use gae (or learner.critic.enabled=on)",
        )


@rule
def reward_model_urls_name_their_model(cfg: RunConfig) -> Iterator[ConfigError]:
    # the scorer re-renders prompt + response with the reward model's own tokenizer and
    # chat template: it reads them from the folder
    model = cfg.reward.model
    if model.urls and not model.path:
        yield refuse(
            "reward.model.path",
            "reward.model.urls",
            f"'' with {len(model.urls)} server URLs",
            "the reward model's inputs are built with its own tokenizer and chat template; "
            "set reward.model.path to the folder the servers serve (its tokenizer is read)",
        )


@rule
def custom_reward_sources_are_patterns(cfg: RunConfig) -> Iterator[ConfigError]:
    custom = cfg.reward.custom_function
    for i, pattern in enumerate(custom.data_sources):
        if not pattern or "*" in pattern[:-1]:
            yield ConfigError(
                f"reward.custom_function.data_sources[{i}]",
                f"got {pattern!r}; give a data_source name, or a prefix ending in one '*'",
            )
    if custom.data_sources and not custom.path:
        yield refuse(
            "reward.custom_function.data_sources",
            "reward.custom_function.path",
            f"{custom.data_sources} with no path",
            "the data sources a custom function claims need the function: set "
            "reward.custom_function.path",
        )


@rule
def colocated_engines_pair_with_learner_ranks(cfg: RunConfig) -> Iterator[ConfigError]:
    # engine i lives in learner rank i's bundle and is pushed to by that rank
    rollout, ranks = cfg.rollout, cfg.learner.num_ranks
    if not rollout.colocated:
        return
    remote = rollout.colocate.remote_engines
    if rollout.colocated_engines != ranks:
        yield refuse(
            "rollout.num_engines",
            "learner.num_ranks",
            f"{rollout.num_engines} - {remote} remote != {ranks} with rollout.placement=colocated",
            "a co-located run puts one engine on each learner device (and "
            "rollout.colocate.remote_engines more on rollout nodes); set "
            f"rollout.num_engines={ranks + remote}",
        )
    if rollout.tp_size > 1:
        yield refuse(
            "rollout.gpus_per_engine",
            "rollout.placement",
            f"{rollout.gpus_per_engine} (tensor parallel {rollout.tp_size}) with 'colocated'",
            "co-located engines are one device each (each learner rank pushes to the engine on "
            "its own device); set rollout.gpus_per_engine=1 or rollout.placement=disaggregated",
        )
    if cfg.learner.gpus_per_rank not in (0, 1):
        yield refuse(
            "learner.gpus_per_rank",
            "rollout.placement",
            f"{cfg.learner.gpus_per_rank} with 'colocated'",
            "a learner rank and its engine share exactly one device; set learner.gpus_per_rank=1 "
            "(or 0 on CPU)",
        )
    if "kv_cache" not in rollout.colocate.release:
        yield refuse(
            "rollout.colocate.release",
            "rollout.placement",
            f"{list(rollout.colocate.release)} with 'colocated'",
            "the engines' KV cache is what the learner's step needs freed first; add kv_cache",
        )


@rule
def one_warmup_length(cfg: RunConfig) -> Iterator[ConfigError]:
    for section in ("learner.optim", "learner.critic.optim"):
        optim = cfg.learner.optim if section == "learner.optim" else cfg.learner.critic.optim
        if optim.warmup_steps and optim.warmup_ratio:
            yield refuse(
                f"{section}.warmup_ratio",
                f"{section}.warmup_steps",
                f"{optim.warmup_ratio} with {optim.warmup_steps}",
                "give the warm-up once: as steps or as a fraction of the run",
            )


@rule
def profiled_steps_are_steps(cfg: RunConfig) -> Iterator[ConfigError]:
    steps = cfg.trainer.profile_steps
    if any(step < 1 for step in steps):
        yield ConfigError(
            "trainer.profile_steps", f"got {steps}; steps count from 1 (the first step is 1)"
        )


@rule
def colocated_engines_get_weights_after_every_step(cfg: RunConfig) -> Iterator[ConfigError]:
    if not cfg.rollout.colocated:
        return
    if cfg.weight_sync.sync_every != 1:
        yield refuse(
            "weight_sync.sync_every",
            "rollout.placement",
            f"{cfg.weight_sync.sync_every} with 'colocated'",
            "co-located engines release their memory for every learner step and take it back "
            "with the publish that follows it; set weight_sync.sync_every=1",
        )
    if cfg.learner.lora.rank > 0:
        yield refuse(
            "learner.lora.rank",
            "rollout.placement",
            f"{cfg.learner.lora.rank} with 'colocated'",
            "the LoRA sync sends adapters only, so base weights an engine released for the step "
            "could not be restored; set learner.lora.rank=0 or rollout.placement=disaggregated",
        )


@rule
def elastic_fleets_have_a_range(cfg: RunConfig) -> Iterator[ConfigError]:
    # the start size lies inside the range; a range needs rollout.elastic, and only fleets
    # placed on nodes of their own can follow the cluster
    rollout, model = cfg.rollout, cfg.reward.model
    fleets = [("rollout", rollout.num_engines, rollout.min_engines, rollout.max_engines)]
    if cfg.reward.places_fleet:
        fleets.append(("reward.model", model.num_engines, model.min_engines, model.max_engines))
    elif model.min_engines or model.max_engines:
        yield refuse(
            "reward.model.max_engines" if model.max_engines else "reward.model.min_engines",
            "reward.model.path",
            f"a range with reward.model.urls={model.urls} or no path",
            "only a reward fleet the run places (reward.model.path, no urls) can grow or "
            "shrink; leave min_engines and max_engines at 0",
        )
    for section, start, low, high in fleets:
        fewest, most = low or start, high or start
        if fewest > start:
            yield refuse(
                f"{section}.min_engines",
                f"{section}.num_engines",
                f"{fewest} > {start}",
                f"the fleet starts with num_engines, inside the range; set {section}.min_engines "
                f"<= {start}",
            )
        if most < start:
            yield refuse(
                f"{section}.max_engines",
                f"{section}.num_engines",
                f"{most} < {start}",
                f"the fleet starts with num_engines, inside the range; set {section}.max_engines "
                f">= {start}",
            )
        if (fewest, most) != (start, start) and not rollout.elastic:
            yield refuse(
                f"{section}.max_engines" if most != start else f"{section}.min_engines",
                "rollout.elastic",
                f"{fewest}..{most} engines with elastic=false",
                "a fleet size that changes while the run trains needs rollout.elastic=true "
                "(or leave min_engines and max_engines at 0)",
            )
    if rollout.elastic and rollout.colocated:
        yield refuse(
            "rollout.elastic",
            "rollout.placement",
            "true with 'colocated'",
            "co-located engines are one per learner rank, on its device: their number is the "
            "learner's; set rollout.placement=disaggregated or rollout.elastic=false",
        )
