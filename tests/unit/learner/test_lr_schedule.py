"""The LR schedule: linear warm-up given in steps or, as verl's lr_warmup_steps_ratio, as a
fraction of the run; then constant or cosine down to min_lr_ratio."""

from __future__ import annotations

import pytest

from learner.config import OptimConfig
from learner.fsdp import lr_factor, warmup_steps


def test_warmup_ratio_is_a_fraction_of_the_runs_steps_unless_steps_are_given():
    assert warmup_steps(OptimConfig(warmup_ratio=0.1), total_steps=50) == 5
    assert warmup_steps(OptimConfig(warmup_ratio=0.1, total_steps=200), total_steps=50) == 20
    assert warmup_steps(OptimConfig(warmup_steps=3, warmup_ratio=0.1), total_steps=50) == 3
    factors = [lr_factor(s, OptimConfig(warmup_ratio=0.1), 50) for s in range(7)]
    assert factors == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0])


def test_cosine_after_a_ratio_warmup_reaches_the_floor_at_the_end():
    cfg = OptimConfig(warmup_ratio=0.2, schedule="cosine", min_lr_ratio=0.1)
    assert lr_factor(1, cfg, 10) == pytest.approx(1.0)  # the last of 2 warm-up steps
    assert lr_factor(2, cfg, 10) == pytest.approx(1.0)  # cosine starts at the top
    assert lr_factor(10, cfg, 10) == pytest.approx(0.1)
