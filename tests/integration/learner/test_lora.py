"""LoRA on the policy (peft inside the FSDP2 learner) on CPU: ranks, reference, sync tensors, resume.

One 2-rank run (spawned, gloo, meta-device sharded load, gradient checkpointing,
packing, GAE critic and KL loss against the adapters-off reference) and one
1-rank run in this process share the scenario of ``lora_procs``; every
comparison is against an independent computation (an unsharded peft model, the
plain Hugging Face model, the other world size).
"""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from tests.integration.learner import lora_procs, procs

ATOL = 1e-5
# AdamW's first step moves each weight by about lr·g/(|g| + eps): for gradient entries near
# zero, float noise in g can change the step by a small fraction of lr (1e-2 here).
WEIGHTS_ATOL = 1e-4


@pytest.fixture(scope="module")
def two_rank_lora(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora2")
    procs.spawn(lora_procs.run_lora_rank, 2, str(tiny_model_dir), str(out), "train", {})
    return out


@pytest.fixture(scope="module")
def one_rank_lora(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora1")
    lora_procs.run_lora_rank(0, 1, procs.free_port(), str(tiny_model_dir), str(out), "train", {})
    return out


def _close(a: dict, b: dict, atol: float = ATOL, rtol: float = 0.0) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=rtol, msg=name)


def _unsharded_peft(model_dir):
    """The same LoRA policy built without FSDP: from_pretrained, peft, the learner's adapter init."""
    from fleetrl.models.loading import load_causal_lm
    from learner import lora
    from learner.config import LoraConfig

    cfg = msgspec.convert(lora_procs.LORA["lora"], LoraConfig)
    model = lora.wrap(load_causal_lm(model_dir), cfg, model_dir)
    lora.init_adapters(model, seed=7)  # procs.make_worker's seed
    return model


def test_lora_two_ranks_equal_one_rank_logprobs_grads_and_steps(two_rank_lora, one_rank_lora):
    two = torch.load(two_rank_lora / "train.pt")
    one = torch.load(one_rank_lora / "train.pt")
    for key in ("policy", "reference"):
        torch.testing.assert_close(two["probe"][key], one["probe"][key], atol=ATOL, rtol=0)
    # sums of O(1) terms in another order (reduce-scatter vs one rank): float noise ~1e-5 relative
    _close(two["probe"]["grads"], one["probe"]["grads"], atol=1e-4, rtol=1e-4)
    assert max(g.abs().max().item() for g in one["probe"]["grads"].values()) > 1e-3
    assert one["probe"]["frozen_grads"] == [] and two["probe"]["frozen_grads"] == []
    for step in range(1, 5):
        _close(two[f"adapters_step{step}"], one[f"adapters_step{step}"], atol=WEIGHTS_ATOL)
        _close(two[f"merged_step{step}"], one[f"merged_step{step}"], atol=WEIGHTS_ATOL)
    m2 = json.loads((two_rank_lora / "train_metrics.json").read_text())
    m1 = json.loads((one_rank_lora / "train_metrics.json").read_text())
    for step in range(4):
        for key in ("actor/pg_loss", "actor/kl_loss", "critic/vf_loss"):
            assert m2[step][key] == pytest.approx(m1[step][key], abs=ATOL), key


def test_lora_trains_only_adapters_and_the_reference_is_the_base_model(
    one_rank_lora, tiny_model_dir
):
    from fleetrl.models.loading import load_causal_lm
    from learner.batching import GlobalBatch
    from learner.packing import build_inputs, policy_forward

    run = torch.load(one_rank_lora / "train.pt")
    base = dict(load_causal_lm(tiny_model_dir).state_dict())
    _close(run["base_end"], {n: base[n] for n in run["base_end"]}, atol=0.0)
    moved = max(
        (run["adapters_step4"][n] - run["adapters_init"][n]).abs().max().item()
        for n in run["adapters_init"]
    )
    assert moved > 1e-3
    # The merged policy is not the base any more ...
    merged = run["merged_step4"]
    assert max((merged[n] - base[n]).abs().max().item() for n in merged) > 1e-4
    # ... but π_ref (adapters off) is exactly what the plain HF model computes.
    model = load_causal_lm(tiny_model_dir).eval()
    gb = GlobalBatch.from_arrow(procs.make_batch(1))
    mb = build_inputs(gb, torch.arange(gb.size).numpy(), packing=True, device=torch.device("cpu"))
    with torch.no_grad():
        expected = policy_forward(model, mb).logprobs
    ref = run["probe"]["reference"]
    got = torch.cat([ref[i, : gb.response_lens[i]] for i in range(gb.size)])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    policy = run["probe"]["policy"]
    assert (policy - ref).abs().max().item() > 1e-4  # the adapters do act on the policy


def test_named_adapter_tensors_are_peft_saved_names_and_values(two_rank_lora, tiny_model_dir):
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    run = torch.load(two_rank_lora / "train.pt")
    model = _unsharded_peft(tiny_model_dir)
    expected = get_peft_model_state_dict(model)
    assert list(run["adapters_init"]) == list(expected)
    assert all(name.startswith("base_model.model.model.layers.") for name in expected)
    _close(run["adapters_init"], expected, atol=0.0)
    assert all(t.device.type == "cpu" for t in run["adapters_step4"].values())
    # Loaded by peft under those names, the trained adapters give the learner's merged model.
    result = set_peft_model_state_dict(model, run["adapters_step4"])
    assert not result.unexpected_keys
    merged = model.merge_and_unload()
    _close(dict(merged.named_parameters()), run["merged_step4"])


def test_adapter_config_is_json_and_loads_as_a_peft_config(two_rank_lora, tiny_model_dir):
    import peft

    config = torch.load(two_rank_lora / "train.pt")["adapter_config"]
    assert json.loads(json.dumps(config)) == config
    assert config["base_model_name_or_path"] == str(tiny_model_dir)
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    assert {t.rsplit(".", 1)[-1] for t in config["target_modules"]} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    }  # fmt: skip
    assert isinstance(peft.get_peft_config(dict(config)), peft.LoraConfig)


def test_lora_resume_in_fresh_processes_matches_uninterrupted_run(two_rank_lora, tiny_model_dir):
    from torch.distributed.checkpoint import FileSystemReader

    from learner import lora

    # the checkpoint holds the adapters (and their AdamW state), not the frozen base
    stored = FileSystemReader(str(two_rank_lora / "ckpt" / "step_2")).read_metadata()
    policy = [k for k in stored.state_dict_metadata if k.startswith("policy.")]
    assert policy and all(lora.is_adapter(k) for k in policy)
    procs.spawn(lora_procs.run_lora_rank, 2, str(tiny_model_dir), str(two_rank_lora), "resume", {})
    train = torch.load(two_rank_lora / "train.pt")
    resume = torch.load(two_rank_lora / "resume.pt")
    for step in (3, 4):
        _close(resume[f"adapters_step{step}"], train[f"adapters_step{step}"], atol=1e-6)
        _close(resume[f"merged_step{step}"], train[f"merged_step{step}"], atol=1e-6)
    _close(resume["base_end"], train["base_end"], atol=0.0)
    m_train = json.loads((two_rank_lora / "train_metrics.json").read_text())
    m_resume = json.loads((two_rank_lora / "resume_metrics.json").read_text())
    assert m_resume[0]["actor/lr"] == m_train[2]["actor/lr"]
    assert m_resume[0]["actor/pg_loss"] == pytest.approx(m_train[2]["actor/pg_loss"], abs=1e-6)


def test_lora_with_sequence_parallel_2_equals_1(tiny_model_dir, tmp_path):
    procs.spawn(lora_procs.run_sp_lora, 2, str(tiny_model_dir), str(tmp_path))
    lora_procs.run_sp_lora(0, 1, procs.free_port(), str(tiny_model_dir), str(tmp_path))
    one, two = torch.load(tmp_path / "sp1.pt"), torch.load(tmp_path / "sp2.pt")
    for key in ("policy", "reference"):
        torch.testing.assert_close(two[key], one[key], atol=ATOL, rtol=0)
    _close(two["adapters"], one["adapters"], atol=WEIGHTS_ATOL)


def test_adapter_methods_need_lora(tiny_model_dir):
    worker = procs.make_worker(
        str(tiny_model_dir), 0, 1, procs.free_port(), {"algorithm": {"adv_estimator": "grpo"}}
    )
    try:
        with pytest.raises(RuntimeError, match=r"learner\.lora\.rank is 0"):
            worker.named_adapter_tensors()
        with pytest.raises(RuntimeError, match=r"learner\.lora\.rank is 0"):
            worker.adapter_config()
    finally:
        worker.close()


def test_export_writes_a_peft_adapter_and_on_request_the_merged_model(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from launcher.cli import build_parser
    from learner.export import MERGED_DIR, load_policy
    from learner.export import main as export_main

    torch.set_num_threads(1)
    overrides = {**lora_procs.LORA, "algorithm": {"adv_estimator": "grpo"}}
    worker = procs.make_worker(str(tiny_model_dir), 0, 1, procs.free_port(), overrides)
    ids = torch.tensor([[7, 12, 9, 30, 41, 8, 15, 22, 3, 19]])
    try:
        for step in range(2):
            worker.step(procs.make_batch(step), policy_version=step)
        worker.save_checkpoint(tmp_path / "ckpt", {"next_step": 2})
        worker.policy.eval()
        with torch.no_grad():
            learner_logits = worker.policy(input_ids=ids).logits
            with worker.policy.disable_adapter():
                base_logits = worker.policy(input_ids=ids).logits
        adapter_config = worker.adapter_config()
    finally:
        worker.close()
    assert (learner_logits - base_logits).abs().max().item() > 1e-4  # the adapters were trained

    out = tmp_path / "export"
    args = build_parser().parse_args(
        ["export", "--ckpt", str(tmp_path / "ckpt"), "--out", str(out), "--merged"]
    )
    assert export_main(args) == 0
    assert (out / "adapter_model.safetensors").is_file()
    written = json.loads((out / "adapter_config.json").read_text())
    assert set(written.pop("target_modules")) == set(adapter_config.pop("target_modules"))
    assert written == adapter_config
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    adapted = PeftModel.from_pretrained(base, out).eval()
    merged = AutoModelForCausalLM.from_pretrained(out / MERGED_DIR, local_files_only=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, learner_logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(merged(input_ids=ids).logits, learner_logits, atol=ATOL, rtol=0)
    # what `fleetrl weights push` reads from a LoRA checkpoint: the merged plain model
    pushed, _ = load_policy(tmp_path / "ckpt")
    assert not hasattr(pushed, "peft_config")
    _close(dict(pushed.named_parameters()), dict(merged.named_parameters()), atol=0.0)


def _demo_task_batch(model_dir):
    """GRPO groups of the demo task (add2): per prompt the right sum (score 1) and three wrong ones.

    Behaviour logprobs are the base model's own (the batch is on-policy at step 0).
    """
    from buffer.arrow_batch import trajectories_to_arrow
    from buffer.wire import Array, Trajectory
    from fleetrl.data.synth import get_task
    from fleetrl.models.loading import load_causal_lm, load_tokenizer
    from learner.batching import GlobalBatch
    from learner.packing import build_inputs, policy_forward

    tok = load_tokenizer(model_dir)
    instances = get_task("add2").instances()[::250][:4]
    trajectories = []
    for g, (question, answer) in enumerate(instances):
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tok(prompt, add_special_tokens=False).input_ids
        for k, text in enumerate([answer, str(int(answer) + 1), str(int(answer) + 2), "0"]):
            response = tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]
            trajectories.append(
                Trajectory(
                    uid=f"g{g}/{k}",
                    group_id=f"g{g}",
                    group_size=4,
                    prompt_ids=Array.of(prompt_ids, "int32"),
                    response_ids=Array.of(response, "int32"),
                    behavior_logprobs=Array.of([0.0] * len(response), "float32"),
                    token_versions=Array.of([0] * len(response), "int32"),
                    score=1.0 if k == 0 else 0.0,
                    finish_reason="stop",
                    prompt_index=g,
                )  # fmt: skip
            )
    batch = trajectories_to_arrow(trajectories)
    gb = GlobalBatch.from_arrow(batch)
    mb = build_inputs(gb, torch.arange(gb.size).numpy(), packing=True, device=torch.device("cpu"))
    with torch.no_grad():
        behaviour = policy_forward(load_causal_lm(model_dir).eval(), mb).logprobs
    for i, trajectory in enumerate(trajectories):
        span = behaviour[gb.response_offsets[i] : gb.response_offsets[i + 1]]
        trajectory.behavior_logprobs = Array.of(span.numpy(), "float32")
    return trajectories_to_arrow(trajectories)


def test_lora_training_lowers_the_loss_on_a_demo_task_batch(tiny_model_dir):
    from learner.batching import GlobalBatch

    torch.set_num_threads(1)
    batch = _demo_task_batch(tiny_model_dir)
    gb = GlobalBatch.from_arrow(batch)
    rewarded = torch.from_numpy(gb.scores == 1.0)[:, None]
    overrides = {
        "lora": {"rank": 8},
        "optim": {"lr": 3e-3, "weight_decay": 0.0},
        "algorithm": {"adv_estimator": "grpo"},
        "kl": {"use_kl_loss": False},
        "policy_loss": {"entropy_coeff": 0.0},
        "ppo_mini_batch_size": 0,
        # one batch is reused for 12 steps: the behaviour trust region would (by design) stop
        # its tokens once the policy is a clip range past the logprobs that sampled them
        "correction": {"decoupled_behavior_clip": False},
    }
    worker = procs.make_worker(str(tiny_model_dir), 0, 1, procs.free_port(), overrides)

    def nll() -> tuple[float, float]:
        """Mean negative logprob of the right answers' tokens (the loss RL should lower), wrong ones'."""
        plan = worker._plan(gb, torch.arange(gb.size).numpy())
        logprobs = worker._infer(worker.policy, gb, plan, values=False)
        tokens = (
            torch.arange(logprobs.shape[1])[None, :] < torch.from_numpy(gb.response_lens)[:, None]
        )
        right, wrong = tokens & rewarded, tokens & ~rewarded
        return (
            float(-(logprobs * right).sum() / right.sum()),
            float(-(logprobs * wrong).sum() / wrong.sum()),
        )

    try:
        right_before, wrong_before = nll()
        for step in range(12):
            worker.step(batch, policy_version=step)
        right_after, wrong_after = nll()
    finally:
        worker.close()
    print(
        f"NLL of the right answers {right_before:.3f} -> {right_after:.3f}, "
        f"of the wrong ones {wrong_before:.3f} -> {wrong_after:.3f}"
    )
    assert right_after < right_before - 0.5
    assert wrong_after - right_after > wrong_before - right_before + 0.5  # it learnt which is right
