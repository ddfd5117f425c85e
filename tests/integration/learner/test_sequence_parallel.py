"""Ulysses sequence parallelism: 2 gloo ranks splitting every sequence equal one rank.

Logprobs, critic values and gradients (through the all-to-alls around attention,
the packed block-diagonal mask and the output gather), then a whole learner step
(GAE with a critic, KL loss, entropy bonus): metrics and updated weights.
The max abs differences are printed (run with ``-s``).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

from tests.integration.learner import procs, sp_procs

ATOL = 1e-5
# AdamW's first step moves each weight by about lr·g/(|g| + eps): for gradient entries near
# zero, float noise in g (≤ 1e-6 here) can change the step by a fraction of lr (1e-3).
WEIGHTS_ATOL = 1e-4


@pytest.mark.timeout(900)  # three processes; minutes on a loaded 2-core machine
def test_sequence_parallel_2_equals_1_in_logprobs_gradients_and_a_step(tiny_model_dir, tmp_path):
    mp.spawn(
        sp_procs.run_sp,
        args=(2, procs.free_port(), str(tiny_model_dir), str(tmp_path)),
        nprocs=2,
        join=True,
    )
    sp_procs.run_sp(0, 1, procs.free_port(), str(tiny_model_dir), str(tmp_path))
    one, two = torch.load(tmp_path / "sp1.pt"), torch.load(tmp_path / "sp2.pt")
    diffs = {
        "logprobs": (one["logprobs"] - two["logprobs"]).abs().max().item(),
        "values": (one["values"] - two["values"]).abs().max().item(),
        "grads": max((one["grads"][n] - two["grads"][n]).abs().max().item() for n in one["grads"]),
        "weights after a step": max(
            (one["weights"][n] - two["weights"][n]).abs().max().item() for n in one["weights"]
        ),
    }
    print("SP 2 vs SP 1 max abs diff:", diffs)
    assert one["grads"].keys() == two["grads"].keys()
    assert max(g.abs().max().item() for g in one["grads"].values()) > 1e-3  # a real gradient
    assert one["values"].abs().max().item() > 1e-3
    for name, diff in diffs.items():
        assert diff < (WEIGHTS_ATOL if name == "weights after a step" else ATOL), name
    m1 = json.loads((tmp_path / "sp1_metrics.json").read_text())
    m2 = json.loads((tmp_path / "sp2_metrics.json").read_text())
    for key in (
        "actor/pg_loss",
        "actor/kl_loss",
        "critic/vf_loss",
        "actor/entropy",
        "actor/grad_norm",
    ):
        assert m2[key] == pytest.approx(m1[key], abs=ATOL), key
