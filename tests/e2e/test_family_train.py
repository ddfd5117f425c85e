"""`fleetrl train` end to end on a family that is not Llama-shaped: the CPU demo with a tiny GPT-2
(``transformer.h`` blocks, Conv1D projections, learned positions, a tied head, a byte-level
BPE tokenizer without a pad token) trains a few GRPO steps, every version reaches the engine,
the checkpoint exports, and the exported model served by the embedded engine gives the greedy
tokens transformers gives."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e.test_demo_loop import ENV, REPO

STEPS = 3


@pytest.mark.timeout(600)
def test_a_tiny_gpt2_trains_exports_and_serves_what_transformers_generates(tmp_path: Path):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "launcher.cli", "train", "--config", "configs/demo_cpu.yaml",
        "model.tiny.arch=gpt2", f"model.path={tmp_path / 'model'}", "model.warmstart.steps=0",
        # an untrained model scores 0 everywhere (no advantage): the entropy bonus still moves it
        "learner.policy_loss.entropy_coeff=0.01",
        f"trainer.output_dir={run_dir}", f"trainer.total_steps={STEPS}",
        f"trainer.save_freq={STEPS}", "trainer.test_freq=-1",
        f"data.train_files=[{tmp_path / 'data' / 'train.parquet'}]",
        f"data.val_files=[{tmp_path / 'data' / 'test.parquet'}]", "data.val_max_samples=16",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "actor/pg_loss" in r]
    assert [r["policy_version"] for r in trained] == list(range(1, STEPS + 1))
    assert all(r["weight_sync/num_failed"] == 0 for r in trained)
    assert all(r["actor/skipped_nonfinite"] == 0 for r in trained)

    from fleetrl.models.loading import load_causal_lm, load_tokenizer
    from rollout_fleet.engine.runner import ModelRunner
    from tests.unit.rollout_fleet.test_engine_runner import SHARPEN, Harness, hf_greedy

    export = tmp_path / "export"
    done = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "export", "--ckpt", str(run_dir / "checkpoints"),
         "--out", str(export)], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    model = load_causal_lm(export).eval()
    assert type(model).__name__ == "GPT2LMHeadModel"
    trained_start = load_causal_lm(tmp_path / "model")
    assert not torch.equal(model.transformer.h[0].attn.c_attn.weight,
                           trained_start.transformer.h[0].attn.c_attn.weight)  # fmt: skip
    tokenizer = load_tokenizer(export)
    messages = [{"role": "user", "content": "What is 41 + 8?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    harness = Harness(export)
    try:
        assert isinstance(harness.runner, ModelRunner)
        # a few steps leave near-flat logits, where float rounding of different batch shapes
        # could flip an argmax: the same sharper head on both sides tests the engine instead
        with torch.no_grad():
            for served in (model, harness.runner.model):
                served.get_output_embeddings().weight.mul_(SHARPEN)
        seqs, finished = harness.submit(prompt, temperature=0.0, max_new_tokens=8, ignore_eos=True)
        assert finished.wait(60)
        assert seqs[0].output_ids == hf_greedy(model, prompt, 8)
    finally:
        harness.close()
