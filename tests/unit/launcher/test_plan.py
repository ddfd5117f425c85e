"""`fleetrl plan`: parameter counts from config.json match the real model, the 7B plan renders and
fits 80 GiB, the what-ifs move the right way, and sequence_parallel is cross-checked at load."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetrl.config import ConfigError
from fleetrl.models.tiny import FAMILIES
from launcher.cli import main as cli_main
from launcher.config import load_run_config
from launcher.plan import learner_roles, model_shape, render
from learner.memory import GB, ModelShape

REPO = Path(__file__).resolve().parents[3]
GRPO_7B = REPO / "configs/gsm8k_grpo_qwen2.5_7b.yaml"
QWEN_7B_JSON = REPO / "configs/models/Qwen2.5-7B-Instruct.config.json"


@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_count_from_config_json_equals_the_models(family, tiny_family):
    import json

    import peft

    from fleetrl.models.loading import load_causal_lm

    folder = tiny_family(family)
    shape = ModelShape.from_config_dict(json.loads((folder / "config.json").read_text()))
    model = load_causal_lm(folder)
    assert shape.params() == sum(p.numel() for p in model.parameters())
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear"))
    adapters = sum(p.numel() for n, p in wrapped.named_parameters() if "lora_" in n)
    assert shape.adapter_params(8, ["all-linear"]) == adapters


def test_gpt2_plan_reads_gpt2s_names_and_counts_its_124m_parameters(tmp_path, capsys):
    """GPT-2's config.json (n_embd, n_head, n_layer; no intermediate size; a tied head it does
    not state): the plan of the published 124M model."""
    import json

    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12,
            "n_positions": 1024, "vocab_size": 50257, "architectures": ["GPT2LMHeadModel"]}  # fmt: skip
    config = tmp_path / "config.json"
    config.write_text(json.dumps(gpt2))
    shape = ModelShape.from_config_dict(gpt2)
    assert shape.params() == 124_439_808  # GPT-2 small, its head tied to the embedding
    assert (shape.hidden, shape.heads, shape.layers, shape.intermediate) == (768, 12, 12, 3072)
    assert shape.adapter_params(8, ["c_attn"]) == 12 * 8 * (768 + 3 * 768)
    code = cli_main(["plan", "--model-config", str(config), "--gpu-mem-gb", "80"])
    out = capsys.readouterr().out
    assert code == 0 and "124.44 M parameters (12 layers, hidden 768, 12/12 heads" in out


def test_qwen25_7b_plan_counts_its_parameters_and_fits_80_gib():
    cfg = load_run_config(GRPO_7B)
    shape = model_shape(cfg, str(QWEN_7B_JSON))
    assert shape.params() == pytest.approx(7.62e9, rel=0.01)  # Qwen2.5-7B: 7.62 B
    text, fits = render(cfg, 80.0, str(QWEN_7B_JSON))
    assert fits and "| learner | policy |" in text and "| learner | reference |" in text
    _, fits_small = render(cfg, 24.0, str(QWEN_7B_JSON))
    assert not fits_small


def test_each_memory_saving_change_lowers_the_learner_plan():
    import msgspec

    cfg = load_run_config(GRPO_7B)
    shape = model_shape(cfg, str(QWEN_7B_JSON))
    base = sum(r.total for r in learner_roles(cfg, shape)) / GB
    for change in (
        {"param_offload": True},
        {"num_ranks": 32},
        {"max_tokens_per_micro_batch": 12288},
        {"sequence_parallel": 2, "max_tokens_per_micro_batch": 12288},
    ):
        lc = msgspec.structs.replace(cfg.learner, **change)
        assert sum(r.total for r in learner_roles(cfg, shape, lc)) / GB < base, change
    no_gc = msgspec.structs.replace(cfg.model, gradient_checkpointing=False)
    cfg_no_gc = msgspec.structs.replace(cfg, model=no_gc)
    assert sum(r.total for r in learner_roles(cfg_no_gc, shape)) / GB > base


def test_lora_plan_keeps_the_base_weights_trains_adapters_only_and_drops_the_reference():
    import msgspec

    cfg = load_run_config(GRPO_7B, ["learner.kl.use_kl_loss=true"])
    shape = model_shape(cfg, str(QWEN_7B_JSON))
    full = {r.role: r for r in learner_roles(cfg, shape)}
    lora_cfg = msgspec.structs.replace(cfg.learner.lora, rank=64)
    lc = msgspec.structs.replace(cfg.learner, lora=lora_cfg)
    lora = {r.role: r for r in learner_roles(cfg, shape, lc)}
    assert "reference" in full and "reference" not in lora  # the reference is adapters-off
    adapters = shape.adapter_params(64, ["all-linear"])
    n = cfg.learner.num_ranks
    assert lora["policy"].weights == pytest.approx(full["policy"].weights + 4 * adapters / n)
    assert lora["policy"].grads == pytest.approx(4 * adapters / n)
    assert lora["policy"].optimizer == pytest.approx(8 * adapters / n)
    text, _ = render(cfg, 80.0, str(QWEN_7B_JSON))
    assert "| learner.lora.rank=64 (all-linear; adapters train, no reference copy) |" in text


def test_plan_command_prints_the_table_for_the_demo_config(capsys):
    assert cli_main(["plan", "--config", str(REPO / "configs/demo_cpu.yaml")]) == 0
    out = capsys.readouterr().out
    assert "| learner | policy |" in out and "learner on CPU" in out


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["learner.num_ranks=4", "learner.sequence_parallel=3"], "must divide learner.num_ranks"),
        (["learner.sequence_parallel=2", "learner.num_ranks=2", "learner.packing=false"], "packing"),
        (
            ["learner.sequence_parallel=8", "learner.num_ranks=8", "model.create_tiny=true",
             "model.path=/nonexistent/tiny", "model.tiny.heads=4",
             "model.tiny.max_positions=1024"],
            "heads",
        ),
    ],
)  # fmt: skip
def test_sequence_parallel_is_cross_checked_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(None, overrides)


def test_a_colocated_device_must_hold_the_larger_of_its_two_phases():
    from launcher.plan_colocated import colocated_phases

    cfg = load_run_config(
        GRPO_7B,
        ["rollout.placement=colocated", "rollout.gpus_per_engine=1",
         "rollout.num_engines=8", "learner.num_ranks=8"],
    )  # fmt: skip
    shape = model_shape(cfg, str(QWEN_7B_JSON))
    phases = colocated_phases(cfg, shape, 80.0, on_gpu=True)
    learner = sum(r.total for r in learner_roles(cfg, shape)) / GB
    assert phases.generating_gb == pytest.approx(cfg.rollout.mem_fraction_static * 80.0)
    assert phases.training_gb == pytest.approx(learner)  # the engine released everything
    assert phases.fits and phases.larger == "generating"
    text, fits = render(cfg, 80.0, str(QWEN_7B_JSON))
    assert fits and "co-located device: generating 68.000 GiB" in text
    import msgspec

    kept = msgspec.structs.replace(
        cfg.rollout,
        colocate=msgspec.structs.replace(
            cfg.rollout.colocate, release=["kv_cache"], offload_learner=False
        ),
    )
    both = colocated_phases(msgspec.structs.replace(cfg, rollout=kept), shape, 80.0, on_gpu=True)
    assert both.generating_gb == pytest.approx(phases.generating_gb + learner)
    assert both.training_gb > phases.training_gb and not both.fits
