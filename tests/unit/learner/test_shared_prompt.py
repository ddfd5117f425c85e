"""Distinct prompts run once (learner.shared_prompt): the same logprobs, entropies and
gradients as the whole forward on every tiny family, a learner step that trains alike with it
on and off, the probe that turns it off where it would be wrong, and the cost that picks it."""

from __future__ import annotations

import logging

import msgspec
import numpy as np
import pytest
import torch

from fleetrl.models.config import ModelConfig
from fleetrl.models.loading import load_causal_lm
from fleetrl.models.tiny import FAMILIES
from learner import shared_prompt
from learner.batching import GlobalBatch
from learner.config import LearnerConfig
from learner.packing import build_inputs, build_shared_inputs, layout_cost, policy_forward
from learner.synthetic import synthetic_batch
from learner.worker import LearnerWorker
from tests.integration.learner.procs import free_port

CPU = torch.device("cpu")
LENS = [3, 0, 7, 1, 5, 9, 2, 2, 4]


@pytest.fixture(scope="module")
def batch() -> GlobalBatch:
    arrow = synthetic_batch(
        vocab_size=60, groups=3, group_size=3, prompt_lens=[4, 6, 2], response_lens=LENS,
        seed=3, temperature=0.8,
    )  # fmt: skip
    return GlobalBatch.from_arrow(arrow)


def shared_inputs(batch: GlobalBatch, indices):
    return build_shared_inputs(batch, np.asarray(indices), CPU)


def test_distinct_prompts_are_each_prompt_once_in_order_of_first_appearance(batch):
    prompts, owner = shared_prompt.distinct_prompts(batch, np.array([4, 0, 3, 1, 8]))
    assert owner.tolist() == [0, 1, 0, 1, 2]
    assert [p.tolist() for p in prompts] == [
        batch.prompt(4).tolist(), batch.prompt(0).tolist(), batch.prompt(8).tolist()
    ]  # fmt: skip
    same = synthetic_batch(
        vocab_size=60, groups=2, group_size=1, prompt_lens=3, response_lens=[1, 1], seed=0
    )
    two_groups = GlobalBatch.from_arrow(same)  # different groups, one prompt: shared too
    two_groups.prompt_values[3:6] = two_groups.prompt_values[0:3]
    assert shared_prompt.distinct_prompts(two_groups, np.arange(2))[1].tolist() == [0, 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_logprobs_and_entropies_equal_the_whole_forward(family, batch, tiny_family):
    torch.set_num_threads(1)
    model = load_causal_lm(tiny_family(family)).eval()
    for indices in (np.arange(batch.size), np.array([7, 2, 6, 0])):
        with torch.no_grad():
            whole = policy_forward(
                model, build_inputs(batch, indices, packing=False, device=CPU), entropy="metric"
            )
            shared = policy_forward(model, shared_inputs(batch, indices), entropy="metric")
        assert shared.logprobs.shape == (int(batch.response_lens[indices].sum()),)
        torch.testing.assert_close(shared.logprobs, whole.logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(shared.entropy, whole.entropy, atol=1e-5, rtol=0)


def test_an_empty_micro_batch_runs_both_passes_and_reads_nothing(batch, tiny_model_dir):
    model = load_causal_lm(tiny_model_dir)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    out = policy_forward(model, shared_inputs(batch, np.zeros(0, np.int64)))
    assert out.logprobs.shape == (0,) and len(calls) == 2  # FSDP ranks call alike
    out.anchor.backward()  # the dummy is in the graph: FSDP's backward hooks fire
    assert all(p.grad is not None for p in model.parameters())


def test_shared_gradients_equal_the_whole_forwards(batch, tiny_model_dir):
    torch.set_num_threads(1)
    model = load_causal_lm(tiny_model_dir)
    model.eval()  # no dropout: both layouts see the same function
    grads = []
    for mb in (
        build_inputs(batch, np.arange(batch.size), packing=True, device=CPU),
        shared_inputs(batch, np.arange(batch.size)),
    ):
        model.zero_grad()
        out = policy_forward(model, mb, entropy="grad")
        weights = torch.linspace(-1.0, 1.0, out.logprobs.numel())
        ((out.logprobs * weights).sum() + out.entropy.sum() + out.anchor).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert max(g.abs().max().item() for g in grads[0].values()) > 1e-3  # gradients are real
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=2e-5, rtol=1e-4, msg=name)


def _worker(model_dir, share: bool) -> LearnerWorker:
    cfg = msgspec.convert(
        {"optim": {"lr": 1e-3}, "share_prompts": share, "correction": {"mode": "decoupled"}},
        LearnerConfig,
    )
    worker = LearnerWorker(
        cfg, ModelConfig(path=str(model_dir)), rank=0, world_size=1, master_addr="127.0.0.1",
        master_port=free_port(), seed=0,
    )  # fmt: skip
    worker.setup()
    return worker


def test_a_learner_step_trains_alike_with_prompts_shared_and_not(tiny_model_dir, monkeypatch):
    torch.set_num_threads(1)
    calls = []
    original = shared_prompt.logits
    monkeypatch.setattr(shared_prompt, "logits", lambda *a: calls.append(1) or original(*a))
    arrow = synthetic_batch(
        vocab_size=60, groups=4, group_size=4, prompt_lens=[9, 5, 7, 6],
        response_lens=[3, 5, 1, 4] * 4, seed=1, token_versions=0,
    )  # fmt: skip
    results = {}
    for share in (False, True):
        worker = _worker(tiny_model_dir, share)
        try:
            assert worker.share_prompts is share
            metrics = [worker.step(arrow, policy_version=v) for v in range(2)]
            weights = {n: t.clone() for n, t in worker.named_full_tensors()}
        finally:
            worker.close()
        results[share] = metrics, weights
        assert bool(calls) is share  # the shared layout ran exactly when it was on
    for off, on in zip(results[False][0], results[True][0], strict=True):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl"):
            assert on[key] == pytest.approx(off[key], abs=1e-5), key
    for name, tensor in results[False][1].items():
        torch.testing.assert_close(results[True][1][name], tensor, atol=1e-5, rtol=0, msg=name)


def test_the_probe_turns_sharing_off_where_it_would_be_wrong(tiny_model_dir, monkeypatch, caplog):
    from transformers import AutoConfig, Qwen2Config

    monkeypatch.setattr(logging.getLogger("fleetrl"), "propagate", True)  # reach caplog
    caplog.set_level(logging.INFO, logger="fleetrl")
    config = AutoConfig.from_pretrained(tiny_model_dir)
    on = dict(sp_size=1, checkpointing=False)
    assert shared_prompt.prompts_shareable(config, True, **on)
    assert not shared_prompt.prompts_shareable(config, False, **on)
    assert not shared_prompt.prompts_shareable(config, True, sp_size=2, checkpointing=False)
    assert not shared_prompt.prompts_shareable(config, True, sp_size=1, checkpointing=True)
    flash = Qwen2Config(**config.to_dict())
    flash._attn_implementation = "flash_attention_2"
    assert not shared_prompt.prompts_shareable(flash, True, **on)
    windowed = Qwen2Config(**{**config.to_dict(), "use_sliding_window": True, "sliding_window": 4})
    assert not shared_prompt.prompts_shareable(windowed, True, **on)
    assert "sliding-window" in caplog.text
    # a layout that got the response positions wrong is caught by the twin, not trusted
    build = shared_prompt.build_shared

    def shifted(*args):
        inputs = build(*args)
        inputs.response_positions = inputs.response_positions + 1
        return inputs

    monkeypatch.setattr(shared_prompt, "build_shared", shifted)
    monkeypatch.setattr(shared_prompt, "_ANSWERS", {})
    assert not shared_prompt.prompts_shareable(config, True, **on)
    assert "differs from its whole forward" in caplog.text


def test_the_cost_prefers_sharing_for_groups_and_counts_every_pass():
    hidden = 64
    prompts, responses = np.full(16, 23), np.full(128, 4)  # the CPU demo's batch
    shared = shared_prompt.shared_cost(prompts, responses, hidden)
    assert shared == pytest.approx(16 * (23 + 23**2 / 384) + 128 * (3 + 3 * 26 / 384))
    padded = layout_cost(np.full(128, 27), packing=False, budget=None, hidden=hidden)
    assert padded == pytest.approx(128 * (27 + 27**2 / 384))
    assert shared < padded / 3
    one_row = layout_cost(np.array([3, 5]), packing=True, budget=None, hidden=hidden)
    assert one_row == pytest.approx(8 + 34 / 384)
