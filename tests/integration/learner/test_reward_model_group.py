"""The reward-model learner group on CPU (gloo): rank and split invariance, resume, export, LoRA.

A 2-rank run (spawned processes, packed micro-batches of one pair, a checkpoint after
step 2) is shared by the tests of this module; every comparison is against an
independent run or computation of the same quantity.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.integration.learner import rm_procs

ATOL = 1e-5
# several spawned 2-rank runs: minutes on a loaded 2-core machine
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def pair_file(tmp_path_factory):
    return rm_procs.write_pairs(tmp_path_factory.mktemp("pairs") / "pairs.parquet")


@pytest.fixture(scope="module")
def two_rank_run(tiny_model_dir, pair_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("rm2")
    rm_procs.spawn(rm_procs.run_rank, 2, str(tiny_model_dir), str(pair_file), str(out), "train", {})
    return out


def _weights(run, scenario: str, step: int) -> dict[str, torch.Tensor]:
    return torch.load(run / f"{scenario}_weights_step{step}.pt")


def _assert_close(a: dict, b: dict, atol: float = ATOL) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


def _hf_scores(folder, pair_file, model_dir) -> np.ndarray:
    """The exported folder as a user loads it: transformers' sequence classifier, one pair at a time."""
    from transformers import AutoModelForSequenceClassification

    from fleetrl.data.pairs import PreferencePairs
    from fleetrl.models.loading import load_tokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    pairs = PreferencePairs([pair_file], load_tokenizer(model_dir), max_length=64)
    with torch.no_grad():
        return np.array([
            [model(input_ids=torch.tensor([seq.tolist()])).logits[0, 0].item() for seq in side]
            for side in ([pairs.chosen(i) for i in range(len(pairs))], [pairs.rejected(i) for i in range(len(pairs))])
        ])  # fmt: skip


def test_two_ranks_packed_train_like_one_rank_padded_in_one_micro_batch_with_checkpointing(
    two_rank_run, tiny_model_dir, pair_file, tmp_path
):
    one = {"max_tokens_per_micro_batch": 100000, "packing": False, "grad_checkpointing": True}
    rm_procs.spawn(rm_procs.run_rank, 1, str(tiny_model_dir), str(pair_file), str(tmp_path), "train", one)  # fmt: skip
    two_metrics = json.loads((two_rank_run / "train_metrics.json").read_text())
    one_metrics = json.loads((tmp_path / "train_metrics.json").read_text())
    for step in range(rm_procs.STEPS):
        for key in ("train/loss", "train/acc", "train/chosen_reward", "train/reject_reward"):
            assert two_metrics[step][key] == pytest.approx(one_metrics[step][key], abs=ATOL), key
        # a norm near 2 summed in another order: relative rounding
        assert two_metrics[step]["train/grad_norm"] == pytest.approx(one_metrics[step]["train/grad_norm"], rel=1e-4)  # fmt: skip
        _assert_close(_weights(two_rank_run, "train", step + 1), _weights(tmp_path, "train", step + 1))  # fmt: skip
    scores_two = np.load(two_rank_run / "train_scores.npy")
    np.testing.assert_allclose(scores_two, np.load(tmp_path / "train_scores.npy"), atol=ATOL)
    # the comparison is between trained models: the loss fell and every weight moved
    assert two_metrics[-1]["train/loss"] < two_metrics[0]["train/loss"]
    first, last = _weights(two_rank_run, "train", 1), _weights(two_rank_run, "train", 4)
    assert min((first[n] - last[n]).abs().max().item() for n in first) > 0


def test_resume_in_fresh_processes_continues_the_same_curve(two_rank_run, tiny_model_dir, pair_file):  # fmt: skip
    rm_procs.spawn(rm_procs.run_rank, 2, str(tiny_model_dir), str(pair_file), str(two_rank_run), "resume", {})  # fmt: skip
    for step in (3, 4):
        _assert_close(_weights(two_rank_run, "resume", step), _weights(two_rank_run, "train", step), atol=1e-6)  # fmt: skip
    train = json.loads((two_rank_run / "train_metrics.json").read_text())
    resume = json.loads((two_rank_run / "resume_metrics.json").read_text())
    assert len(resume) == 2  # steps 3 and 4 only
    for got, want in zip(resume, train[2:], strict=True):
        assert got["train/lr"] == want["train/lr"]  # the schedule resumed where it was
        assert got["train/loss"] == pytest.approx(want["train/loss"], abs=1e-6)  # the same pairs


def test_the_exported_folder_scores_what_the_trainer_scored(two_rank_run, tiny_model_dir, pair_file):  # fmt: skip
    from safetensors import safe_open

    folder = two_rank_run / "train_rm"
    with safe_open(folder / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "score.weight" in names and not any(n.startswith("lm_head") for n in names)
    np.testing.assert_allclose(
        _hf_scores(folder, pair_file, tiny_model_dir), np.load(two_rank_run / "train_scores.npy"), atol=ATOL
    )  # fmt: skip


def test_lora_trains_adapters_and_head_and_exports_one_merged_folder(tiny_model_dir, pair_file, tmp_path):  # fmt: skip
    from safetensors.torch import load_file

    lora = {
        "lora": {"rank": 4, "alpha": 8.0},
        "optim": {"lr": 1e-2, "warmup_steps": 1, "eps": 1e-6},
    }
    rm_procs.run_here(str(tiny_model_dir), str(pair_file), str(tmp_path), lora)
    exported = load_file(tmp_path / "train_rm" / "model.safetensors")
    base = load_file(tiny_model_dir / "model.safetensors")
    # merged: Hugging Face names only, the backbone's shapes, and the adapters folded in
    assert not any("lora" in n or "base_layer" in n for n in exported)
    assert set(exported) == {n for n in base if n.startswith("model.")} | {"score.weight"}
    moved = [
        n for n in exported if n.endswith("q_proj.weight") and not torch.equal(exported[n], base[n])
    ]
    assert moved, "the adapters were not merged into the exported weights"
    untouched = "model.embed_tokens.weight"  # no adapter there: exactly the base
    assert torch.equal(exported[untouched], base[untouched])
    np.testing.assert_allclose(
        _hf_scores(tmp_path / "train_rm", pair_file, tiny_model_dir), np.load(tmp_path / "train_scores.npy"), atol=ATOL
    )  # fmt: skip
    metrics = json.loads((tmp_path / "train_metrics.json").read_text())
    assert metrics[-1]["train/loss"] < metrics[0]["train/loss"]


def test_training_continues_from_a_reward_model_folder_head_included(two_rank_run, pair_file):
    from fleetrl.data.pairs import PreferencePairs
    from fleetrl.models.loading import load_tokenizer

    folder = two_rank_run / "train_rm"
    torch.set_num_threads(1)
    worker = rm_procs.make_worker(str(folder), 0, 1, rm_procs.free_port(), {})
    try:
        assert worker.head_from_folder  # the score head was read, not initialised
        pairs = PreferencePairs([pair_file], load_tokenizer(folder), max_length=64)
        chosen, rejected = worker.score(pairs.to_arrow(np.arange(len(pairs))))
        np.testing.assert_allclose(np.stack([chosen, rejected]), np.load(two_rank_run / "train_scores.npy"), atol=ATOL)  # fmt: skip
        before = worker.score(pairs.to_arrow(np.arange(len(pairs))))[0]
        worker.step(pairs.to_arrow(np.arange(6)))
        assert not np.allclose(worker.score(pairs.to_arrow(np.arange(len(pairs))))[0], before)
    finally:
        worker.close()
