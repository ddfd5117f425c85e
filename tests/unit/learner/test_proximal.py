"""π_prox from the update's own forward: when it applies, and that the step is the recompute's.

One world-of-one learner steps the same batch twice from the same weights: once
with the separate no-grad π_prox pass (``recompute_proximal=always``) and once
taking π_prox from the update's forward (``auto``). The loss, every parameter's
gradient, the gradient norm and the ``is/*`` metrics must agree, for the decoupled
loss and the token and sequence IS corrections, over several micro-batches.
"""

from __future__ import annotations

import socket

import msgspec
import pytest
import torch

import learner.worker as worker_module
from fleetrl.models.config import ModelConfig
from fleetrl.models.tiny import make_tiny_model
from learner import proximal
from learner.config import LearnerConfig
from learner.synthetic import synthetic_batch
from learner.worker import LearnerWorker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(**changes) -> LearnerConfig:
    return msgspec.convert(changes, LearnerConfig)


@pytest.mark.parametrize(
    ("changes", "train_policy", "dropout", "expected"),
    [
        ({}, True, False, True),
        ({"correction": {"mode": "token_tis"}}, True, False, True),
        ({"correction": {"mode": "bypass"}}, True, False, False),  # no π_prox at all
        ({"correction": {"recompute_proximal": "always"}}, True, False, False),
        ({"ppo_epochs": 2}, True, False, False),
        ({"kl": {"use_kl_in_reward": True}}, True, False, False),
        ({}, False, False, False),  # critic warm-up: the policy does not update
        ({}, True, True, False),  # dropout: the update's forward is not the policy
    ],
)
def test_the_pass_goes_only_where_the_updates_forward_is_the_proximal_policy(
    changes, train_policy, dropout, expected
):
    cfg = _config(**changes)
    got = proximal.from_update(cfg, 1, train_policy=train_policy, policy_dropout=dropout)
    assert got is expected
    assert not proximal.from_update(cfg, 2, train_policy=train_policy, policy_dropout=dropout)


def test_dropout_is_found_in_modules_and_in_the_config():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def tiny(**kw):
        config = Qwen2Config(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, **kw,
        )  # fmt: skip
        return Qwen2ForCausalLM(config)

    assert not proximal.has_active_dropout(tiny())
    assert proximal.has_active_dropout(tiny(attention_dropout=0.1))
    with_module = tiny()
    with_module.extra = torch.nn.Dropout(0.2)
    assert proximal.has_active_dropout(with_module)


def _step(model_dir, batch, recompute: str, monkeypatch, **changes):
    """One step from the model folder's weights; (metrics, each parameter's gradient at the
    step's last optimizer step)."""
    correction = {"recompute_proximal": recompute, **changes.pop("correction", {})}
    cfg = _config(
        optim={"lr": 1e-3, "weight_decay": 0.0},
        correction=correction,
        use_dynamic_bsz=False,
        micro_batch_size=3,  # several micro-batches, the last one short
        **changes,
    )
    worker = LearnerWorker(
        cfg, ModelConfig(path=str(model_dir)), rank=0, world_size=1, master_addr="127.0.0.1",
        master_port=_free_port(), seed=0, total_steps=4, max_response_length=8,
    )  # fmt: skip
    grads: dict[str, torch.Tensor] = {}
    real_step = worker_module.guarded_step

    def recording(model, optimizer, max_norm, local_loss):
        for name, parameter in model.named_parameters():
            if parameter.grad is not None:
                grad = parameter.grad
                grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).clone()
        return real_step(model, optimizer, max_norm, local_loss)

    monkeypatch.setattr(worker_module, "guarded_step", recording)
    worker.setup()
    try:
        metrics = worker.step(batch, policy_version=2)
    finally:
        worker.close()
    return metrics, grads


def _batch(temperature: float = 1.0):
    return synthetic_batch(
        vocab_size=40, groups=2, group_size=4, prompt_lens=[5, 7],
        response_lens=[3, 8, 1, 5, 6, 2, 8, 4], seed=1, token_versions=0,
        temperature=temperature,
    )  # fmt: skip


def _compared(metrics: dict[str, float]) -> list[str]:
    """Every figure the step computes (not its clocks or memory)."""
    return sorted(k for k in metrics if not k.startswith(("timing_s/", "perf/")))


@pytest.mark.parametrize(
    "changes",
    [
        {"correction": {"mode": "decoupled"}},
        {"correction": {"mode": "token_tis"}},
        {"correction": {"mode": "seq_mis_geo"}},
        # rows sampled at T = 0.7: both paths score each row at its own temperature; with the
        # entropy bonus and a KL loss to the reference beside the policy loss
        {
            "correction": {"mode": "decoupled", "decoupled_behavior_clip": True},
            "policy_loss": {"entropy_coeff": 0.01},
            "kl": {"use_kl_loss": True, "kl_loss_coef": 0.1},
            "temperature": 0.7,
        },
    ],
    ids=["decoupled", "token_tis", "seq_mis_geo", "temperature_entropy_kl_loss"],
)
def test_loss_gradients_and_metrics_equal_the_recompute_path(changes, tmp_path, monkeypatch):
    model_dir = make_tiny_model(tmp_path / "model", layers=2, hidden=32, heads=2, seed=3)
    changes = dict(changes)
    batch = _batch(changes.pop("temperature", 1.0))
    recomputed, recomputed_grads = _step(model_dir, batch, "always", monkeypatch, **changes)
    taken, taken_grads = _step(model_dir, batch, "auto", monkeypatch, **changes)

    assert "timing_s/old_log_prob" in recomputed and "timing_s/old_log_prob" not in taken
    assert recomputed_grads.keys() == taken_grads.keys() and taken_grads
    for name, grad in recomputed_grads.items():
        torch.testing.assert_close(taken_grads[name], grad, rtol=1e-4, atol=1e-7, msg=name)
    keys = _compared(recomputed)
    assert keys == _compared(taken)
    assert {"actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/pg_clipfrac"} <= set(keys)
    assert any(k.startswith("is/") for k in keys)
    for key in keys:
        assert taken[key] == pytest.approx(recomputed[key], rel=1e-4, abs=1e-6), key
    assert taken["is/masked_frac"] == recomputed["is/masked_frac"]


@pytest.mark.parametrize(
    "changes", [{"ppo_mini_batch_size": 1}, {"ppo_epochs": 2}], ids=["two_mini_batches", "epochs"]
)
def test_the_pass_stays_where_the_policy_moves_within_the_step(changes, tmp_path, monkeypatch):
    """Two optimizer steps per batch: π_prox is the policy before the first, so ``auto``
    recomputes it and the step is the one ``always`` takes."""
    model_dir = make_tiny_model(tmp_path / "model", layers=2, hidden=32, heads=2, seed=3)
    always, _ = _step(model_dir, _batch(), "always", monkeypatch, **changes)
    auto, _ = _step(model_dir, _batch(), "auto", monkeypatch, **changes)
    assert "timing_s/old_log_prob" in auto
    for key in _compared(always):
        assert auto[key] == pytest.approx(always[key], rel=1e-6, abs=1e-9), key
