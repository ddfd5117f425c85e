"""The verl keys that rules read together (launcher/verl/translate.py), each with verl's
meaning: every rule key of the table has a case here, run through to the RunConfig."""

from __future__ import annotations

import pytest

from launcher.verl.load import TABLE, load_verl
from launcher.verl.translate import VerlRefused

BASE = ["actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]  # fmt: skip
A, RO, RC = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "algorithm.rollout_correction"
RM = ["reward_model.enable=true", "reward_model.model.path=/rm", "reward_model.rollout.name=sglang"]

# (verl overrides, the rule keys they exercise, {fleetrl key: value})
CASES = [
    (
        [f"{A}.optim.lr_warmup_steps_ratio=0.1"],
        [f"{A}.optim.lr_warmup_steps_ratio"],
        {"learner.optim.warmup_ratio": 0.1, "learner.optim.warmup_steps": 0},
    ),  # fmt: skip
    (
        [f"{A}.optim.lr_warmup_steps=7", f"{A}.optim.lr_warmup_steps_ratio=0.1"],
        [f"{A}.optim.lr_warmup_steps"],
        {"learner.optim.warmup_steps": 7, "learner.optim.warmup_ratio": 0.0},
    ),  # fmt: skip
    (
        ["critic.optim.lr_warmup_steps=3", "critic.optim.lr_warmup_steps_ratio=0.5"],
        ["critic.optim.lr_warmup_steps", "critic.optim.lr_warmup_steps_ratio"],
        {"learner.critic.optim.warmup_steps": 3},
    ),  # fmt: skip
    (["critic.optim.lr_warmup_steps_ratio=0.5"], [], {"learner.critic.optim.warmup_ratio": 0.5}),
    (
        [f"{A}.optim.lr_scheduler_type=cosine", "critic.optim.lr_scheduler_type=cosine"],
        [f"{A}.optim.lr_scheduler_type", "critic.optim.lr_scheduler_type"],
        {"learner.optim.schedule": "cosine", "learner.critic.optim.schedule": "cosine"},
    ),  # fmt: skip
    (
        [f"{A}.optim.warmup_style=cosine", "critic.optim.warmup_style=cosine"],
        [f"{A}.optim.warmup_style", "critic.optim.warmup_style"],
        {"learner.optim.schedule": "cosine", "learner.critic.optim.schedule": "cosine"},
    ),  # fmt: skip
    (
        [f"{A}.optim.clip_grad=0.5", "critic.optim.clip_grad=0.7"],
        [f"{A}.optim.clip_grad", "critic.optim.clip_grad"],
        {"learner.optim.grad_clip": 0.5, "learner.critic.optim.grad_clip": 0.7},
    ),  # fmt: skip
    (
        [f"{A}.grad_clip=0.3", f"{A}.optim.clip_grad=0.5", "critic.grad_clip=0.4"],
        [f"{A}.grad_clip", "critic.grad_clip"],
        {"learner.optim.grad_clip": 0.3, "learner.critic.optim.grad_clip": 0.4},
    ),  # fmt: skip
    (
        [f"{A}.fsdp_config.dtype=float32"],
        [f"{A}.fsdp_config.dtype"],
        {"learner.mixed_precision": "fp32"},
    ),  # fmt: skip
    (
        [
            f"{A}.ppo_micro_batch_size_per_gpu=null",
            f"{A}.ppo_micro_batch_size=8",
            "learner.num_ranks=4",
        ],
        [f"{A}.ppo_micro_batch_size"],
        {"learner.micro_batch_size": 2},
    ),  # fmt: skip
    (
        [f"{A}.ppo_micro_batch_size_per_gpu=3"],
        [f"{A}.ppo_micro_batch_size_per_gpu"],
        {"learner.micro_batch_size": 3},
    ),  # fmt: skip
    (
        [f"{A}.clip_ratio=0.3", f"{A}.clip_ratio_low=null"],
        [f"{A}.clip_ratio", f"{A}.clip_ratio_low"],
        {"learner.policy_loss.clip_ratio_low": 0.3, "learner.policy_loss.clip_ratio_high": 0.2},
    ),  # fmt: skip
    (
        [f"{A}.clip_ratio_high=0.28"],
        [f"{A}.clip_ratio_high"],
        {"learner.policy_loss.clip_ratio_high": 0.28},
    ),  # fmt: skip
    (
        [
            f"{RO}.expert_parallel_size=4",
            f"{RO}.max_model_len=4096",
            f"{RO}.enable_prefix_caching=false",
            f"{RO}.engine_kwargs.sglang.attention_backend=fa3",
        ],
        [f"{RO}.expert_parallel_size", f"{RO}.max_model_len", f"{RO}.enable_prefix_caching"],
        {
            "rollout.sglang_extra_args": [
                "--attention-backend",
                "fa3",
                "--ep-size",
                "4",
                "--context-length",
                "4096",
                "--disable-radix-cache",
            ]
        },
    ),  # fmt: skip
    (
        [f"{RO}.val_kwargs.do_sample=true", f"{RO}.val_kwargs.temperature=0.6"],
        [f"{RO}.val_kwargs.do_sample", f"{RO}.val_kwargs.temperature"],
        {"rollout.val_temperature": 0.6},
    ),  # fmt: skip
    (
        [f"{RO}.val_kwargs.temperature=0.6"],
        [],
        {"rollout.val_temperature": 0.0},
    ),  # do_sample false: greedy
    (
        ["data.max_response_length=300"],
        ["data.max_response_length"],
        {"rollout.max_new_tokens": 300},
    ),  # fmt: skip
    (
        ["data.max_response_length=300", f"{RO}.response_length=200"],
        [],
        {"rollout.max_new_tokens": 200},
    ),  # fmt: skip
    (
        ["data.filter_overlong_prompts=true"],
        ["data.filter_overlong_prompts"],
        {"data.truncation": "filter"},
    ),  # fmt: skip
    (["data.truncation=left"], ["data.truncation"], {"data.truncation": "left"}),
    (
        ["critic.model.path=~/critic", "actor_rollout_ref.model.path=/policy"],
        ["critic.model.path"],
        {"learner.critic.model_path": "~/critic"},
    ),  # fmt: skip
    (
        ["critic.model.path=/policy", "actor_rollout_ref.model.path=/policy"],
        [],
        {"learner.critic.model_path": ""},
    ),  # fmt: skip
    (
        ["critic.enable=false", "algorithm.adv_estimator=grpo"],
        ["critic.enable"],
        {"learner.critic.enabled": "off"},
    ),  # fmt: skip
    (
        ["critic.enable=true", "algorithm.adv_estimator=grpo", "critic.model.path=/c"],
        [],
        {"learner.critic.enabled": "on", "learner.critic.model_path": "/c"},
    ),  # fmt: skip
    (
        [f"{A}.ppo_mini_batch_size=32", f"{A}.ppo_epochs=2", f"{A}.use_dynamic_bsz=true"],
        ["critic.ppo_mini_batch_size", "critic.ppo_epochs", "critic.use_dynamic_bsz"],
        {
            "learner.ppo_mini_batch_size": 32,
            "learner.ppo_epochs": 2,
            "learner.use_dynamic_bsz": True,
        },
    ),  # fmt: skip
    (
        [
            *RM,
            "reward_model.rollout.tensor_model_parallel_size=1",
            "reward_model.rollout.gpu_memory_utilization=0.3",
        ],
        [
            "reward_model.enable",
            "reward_model.model.path",
            "reward_model.rollout.name",
            "reward_model.rollout.tensor_model_parallel_size",
            "reward_model.rollout.gpu_memory_utilization",
        ],
        {
            "reward.model.path": "/rm",
            "reward.model.backend": "sglang",
            "reward.model.num_engines": 1,
            "reward.model.gpus_per_engine": 1,
            "reward.model.mem_fraction_static": 0.3,
            "learner.num_ranks": 5,
            "rollout.num_engines": 1,
        },
    ),  # fmt: skip
    (
        [
            *RM,
            "reward_model.enable_resource_pool=true",
            "reward_model.n_gpus_per_node=4",
            "reward_model.nnodes=1",
        ],
        [
            "reward_model.enable_resource_pool",
            "reward_model.n_gpus_per_node",
            "reward_model.nnodes",
        ],
        {"reward.model.num_engines": 2, "learner.num_ranks": 4, "rollout.num_engines": 2},
    ),  # fmt: skip
    (
        [
            "reward_model.overlong_buffer.enable=true",
            "reward_model.overlong_buffer.len=64",
            "reward_model.overlong_buffer.penalty_factor=0.5",
            "algorithm.filter_groups.enable=true",
            f"{RO}.n=4",
        ],
        [
            "reward_model.overlong_buffer.enable",
            "reward_model.overlong_buffer.len",
            "reward_model.overlong_buffer.penalty_factor",
            "algorithm.filter_groups.enable",
        ],
        {
            "learner.algorithm.overlong_buffer_len": 64,
            "learner.algorithm.overlong_penalty_factor": 0.5,
            "buffer.filter_equal_scores": True,
        },
    ),  # fmt: skip
    (
        [f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=3.0"],
        [f"{RC}.rollout_is", f"{RC}.rollout_is_threshold"],
        {"learner.correction.mode": "token_tis", "learner.correction.is_cap": 3.0},
    ),  # fmt: skip
    ([f"{RC}.rollout_is=sequence"], [], {"learner.correction.mode": "seq_tis"}),
    (
        [f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold=0.5_1.5"],
        [f"{RC}.rollout_rs", f"{RC}.rollout_rs_threshold"],
        {
            "learner.correction.mode": "token_mis",
            "learner.correction.is_low": 0.5,
            "learner.correction.is_high": 1.5,
        },
    ),  # fmt: skip
    (
        [f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold=4"],
        [],
        {"learner.correction.is_low": 0.25, "learner.correction.is_high": 4.0},
    ),  # fmt: skip
    ([f"{RC}.bypass_mode=true"], [f"{RC}.bypass_mode"], {"learner.correction.mode": "bypass"}),
    ([], [], {"learner.correction.mode": "decoupled"}),  # verl's default: none; fleetrl's default
    (["trainer.total_epochs=3"], ["trainer.total_epochs"], {"trainer.total_epochs": 3}),
    (
        ["trainer.total_training_steps=50"],
        ["trainer.total_training_steps"],
        {"trainer.total_steps": 50, "trainer.total_epochs": 0},
    ),  # fmt: skip
    (
        ["trainer.logger=[console,mlflow,tensorboard]"],
        ["trainer.logger"],
        {"logging.wandb": False, "logging.mlflow": True, "logging.tensorboard": True},
    ),  # fmt: skip
    (["trainer.logger=wandb"], [], {"logging.wandb": True, "logging.mlflow": False}),
    (
        ["trainer.n_gpus_per_node=4", "trainer.nnodes=2", f"{RO}.tensor_model_parallel_size=4"],
        ["trainer.n_gpus_per_node", "trainer.nnodes", f"{RO}.tensor_model_parallel_size"],
        {"learner.num_ranks": 4, "rollout.num_engines": 1, "rollout.gpus_per_engine": 4.0},
    ),  # fmt: skip
    (
        [
            "trainer.n_gpus_per_node=1",
            f"{RO}.tensor_model_parallel_size=1",
            f"{RO}.gpu_memory_utilization=0.4",
        ],
        ["actor_rollout_ref.hybrid_engine"],
        {
            "learner.num_ranks": 1,
            "learner.gpus_per_rank": 0.5,
            "rollout.gpus_per_engine": 0.5,
            "weight_sync.backend": "gloo",
            "rollout.mem_fraction_static": 0.4,
        },
    ),  # fmt: skip
    (
        [f"{RO}.gpu_memory_utilization=0.6"],
        [f"{RO}.gpu_memory_utilization"],
        {"rollout.backend": "sglang", "rollout.mem_fraction_static": 0.6},
    ),  # SGLang's fraction: its static pool
    (
        [f"{RO}.name=vllm", f"{RO}.gpu_memory_utilization=0.6"],
        [f"{RO}.gpu_memory_utilization"],
        {
            "rollout.backend": "vllm",
            "rollout.gpu_memory_utilization": 0.6,
            "rollout.mem_fraction_static": 0.85,
        },
    ),  # fmt: skip
    (
        ["learner.num_ranks=6"],
        [],
        {"learner.num_ranks": 6, "rollout.num_engines": 1},
    ),  # the user's split
    (["rollout.num_engines=3"], [], {"learner.num_ranks": 2, "rollout.num_engines": 3}),
    (
        ["trainer.resume_mode=resume_path", "trainer.resume_from_path=~/runs/a/checkpoints/step_4"],
        ["trainer.resume_mode", "trainer.resume_from_path"],
        {"trainer.resume": "auto", "trainer.resume_from_path": "~/runs/a/checkpoints/step_4"},
    ),  # fmt: skip
    (
        ["trainer.resume_mode=disable"],
        [],
        {"trainer.resume": "disable", "trainer.resume_from_path": ""},
    ),  # fmt: skip
    (["trainer.critic_warmup=3"], ["trainer.critic_warmup"], {"learner.critic.warmup_steps": 2}),
    (
        ["trainer.max_actor_ckpt_to_keep=3", "trainer.max_critic_ckpt_to_keep=5"],
        ["trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep"],
        {"trainer.keep_checkpoints": 5},
    ),  # fmt: skip
    (
        ["trainer.save_freq=-1", "trainer.test_freq=0"],
        [],
        {"trainer.save_freq": 0, "trainer.test_freq": -1},
    ),  # fmt: skip
]


def _value(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return list(cfg) if isinstance(cfg, tuple) else cfg


@pytest.mark.parametrize(("overrides", "_keys", "expected"), CASES)
def test_a_rule_key_sets_what_verl_means(overrides, _keys, expected):
    cfg = load_verl({}, BASE + overrides).run_config()
    for dotted, value in expected.items():
        got = _value(cfg, dotted)
        if isinstance(value, str) and value.startswith("~"):
            value = str(__import__("os").path.expanduser(value))
        assert got == value, f"{dotted}: {got!r} != {value!r} (from {overrides})"


def test_every_rule_key_of_the_table_has_a_case():
    covered = {key for _, keys, _ in CASES for key in keys} | {f"{RO}.name"}
    rules = {k.path for k in TABLE.keys if k.kind == "rule"}
    assert rules - covered == set()


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ([f"{RO}.name=hf"], f"{RO}.name: got 'hf'; set sglang or vllm"),
        ([f"{A}.strategy=megatron"], f"{A}.strategy: got 'megatron'"),
        (["algorithm.adv_estimator=remax"], "algorithm.adv_estimator: got 'remax'"),
        (["trainer.device=npu"], "trainer.device: got 'npu'; set cuda"),
        (["trainer.logger=[console,swanlab]"], "trainer.logger"),
        ([f"{RC}.rollout_is=token", f"{RC}.bypass_mode=true"], f"{RC}.rollout_is"),
        (["critic.ppo_epochs=2"], "critic.ppo_epochs: got 2; set it to the actor's 1"),
        (["trainer.resume_mode=resume_path"], "trainer.resume_from_path: got None"),
        (
            ["trainer.n_gpus_per_node=2", f"{RO}.tensor_model_parallel_size=2"],
            "trainer.n_gpus_per_node: got 2",
        ),  # fmt: skip
        ([*RM[:2], "reward_model.rollout.name=vllm"], "reward_model.rollout.name: got 'vllm'"),
        (
            [f"{RO}.name=vllm", "trainer.n_gpus_per_node=1", f"{RO}.tensor_model_parallel_size=1"],
            "trainer.n_gpus_per_node: got 1; set 2 or more GPUs: vLLM engines take weights over NCCL",
        ),  # fmt: skip
        (["data.custom_cls.path=/my_dataset.py"], "data.custom_cls.path"),
        (
            ["actor_rollout_ref.actr.optim.lr=1"],
            "actor_rollout_ref.actr.optim.lr: not a key of verl's",
        ),
    ],
)
def test_a_value_fleetrl_cannot_honour_is_refused_naming_the_key_and_the_fix(overrides, named):
    with pytest.raises(VerlRefused) as refused:
        load_verl({}, BASE + overrides).run_config()
    assert any(named in line for line in refused.value.lines), refused.value.lines


# verl's deprecated global (all-GPU) micro-batch sizes
DEPRECATED_GLOBAL = sorted(
    k.path for k in TABLE.keys if k.path.endswith("micro_batch_size") and "*" not in k.path
)


def test_every_deprecated_global_size_of_verl_is_known():
    assert [
        f"{A}.ppo_micro_batch_size",
        f"{RO}.log_prob_micro_batch_size",
        "critic.forward_micro_batch_size",
        "critic.ppo_micro_batch_size",
        "reward_model.micro_batch_size",
    ] == DEPRECATED_GLOBAL


@pytest.mark.parametrize("key", DEPRECATED_GLOBAL)
def test_a_deprecated_global_size_is_divided_by_the_final_learner_ranks(key):
    """verl's default GPU split (8 GPUs, rollout TP 2: 4 learner ranks) is decided before
    the global micro-batch of 64 is divided: 16 sequences per rank, as verl's 64 over its
    data-parallel ranks; a global size fleetrl does not read is named as such."""
    per_gpu = [f"{A}.ppo_micro_batch_size_per_gpu=null", f"{A}.ppo_micro_batch_size=64"]
    mine = per_gpu if key.startswith(A) else [*BASE[1:], f"{key}=64"]
    loaded = load_verl({}, [*BASE[:1], *mine])
    cfg = loaded.run_config()
    assert cfg.learner.num_ranks == 4
    if key.startswith(A):
        assert cfg.learner.micro_batch_size == 64 // 4
    else:
        assert cfg.learner.micro_batch_size == 2  # BASE's per-GPU size: untouched
        assert any(line.startswith(f"{key}=64 has no effect") for line in loaded.notes)
    with_sp = load_verl({}, [*BASE[:1], *per_gpu, f"{A}.ulysses_sequence_parallel_size=2"])
    assert with_sp.run_config().learner.micro_batch_size == 64 // 2  # 2 data-parallel groups


def test_reward_model_enable_scores_with_the_model_alone_raw_unless_the_file_asks():
    cfg = load_verl({}, BASE + RM).run_config()
    assert (cfg.reward.rule_weight, cfg.reward.model.normalize, cfg.reward.model.clip) == (0, False, 0)  # fmt: skip
    asked = {"fleetrl": {"reward": {"rule_weight": 0.5, "model": {"normalize": True}}}}
    cfg = load_verl(asked, BASE + RM).run_config()
    assert (cfg.reward.rule_weight, cfg.reward.model.normalize) == (0.5, True)
