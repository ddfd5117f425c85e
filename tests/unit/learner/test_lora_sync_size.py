"""LoRA sync size on the demo model: adapter bytes against a full sync, and the plan's adapter count.

The demo model is the one ``configs/demo_cpu.yaml`` builds (``model.tiny``); a
full sync sends every weight of it, a LoRA sync the tensors of
``get_peft_model_state_dict`` (what ``LearnerWorker.named_adapter_tensors``
yields), both in fp32 (the demo's ``model.dtype``). Printed with ``-s``: at
rank 8, all-linear is 6.1x smaller, [q_proj, v_proj] 35.4x, [q_proj] 70.7x (the
tiny model's 102 x 64 embeddings and LM head are a large part of its weights).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "demo_cpu.yaml"
TARGETS = (["all-linear"], ["q_proj", "v_proj"], ["q_proj"])


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    from fleetrl.models.tiny import make_tiny_model
    from launcher.config import load_run_config

    cfg = load_run_config(str(CONFIG), [])
    tiny = msgspec.to_builtins(cfg.model.tiny)
    return cfg, make_tiny_model(tmp_path_factory.mktemp("demo") / "model", **tiny)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("targets", TARGETS, ids=["+".join(t) for t in TARGETS])
def test_adapter_sync_bytes_against_a_full_sync_of_the_demo_model(demo_model, targets):
    from peft import get_peft_model_state_dict

    from fleetrl.models.loading import load_causal_lm
    from learner import lora
    from learner.config import LoraConfig
    from learner.memory import ModelShape

    cfg, model_dir = demo_model
    base = load_causal_lm(model_dir)
    full = _nbytes(dict(base.named_parameters()).values())
    lora_cfg = LoraConfig(rank=8, target_modules=list(targets))
    model = lora.wrap(base, lora_cfg, model_dir)
    adapters = get_peft_model_state_dict(model)
    ratio = full / _nbytes(adapters.values())
    print(f"demo model, LoRA rank 8 on {targets}: full sync {full} B, adapters "
          f"{_nbytes(adapters.values())} B, {ratio:.1f}x smaller")  # fmt: skip
    shape = ModelShape.from_model_config(cfg.model)
    assert sum(t.numel() for t in adapters.values()) == shape.adapter_params(8, list(targets))
    assert full == 4 * shape.params()
    if targets == ["q_proj"]:  # the bar (sync ≥ 50x smaller) at rank 8 on the demo model
        assert ratio >= 50
