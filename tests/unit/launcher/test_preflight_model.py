"""`fleetrl check` on the model's family: what cannot train or serve is refused in one line each
(exit 2), from config.json alone; every family fleetrl trains passes."""

from __future__ import annotations

import json

import pytest

from launcher.cli import main as cli_main
from launcher.config import load_run_config
from launcher.preflight_model import check_model_family


def _folder(tmp_path, name: str, config: dict):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _cfg(model, *overrides):
    return load_run_config(None, [f"model.path={model}", *overrides])


def _findings(cfg) -> dict[str, object]:
    return {f.key: f for f in check_model_family(cfg)}


QWEN = {"model_type": "qwen2", "hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 100,
        "num_attention_heads": 4, "intermediate_size": 64}  # fmt: skip
T5 = {"model_type": "t5", "d_model": 32, "num_layers": 2, "vocab_size": 100,
      "is_encoder_decoder": True}  # fmt: skip
MIXTRAL = {**QWEN, "model_type": "mixtral", "num_local_experts": 2}
CANNOT_TRAIN = {
    "encoder-decoder": (T5, "an encoder-decoder model (t5)"),
    "classifier": (
        {**QWEN, "architectures": ["Qwen2ForSequenceClassification"]},
        "its weights are a Qwen2ForSequenceClassification, not a causal LM",
    ),
    "unknown": (
        {"model_type": "mystery", "hidden_size": 8},
        "transformers has no model_type 'mystery' (fleetrl runs no remote code)",
    ),
    "converted-experts": (MIXTRAL, "transformers converts its checkpoint's tensors on load"),
}


@pytest.mark.parametrize("case", CANNOT_TRAIN)
def test_what_cannot_train_is_one_line_at_model_path(tmp_path, case):
    config, problem = CANNOT_TRAIN[case]
    cfg = _cfg(_folder(tmp_path, "model", config))
    [finding] = check_model_family(cfg)
    assert finding.key == "model.path" and finding.fatal and problem in finding.problem


def test_check_refuses_an_encoder_decoder_in_one_line_with_exit_2(tmp_path, capsys):
    model = _folder(tmp_path, "t5", T5)
    code = cli_main(["check", f"model.path={model}", f"trainer.output_dir={tmp_path / 'run'}",
                     "data.synth_task=add2", f"data.train_files=[{tmp_path / 'train.parquet'}]",
                     f"data.val_files=[{tmp_path / 'val.parquet'}]"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    lines = [line for line in err if "model.path" in line]
    assert code == 2 and len(lines) == 1
    assert "an encoder-decoder model (t5): fleetrl trains decoder-only causal LMs" in lines[0]


@pytest.mark.parametrize("family", ["qwen2", "llama", "gpt2", "gpt_neox", "phi", "gemma"])
def test_every_family_fleetrl_trains_passes(family, tiny_family):
    assert check_model_family(_cfg(tiny_family(family), "learner.lora.rank=8")) == []


def test_a_tiny_model_not_built_yet_is_checked_from_its_settings(tmp_path):
    cfg = _cfg(tmp_path / "absent", "model.create_tiny=true", "model.tiny.arch=opt",
               "model.tiny.max_positions=1024")  # fmt: skip
    [finding] = check_model_family(cfg)
    assert finding.key == "learner.packing" and not finding.fatal  # OPT: the learner pads
    assert not (tmp_path / "absent").exists()


def test_lora_targets_the_family_lacks_are_named_with_its_own(tiny_family):
    cfg = _cfg(tiny_family("gpt2"), "learner.lora.rank=8", "learner.lora.target_modules=[q_proj]")
    finding = _findings(cfg)["learner.lora.target_modules"]
    assert "['q_proj'] name no linear layer of gpt2's blocks" in finding.problem
    assert "peft's default for gpt2: ['c_attn']" in finding.problem


def test_opt_packing_is_a_warning_and_refused_under_sequence_parallelism(tiny_family):
    warning = _findings(_cfg(tiny_family("opt")))["learner.packing"]
    assert not warning.fatal and "opt's attention does not keep packed sequences apart" in (
        warning.problem
    )
    sp = _cfg(tiny_family("opt"), "learner.num_ranks=2", "learner.sequence_parallel=2")
    refused = _findings(sp)["learner.sequence_parallel"]
    assert refused.fatal and refused.problem.startswith("needs packing, and opt's attention")


def test_a_sliding_window_narrower_than_the_run_is_refused_for_the_embedded_engine(tmp_path):
    mistral = {"model_type": "mistral", "hidden_size": 32, "num_hidden_layers": 2,
               "vocab_size": 100, "num_attention_heads": 4, "intermediate_size": 64,
               "sliding_window": 64}  # fmt: skip
    model = _folder(tmp_path, "mistral", mistral)
    long_run = _cfg(model, "data.max_prompt_length=100", "rollout.max_new_tokens=20")
    finding = _findings(long_run)["rollout.backend"]
    assert "sliding-window attention of 64 tokens, narrower than the 120 tokens" in finding.problem
    short = _cfg(model, "data.max_prompt_length=40", "rollout.max_new_tokens=20")
    assert "rollout.backend" not in _findings(short)
    sglang = _cfg(model, "data.max_prompt_length=100", "rollout.backend=sglang",
                  "rollout.gpus_per_engine=1")  # fmt: skip
    assert "rollout.backend" not in _findings(sglang)
