"""The end-of-run summary: the held-out score before and after, and, when a reward model
scored the run, the rule's held-out score beside it, only as measured; the score curve's
points."""

from __future__ import annotations

from launcher.report import score_curve, summary_lines


def test_the_summary_gives_the_held_out_scores_and_the_rule_apart_from_a_reward_model():
    base = {"run_dir": "runs/x", "samples": 100, "train_wall_s": 10.0, "wall_s": 12.0}
    lines = summary_lines({**base, "initial_val_score": 0.12, "final_val_score": 0.969})
    assert lines[0] == "held-out score: 0.120 -> 0.969 (+0.849)"
    assert not any("rule score" in line for line in lines)
    both = summary_lines(
        {**base, "initial_val_score": 0.12, "final_val_score": 0.969,
         "initial_val_rule_score": 0.56, "final_val_rule_score": 0.985}
    )  # fmt: skip
    assert both[1] == "held-out rule score: 0.560 -> 0.985 (+0.425)"
    assert both[-1] == "run directory: runs/x"
    assert "100 samples in 10s (10.0 samples/s); whole run 12s" in both[2]


def test_the_curve_reads_validation_and_training_scores_by_step():
    metrics = [
        {"step": 0, "val/score/mean": 0.1},
        {"step": 1, "critic/score/mean": 0.3},
        {"step": 2, "critic/score/mean": 0.5, "val/score/mean": 0.6},
    ]
    assert score_curve(metrics) == ([(0, 0.1), (2, 0.6)], [(1, 0.3), (2, 0.5)])


def test_the_summary_prints_only_the_scores_validation_measured():
    base = {"run_dir": "runs/x"}
    before_only = summary_lines({**base, "initial_val_score": 0.2})
    assert before_only[0].startswith("held-out score before training: 0.200 (not validated after")
    assert not any("->" in line for line in before_only)
    after_only = summary_lines({**base, "final_val_score": 0.9, "final_val_step": 40})
    assert after_only[0] == "held-out score after step 40: 0.900"
    assert summary_lines(base) == ["run directory: runs/x"]


def test_a_validation_at_step_0_is_never_the_after_score():
    from launcher.train import Progress, measured_scores

    progress = Progress(val_scores=[(0, 0.2)], val_rule_scores=[(0, 0.5)])
    assert measured_scores(progress, rule=True) == {"val_scores": [(0, 0.2)]}
    progress.val_scores.append((5, 0.7))
    assert measured_scores(progress, rule=True)["final_val_score"] == 0.7
