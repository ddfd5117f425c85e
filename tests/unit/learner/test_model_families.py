"""The learner on every family whose layout differs (Qwen2, Llama, GPT-2, GPT-NeoX, OPT, Phi,
Gemma), one rank in process: sharded loading equals ``from_pretrained`` bit for bit (blocks
found from the model itself, buffers a checkpoint does not hold recomputed), GRPO/PPO steps
train (a value head on any backbone, the reference model, LoRA on GPT-2's Conv1D layers), the
weights the engines get are the names the model's files hold, and an exported checkpoint is the
trained policy, which the embedded engine serves with transformers' greedy tokens."""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from fleetrl.models.checkpoint_names import CheckpointNames
from fleetrl.models.config import ModelConfig
from fleetrl.models.family import decoder_blocks
from fleetrl.models.tiny import FAMILIES
from learner.config import LearnerConfig
from learner.fsdp import shard_model
from learner.sharded_load import build_sharded
from learner.synthetic import synthetic_batch
from tests.integration.learner.procs import free_port

pytestmark = pytest.mark.timeout(300)

# what each family's run also exercises, so that every feature meets an unusual layout once
RUNS = {
    "qwen2": {"kl": {"use_kl_loss": True}},  # the reference model
    "llama": {},
    "gpt2": {"lora": {"rank": 4}, "kl": {"use_kl_loss": True}},  # Conv1D adapters, adapters off
    "gpt_neox": {"algorithm": {"adv_estimator": "gae"}},  # critic on gpt_neox.*
    "opt": {"algorithm": {"adv_estimator": "gae"}},  # no token classifier in transformers; padded
    "phi": {"grad_checkpointing": True},
    "gemma": {"kl": {"use_kl_loss": True}, "grad_checkpointing": True},
}


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_load_shards_each_block_and_equals_from_pretrained(family, tiny_family, group):
    from transformers import AutoModelForCausalLM

    folder = tiny_family(family)
    model = build_sharded(
        folder, kind="causal_lm", device=torch.device("cpu"),
        shard=lambda m: shard_model(m, bf16=False, cpu_offload=False),
    )  # fmt: skip
    assert all(isinstance(b, FSDPModule) for b in decoder_blocks(model))
    reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    loaded = {n: t.full_tensor() for n, t in model.state_dict().items()}
    for name, tensor in reference.state_dict().items():
        assert torch.equal(loaded[name], tensor), name
    for name, buffer in reference.named_buffers():  # rotary inv_freq, Gemma's embed_scale
        assert torch.equal(model.get_buffer(name), buffer), name
    ids = torch.randint(6, 100, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def _worker(folder, family, tmp_path):
    from learner.worker import LearnerWorker

    raw = {"optim": {"lr": 1e-2, "eps": 1e-6}, "ppo_mini_batch_size": 2,
           "max_tokens_per_micro_batch": 64, **RUNS[family]}  # fmt: skip
    cfg = msgspec.convert(raw, LearnerConfig)
    worker = LearnerWorker(
        cfg, ModelConfig(path=str(folder)), rank=0, world_size=1, master_addr="127.0.0.1",
        master_port=free_port(), seed=3, total_steps=2,
    )  # fmt: skip
    worker.setup()
    return worker


def _batch(step: int, vocab: int):
    return synthetic_batch(
        vocab_size=vocab, groups=2, group_size=4, prompt_lens=[5, 7],
        response_lens=[3, 6, 1, 4, 2, 5, 7, 3], seed=step, temperature=0.9,
    )  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_learner_steps_train_and_export_the_trained_policy(family, tiny_family, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from learner.export import export_checkpoint

    folder = tiny_family(family)
    base = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    worker = _worker(folder, family, tmp_path)
    try:
        assert worker.packing == (family != "opt")  # OPT's attention mixes packed sequences
        assert (worker.critic is not None) == (family in ("gpt_neox", "opt"))
        metrics = [worker.step(_batch(s, base.config.vocab_size), s) for s in range(2)]
        for m in metrics:
            assert torch.isfinite(torch.tensor(m["actor/pg_loss"])), m
            assert m["actor/skipped_nonfinite"] == 0
            if worker.critic is not None:
                assert torch.isfinite(torch.tensor(m["critic/vf_loss"]))
        if RUNS[family].get("kl"):
            assert metrics[-1]["actor/kl_loss"] > 0  # the policy moved off the reference
        sent = dict(worker.named_full_tensors())
        step_dir = worker.save_checkpoint(tmp_path / "ckpt", {})
    finally:
        worker.close()
    # the engines get the names the model's files hold (GPT-NeoX's embed_out), each tied once
    names = CheckpointNames.of(base)
    assert set(sent) == {names.to_file(n) for n, _ in base.named_parameters()}
    assert ("embed_out.weight" in sent) == (family == "gpt_neox")
    sent = {names.to_module(n): t for n, t in sent.items()}
    changed = [n for n in sent if not torch.equal(sent[n], base.state_dict()[n])]
    assert changed  # trained
    out = export_checkpoint(step_dir, tmp_path / "export", merged=True)
    exported = out / "merged" if worker.uses_lora else out
    if worker.uses_lora:
        assert "adapter_model.safetensors" in {p.name for p in out.iterdir()}
    reloaded = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32)
    for name, tensor in reloaded.state_dict().items():
        want = sent[name] if name in sent else sent[_tied_to(reloaded, name)]
        assert torch.allclose(tensor, want, atol=1e-6 if worker.uses_lora else 0), name
    written = {names.to_module(n) for n in load_file(exported / "model.safetensors")}
    assert written <= set(reloaded.state_dict())  # the files' names, nothing else
    _serves_what_transformers_generates(exported, reloaded.eval())


def _serves_what_transformers_generates(folder, model) -> None:
    """The embedded engine on the exported folder: the greedy tokens of ``generate``."""
    from fleetrl.models.loading import load_tokenizer
    from tests.unit.rollout_fleet.test_engine_runner import SHARPEN, Harness, hf_greedy

    tokenizer = load_tokenizer(folder)
    messages = [{"role": "user", "content": "What is 12 + 7?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    harness = Harness(folder)
    try:
        with torch.no_grad():  # near-flat logits after two steps: a sharper head on both sides
            for served in (model, harness.runner.model):
                served.get_output_embeddings().weight.mul_(SHARPEN)
        seqs, finished = harness.submit(prompt, temperature=0.0, max_new_tokens=8, ignore_eos=True)
        assert finished.wait(60)
        assert seqs[0].output_ids == hf_greedy(model, prompt, 8)
    finally:
        harness.close()


def _tied_to(model, name: str) -> str:
    """The parameter name a tied weight (an LM head) shares its tensor with."""
    tensor = model.get_parameter(name)
    return next(n for n, p in model.named_parameters() if p is tensor)
