"""The vs-trl suite's pieces that need neither TRL nor a run: the config mapping onto TRL's
GRPOConfig, the refusals, the ratios, and the one line when TRL is missing."""

from __future__ import annotations

import pytest

from bench import trl_grpo, vs_trl
from bench.vs_trl_regimes import DEMO, DEMO_CONFIG, GENERATION_BOUND, GENERATION_EVAL_CAP, regime
from launcher.config import load_run_config


def _demo(*overrides: str):
    return load_run_config(DEMO_CONFIG, list(overrides))


def test_the_demo_config_maps_key_for_key_onto_grpo_config(tmp_path):
    args = trl_grpo.trl_arguments(_demo("trainer.seed=3"), tmp_path)
    assert args["per_device_train_batch_size"] == 16 * 8  # completions per optimizer step
    assert args["steps_per_generation"] == 1 and args["num_iterations"] == 1
    assert args["num_generations"] == 8 and args["max_completion_length"] == 4
    assert args["temperature"] == 1.0 and args["top_p"] == 1.0 and args["top_k"] == 0
    assert args["learning_rate"] == 3e-4 and args["weight_decay"] == 0.0
    assert args["lr_scheduler_type"] == "cosine_with_min_lr"
    assert args["lr_scheduler_kwargs"] == {"min_lr_rate": 0.1}
    assert args["max_grad_norm"] == 1.0 and args["warmup_steps"] == 0
    assert args["max_steps"] == 40 and args["seed"] == 3
    assert args["loss_type"] == "dapo" and args["scale_rewards"] == "group"
    assert args["beta"] == 0.0 and args["epsilon"] == args["epsilon_high"] == 0.2
    assert args["use_cpu"] and not args["bf16"] and not args["gradient_checkpointing"]


def test_mini_batches_kl_loss_and_dr_grpo_map_too(tmp_path):
    cfg = _demo(
        "learner.ppo_mini_batch_size=4", "learner.kl.use_kl_loss=true",
        "learner.kl.kl_loss_coef=0.01", "learner.algorithm.adv_estimator=drgrpo",
        "learner.optim.schedule=constant",
    )  # fmt: skip
    args = trl_grpo.trl_arguments(cfg, tmp_path)
    assert args["steps_per_generation"] == 4 and args["per_device_train_batch_size"] == 32
    assert args["beta"] == 0.01 and args["scale_rewards"] == "none"
    assert args["lr_scheduler_type"] == "constant_with_warmup"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("learner.algorithm.adv_estimator=rloo", "learner.algorithm.adv_estimator"),
        ("learner.kl.use_kl_in_reward=true", "learner.kl.use_kl_in_reward"),
        ("learner.lora.rank=4", "learner.lora.rank"),
        ("learner.policy_loss.loss_agg_mode=seq-mean-token-sum", "loss_agg_mode"),
    ],
)
def test_what_trl_cannot_run_is_refused_in_one_line_naming_the_key(override, key):
    with pytest.raises(trl_grpo.Unmappable, match=key) as err:
        trl_grpo.check_mappable(_demo(override))
    assert "\n" not in str(err.value)


def test_without_trl_the_suite_stops_with_the_line_that_installs_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(vs_trl, "trl_available", lambda: trl_grpo.INSTALL_HINT)
    record = vs_trl.run(tmp_path, quick=True)
    assert record["status"] == "error" and 'pip install ".[bench]"' in record["error"]
    assert capsys.readouterr().err.strip() == trl_grpo.INSTALL_HINT


def _run(arm, seed, **figures):
    return {"regime": "demo", "arm": arm, "seed": seed, **figures}


def test_ratios_are_fleetrl_over_trl_on_medians_of_seeds():
    runs = []
    for seed, (f_time, t_time) in enumerate([(1.0, 2.0), (2.0, 2.0), (1.5, 3.0)]):
        runs.append(_run("fleetrl", seed, time_to_target_s=f_time, command_s=12.0,
                         samples_per_s=900.0, samples_to_target=2304))  # fmt: skip
        runs.append(_run("trl", seed, time_to_target_s=t_time, command_s=10.0,
                         samples_per_s=1000.0, samples_to_target=2048))  # fmt: skip
        runs.append(_run("fleetrl-sync", seed, time_to_target_s=None, command_s=14.0,
                         samples_per_s=500.0, samples_to_target=None))  # fmt: skip
    summary = vs_trl.summarise(runs, [DEMO])
    assert summary["demo_time_to_target_speedup"] == pytest.approx(2.0 / 1.5)
    assert summary["demo_command_time_ratio"] == pytest.approx(1.2)
    assert summary["demo_command_speedup"] == pytest.approx(1 / 1.2)
    assert summary["demo_samples_per_s_ratio"] == pytest.approx(0.9)
    assert summary["demo_samples_to_target_ratio"] == pytest.approx(2304 / 2048)
    assert summary["demo_samples_to_target_ratio_sync"] is None  # never reached
    assert summary["demo_fleetrl_sync_reached"] == 0 and summary["demo_trl_reached"] == 3


def test_size_flags_scale_the_generation_bound_regime_and_the_demo_keeps_its_model():
    scaled = regime("generation-bound", hidden=256, layers=8, max_new_tokens=1024, device="cuda")
    assert scaled.sizes.hidden == 256 and scaled.sizes.layers == 8
    assert scaled.eval_max_new_tokens == GENERATION_EVAL_CAP and scaled.device == "cuda"
    assert regime("generation-bound").sizes == GENERATION_BOUND.sizes
    demo = regime("demo", hidden=512, batch=64)
    assert demo.batch == 64 and demo.sizes is None
    with pytest.raises(ValueError, match="unknown regime"):
        regime("huge")


def test_a_seed_that_never_reached_the_target_counts_as_later_than_every_seed_that_did():
    runs = [_run("trl", s, time_to_target_s=t, samples_to_target=n)
            for s, (t, n) in enumerate([(40.0, 1408), (150.0, 1792), (60.0, 1600)])]  # fmt: skip
    runs += [_run("fleetrl", 0, time_to_target_s=5.0, samples_to_target=1792),
             _run("fleetrl", 1, time_to_target_s=None, samples_to_target=None),
             _run("fleetrl", 2, time_to_target_s=None, samples_to_target=None)]  # fmt: skip
    runs += [_run("fleetrl-sync", s, time_to_target_s=t, samples_to_target=1536)
             for s, t in enumerate([9.0, None, 11.0])]  # fmt: skip
    summary = vs_trl.summarise(runs, [DEMO])
    # fleetrl reached it in 1 of 3 seeds: its median run never did, so no ratio
    assert summary["demo_fleetrl_reached"] == 1
    assert summary["demo_fleetrl_time_to_target_s"] is None
    assert summary["demo_time_to_target_speedup"] is None
    # η = 0 reached it in 2 of 3: the median is the later of the two (9, 11, never)
    assert summary["demo_fleetrl_sync_time_to_target_s"] == 11.0
    assert summary["demo_time_to_target_speedup_sync"] == pytest.approx(60.0 / 11.0)
