"""The FSDP2 learner group on CPU (gloo): split invariance, weight streaming, resume, export.

One 2-rank training run (spawned processes, 4 steps, checkpoint after step 2) is
shared by the tests of this module; 1-rank runs happen in the test process.
Every comparison is against an independent computation of the same quantity.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from tests.integration.learner import procs

ATOL = 1e-5


@pytest.fixture(scope="module")
def two_rank_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("learner2")
    procs.spawn(procs.run_rank, 2, str(tiny_model_dir), str(out), "train", {})
    return out


def one_rank_steps(model_dir, steps: int, overrides=None, out_dir=None, max_response_length=0):
    """Run ``steps`` steps on one rank in this process; returns (metrics, weights per step)."""
    torch.set_num_threads(1)
    worker = procs.make_worker(
        str(model_dir), 0, 1, procs.free_port(), overrides or {}, max_response_length
    )
    metrics, weights = [], []
    try:
        for step in range(steps):
            metrics.append(worker.step(procs.make_batch(step), policy_version=step))
            weights.append(procs.full_weights(worker))
            if out_dir is not None:
                worker.save_checkpoint(out_dir, {"next_step": step + 1})
    finally:
        worker.close()
    return metrics, weights


def assert_weights_close(a: dict, b: dict, atol: float = ATOL) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


def test_two_ranks_equal_one_rank_and_micro_batch_split_does_not_change_token_mean(
    two_rank_run, tiny_model_dir
):
    # One rank, one big micro-batch per mini-batch, vs the 2-rank run with a 24-token budget.
    big_metrics, big_weights = one_rank_steps(
        tiny_model_dir, 2, {"max_tokens_per_micro_batch": 100000}
    )
    two_metrics = json.loads((two_rank_run / "train_metrics.json").read_text())
    for step in range(2):
        for key in ("actor/pg_loss", "actor/kl_loss", "critic/vf_loss", "actor/entropy"):
            assert two_metrics[step][key] == pytest.approx(big_metrics[step][key], abs=ATOL), key
        two_weights = torch.load(two_rank_run / f"train_weights_step{step + 1}.pt")
        assert_weights_close(two_weights, big_weights[step])
    # The weights really moved (the comparison above is not between two untouched models).
    from fleetrl.models.loading import load_causal_lm

    start = dict(load_causal_lm(tiny_model_dir).named_parameters())
    moved = max((big_weights[0][n] - start[n]).abs().max().item() for n in start)
    assert moved > 1e-4
    # One rank with the small budget (many micro-batches) matches one big micro-batch.
    small_metrics, small_weights = one_rank_steps(tiny_model_dir, 1)
    assert small_metrics[0]["actor/pg_loss"] == pytest.approx(
        big_metrics[0]["actor/pg_loss"], abs=ATOL
    )
    assert_weights_close(small_weights[0], big_weights[0])


def test_named_full_tensors_yields_every_hf_parameter_once_with_full_shapes(
    two_rank_run, tiny_model_dir
):
    from fleetrl.models.loading import load_causal_lm

    reference = load_causal_lm(tiny_model_dir)
    expected = {name: tuple(p.shape) for name, p in reference.named_parameters()}
    streamed = torch.load(two_rank_run / "train_weights_step1.pt")
    assert list(streamed) == [n for n, _ in reference.named_parameters()]
    assert {name: tuple(t.shape) for name, t in streamed.items()} == expected


def test_resume_in_fresh_processes_matches_uninterrupted_run(two_rank_run, tiny_model_dir):
    procs.spawn(procs.run_rank, 2, str(tiny_model_dir), str(two_rank_run), "resume", {})
    for step in (3, 4):
        uninterrupted = torch.load(two_rank_run / f"train_weights_step{step}.pt")
        resumed = torch.load(two_rank_run / f"resume_weights_step{step}.pt")
        assert_weights_close(resumed, uninterrupted, atol=1e-6)
    train = json.loads((two_rank_run / "train_metrics.json").read_text())
    resume = json.loads((two_rank_run / "resume_metrics.json").read_text())
    assert resume[0]["actor/lr"] == train[2]["actor/lr"]
    assert resume[0]["actor/pg_loss"] == pytest.approx(train[2]["actor/pg_loss"], abs=1e-6)


def test_a_plain_one_rank_checkpoint_resumes_on_two_fsdp_ranks_and_back(
    two_rank_run, tiny_model_dir, tmp_path
):
    """One rank trains without FSDP2 (learner.model_build.uses_fsdp), two with it: the DCP
    checkpoint each writes resumes on the other, and the resumed steps match."""
    for world, source in ((1, two_rank_run), (2, tmp_path / "one_rank")):
        if world == 2:  # the one-rank run whose checkpoint two ranks resume
            source.mkdir()
            procs.spawn(procs.run_rank, 1, str(tiny_model_dir), str(source), "train", {})
        resumed = tmp_path / f"resume_on_{world}"
        shutil.copytree(source / "ckpt", resumed / "ckpt")
        procs.spawn(procs.run_rank, world, str(tiny_model_dir), str(resumed), "resume", {})
        for step in (3, 4):
            assert_weights_close(
                torch.load(resumed / f"resume_weights_step{step}.pt"),
                torch.load(source / f"train_weights_step{step}.pt"),
            )


def test_corrupt_checkpoint_falls_back_and_export_round_trips(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.checkpoint import latest_complete_checkpoint
    from learner.export import export_checkpoint

    root = tmp_path / "ckpt"
    _, weights = one_rank_steps(
        tiny_model_dir, 2, {"algorithm": {"adv_estimator": "grpo"}}, out_dir=root
    )
    assert latest_complete_checkpoint(root) == root / "step_2"
    (root / "step_2" / "meta.json").write_text("{not json")  # corrupt the newest
    shutil.copytree(root / "step_1", root / "step_3.tmp")  # an interrupted save
    (root / "step_3.tmp" / "COMPLETE").unlink()
    assert latest_complete_checkpoint(root) == root / "step_1"

    exported = export_checkpoint(root, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    assert_weights_close(dict(model.named_parameters()), weights[0], atol=0.0)
    assert AutoTokenizer.from_pretrained(exported).encode("12+3") == AutoTokenizer.from_pretrained(
        tiny_model_dir
    ).encode("12+3")


def test_non_finite_loss_skips_the_update_and_reports_it(tiny_model_dir):
    import pyarrow as pa

    torch.set_num_threads(1)
    worker = procs.make_worker(
        str(tiny_model_dir),
        0,
        1,
        procs.free_port(),
        {"algorithm": {"adv_estimator": "grpo"}, "ppo_mini_batch_size": 0},
    )
    try:
        before = procs.full_weights(worker)
        batch = procs.make_batch(0)
        column = batch.schema.get_field_index("behavior_logprobs")
        poisoned = batch.column(column).to_pylist()
        poisoned[2] = [float("nan")] * len(poisoned[2])
        batch = batch.set_column(
            column, "behavior_logprobs", pa.array(poisoned, pa.list_(pa.float32()))
        )
        metrics = worker.step(batch, policy_version=0)
        assert metrics["actor/skipped_nonfinite"] == 1.0
        assert_weights_close(procs.full_weights(worker), before, atol=0.0)
        metrics = worker.step(procs.make_batch(1), policy_version=1)  # a clean batch trains
        assert metrics["actor/skipped_nonfinite"] == 0.0
    finally:
        worker.close()


def test_packed_rows_under_a_budget_train_as_one_row(tiny_model_dir, monkeypatch):
    """The worker bin-packs a micro-batch into rows of learner.packed_row_tokens (sdpa has no
    varlen kernels) and trains exactly as with the whole micro-batch in one row."""
    import learner.worker

    shapes: list[tuple[int, int]] = []
    build = learner.worker.build_inputs

    def recording(*args, **kwargs):
        mb = build(*args, **kwargs)
        shapes.append(tuple(mb.input_ids.shape))
        return mb

    monkeypatch.setattr(learner.worker, "build_inputs", recording)
    big = {"max_tokens_per_micro_batch": 100000}
    one_metrics, one_weights = one_rank_steps(
        tiny_model_dir, 1, {**big, "packed_row_tokens": 100000}
    )
    assert {rows for rows, _ in shapes} == {1}
    shapes.clear()
    rows_metrics, rows_weights = one_rank_steps(tiny_model_dir, 1, {**big, "packed_row_tokens": 24})
    assert min(rows for rows, _ in shapes) > 1 and max(width for _, width in shapes) <= 24
    assert rows_metrics[0]["actor/pg_loss"] == pytest.approx(
        one_metrics[0]["actor/pg_loss"], abs=ATOL
    )
    assert_weights_close(rows_weights[0], one_weights[0])


GSPO = {
    "algorithm": {"adv_estimator": "grpo"},
    "policy_loss": {"loss_mode": "gspo", "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4},
    "kl": {"use_kl_loss": False},
}


def test_gspo_steps_are_finite_move_the_weights_and_ignore_the_micro_batch_split(
    tiny_model_dir,
):
    """loss_mode=gspo through the worker: decoupled correction, 6 mini-batches per step (so
    π_θ drifts from π_prox and the sequence clip binds), seq-mean-token-mean with the global
    sequence count: many small micro-batches train exactly as one big one."""
    from fleetrl.models.loading import load_causal_lm

    small_metrics, small_weights = one_rank_steps(tiny_model_dir, 2, GSPO)
    for metrics in small_metrics:
        assert metrics["actor/skipped_nonfinite"] == 0.0
        assert all(math.isfinite(v) for v in metrics.values()), metrics
        assert 0.9 < metrics["actor/seq_ratio_mean"] < 1.1
    assert small_metrics[1]["actor/pg_clipfrac"] > 0  # the GSPO clip is active
    start = dict(load_causal_lm(tiny_model_dir).named_parameters())
    moved = max((small_weights[0][n] - start[n]).abs().max().item() for n in start)
    assert moved > 1e-4
    big_metrics, big_weights = one_rank_steps(
        tiny_model_dir, 2, {**GSPO, "max_tokens_per_micro_batch": 100000}
    )
    for step in range(2):
        assert big_metrics[step]["actor/pg_loss"] == pytest.approx(
            small_metrics[step]["actor/pg_loss"], abs=ATOL
        )
        assert_weights_close(big_weights[step], small_weights[step])
    vanilla_metrics, vanilla_weights = one_rank_steps(
        tiny_model_dir, 1, {**GSPO, "policy_loss": {"loss_mode": "vanilla"}}
    )
    assert "actor/seq_ratio_mean" not in vanilla_metrics[0]
    apart = max((vanilla_weights[0][n] - small_weights[0][n]).abs().max().item() for n in start)
    assert apart > 1e-5  # not vacuous: GSPO trains to other weights than PPO


SUM_NORM = {
    "policy_loss": {"loss_agg_mode": "seq-mean-token-sum-norm", "entropy_coeff": 0.01},
    "critic": {"optim": {"lr": 1e-3}, "loss_agg_mode": "seq-mean-token-sum-norm"},
}


def test_seq_mean_token_sum_norm_divides_by_a_constant_whatever_the_micro_batch_split(
    tiny_model_dir,
):
    """Dr. GRPO's constant is the maximum response length, not each micro-batch's padded
    width: with a 24-token budget (micro-batches of widths 1 to 20) the step trains exactly
    as with one micro-batch, and the constant, not the widths, sets the loss's scale."""
    small_metrics, small_weights = one_rank_steps(
        tiny_model_dir, 2, SUM_NORM, max_response_length=20
    )
    big_metrics, big_weights = one_rank_steps(
        tiny_model_dir, 2, {**SUM_NORM, "max_tokens_per_micro_batch": 100000},
        max_response_length=20,
    )  # fmt: skip
    for step in range(2):
        for key in ("actor/pg_loss", "actor/kl_loss", "critic/vf_loss"):
            assert small_metrics[step][key] == pytest.approx(big_metrics[step][key], abs=ATOL)
        assert_weights_close(small_weights[step], big_weights[step])
    # one mini-batch, so every loss is taken before any update: twice the constant, half the loss
    whole = {**SUM_NORM, "ppo_mini_batch_size": 0}
    single, _ = one_rank_steps(tiny_model_dir, 1, whole, max_response_length=20)
    doubled, _ = one_rank_steps(tiny_model_dir, 1, whole, max_response_length=40)
    for key in ("actor/pg_loss", "actor/kl_loss", "critic/vf_loss"):
        assert doubled[0][key] == pytest.approx(single[0][key] / 2, rel=1e-6), key
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm needs its constant"):
        procs.make_worker(str(tiny_model_dir), 0, 1, procs.free_port(), SUM_NORM)


def test_critic_warmup_trains_only_the_critic_then_the_policy(tiny_model_dir):
    """learner.critic.warmup_steps=1: the first step leaves the policy, its optimizer and LR
    schedule as they were and reports no actor update; the second trains both."""
    from fleetrl.models.loading import load_causal_lm

    metrics, weights = one_rank_steps(tiny_model_dir, 2, {"critic": {"warmup_steps": 1}})
    start = dict(load_causal_lm(tiny_model_dir).named_parameters())
    first_move = max((weights[0][n] - start[n]).abs().max().item() for n in start)
    second_move = max((weights[1][n] - weights[0][n]).abs().max().item() for n in start)
    assert first_move == 0.0 and second_move > 1e-4
    assert "actor/pg_loss" not in metrics[0] and "actor/grad_norm" not in metrics[0]
    assert metrics[0]["critic/vf_loss"] > 0 and math.isfinite(metrics[0]["critic/grad_norm"])
    # warm-up (lr 1e-3 after 1 warm-up step): the policy's schedule did not advance in step 1
    assert metrics[0]["actor/lr"] == metrics[1]["actor/lr"]
    assert "actor/pg_loss" in metrics[1]


def test_critic_starts_from_its_own_folder_whose_vocabulary_covers_the_policys(
    tiny_model_dir, tmp_path
):
    from fleetrl.models.tiny import make_tiny_model

    same = tmp_path / "critic"
    shutil.copytree(tiny_model_dir, same)
    metrics, _ = one_rank_steps(tiny_model_dir, 1, {"critic": {"model_path": str(same)}})
    assert math.isfinite(metrics[0]["critic/vf_loss"])
    small = make_tiny_model(tmp_path / "small_vocab", alphabet="0123456789")
    with pytest.raises(ValueError, match=r"learner\.critic\.model_path.*fewer than the policy"):
        one_rank_steps(tiny_model_dir, 1, {"critic": {"model_path": str(small)}})


def test_optimizer_offload_keeps_the_state_on_the_host_between_steps_and_trains_alike(
    tiny_model_dir, tmp_path
):
    """learner.optimizer_offload: both optimizers (policy, critic) stream their state chunk
    by chunk through the update (the GPU's path; on the CPU the moves are no-ops), the
    trained weights equal those of a run without it, and a checkpoint holds the same state."""
    _, plain = one_rank_steps(tiny_model_dir, 2)
    torch.set_num_threads(1)
    offload = {"optimizer_offload": True, "optimizer_offload_chunk_mb": 1}
    worker = procs.make_worker(str(tiny_model_dir), 0, 1, procs.free_port(), offload)
    try:
        assert set(worker.offloaded) == {id(worker.optimizer), id(worker.critic_optimizer)}
        for step in range(2):
            worker.step(procs.make_batch(step), policy_version=step)
            for offloaded in worker.offloaded.values():
                assert offloaded.state_devices() == {torch.device("cpu")}
        assert_weights_close(procs.full_weights(worker), plain[-1], atol=0.0)
        assert all(o.chunks_stepped > 2 for o in worker.offloaded.values())  # in chunks
        moments = {k: v.clone() for k, v in worker.optimizer.state[next(worker.policy.parameters())].items()}  # fmt: skip
        worker.load_checkpoint(worker.save_checkpoint(tmp_path, {"next_step": 2}))
        restored = worker.optimizer.state[next(worker.policy.parameters())]
        assert all(torch.equal(restored[k], v) for k, v in moments.items())
        assert all(o.state_devices() == {torch.device("cpu")} for o in worker.offloaded.values())
    finally:
        worker.close()
