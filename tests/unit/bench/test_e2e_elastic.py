"""bench.e2e_elastic without Ray: the join's figures from a run's rows (when it completed,
the windows compared, the others' lost share) and the suite driven by a fake trainer."""

from __future__ import annotations

import json
from pathlib import Path

from bench import e2e, e2e_elastic
from bench.report import suite_headlines
from tests.unit.bench.test_e2e_analysis import TINY

SIZES = e2e.dataclasses.replace(TINY, total_steps=14, warmup_steps=2, test_freq=100)


def rows(step_s: float, *, joined_at: int | None = None, pause_s: float = 0.1) -> list[dict]:
    """Training rows: ``step_s`` a step; with ``joined_at``, two engines serve from there
    (steps twice as fast), the publish before it paused 0.5 s more and re-formed the group."""
    out, clock = [], 10.0
    for step in range(1, SIZES.total_steps + 1):
        fast = joined_at is not None and step > joined_at
        clock += step_s / 2 if fast else step_s
        row = {
            "step": step,
            "timing_s/step": step_s,
            "time/elapsed_s": clock,
            "weight_sync/paused_s": pause_s + (0.5 if step == joined_at else 0.0),
        }
        if joined_at is not None:
            serving = 2 if step >= joined_at else 1
            row.update({"fleet/joins": float(step >= joined_at), "fleet/engines": serving})
            row.update({"fleet/engines_target": 2 if step >= 6 else 1, "fleet/join_s_max": 3.0 if step >= joined_at else 0.0})  # fmt: skip
            if step == joined_at + 1:
                row["fleet/regroup_s"] = 0.2
        out.append(row)
    return out


def test_join_figures_find_the_join_and_charge_the_others_only_what_the_join_added():
    figures = e2e_elastic.join_figures(rows(1.0, joined_at=8), sent_at=6, sync_every=1)
    assert figures["joined_at_step"] == 8 and figures["settled_at_step"] == 10
    assert figures["join_s_max"] == 3.0
    assert abs(figures["extra_pause_s"] - 0.5) < 1e-9 and figures["regroup_s"] == 0.2
    # steps 7..10: 1 + 1 + 0.5 + 0.5 s of wall clock
    assert abs(figures["others_lost_share"] - 0.7 / 3.0) < 1e-9
    no_join = e2e_elastic.join_figures(rows(1.0, joined_at=None), sent_at=6, sync_every=1)
    assert no_join["joined_at_step"] is None and "others_lost_share" not in no_join


def test_the_suite_compares_the_same_steps_after_the_join_with_a_fixed_fleet(tmp_path, monkeypatch):
    seen = []

    def fake_train(cfg):
        elastic = cfg.rollout.elastic
        seen.append((cfg.rollout.num_engines, elastic, cfg.rollout.max_engines))
        run_dir = Path(cfg.trainer.output_dir)
        run_dir.mkdir(parents=True)
        metrics = run_dir / "metrics.jsonl"
        data = rows(1.0, joined_at=8) if elastic else rows(0.5)
        metrics.write_text("".join(json.dumps(r) + "\n" for r in data))
        return {"run_dir": str(run_dir), "metrics_path": str(metrics)}

    class Sent:  # the scale request, as the thread would record it at step 6
        def __init__(self, run_dir, step, engines):
            self.sent_at_step, self.error = 6, ""

        def start(self):
            pass

        def stop(self):
            pass

    monkeypatch.setattr(e2e_elastic, "ScaleAt", Sent)
    out = e2e.run(tmp_path, quick=True, elastic=True, train_fn=fake_train, sizes=SIZES, reps=2)
    assert seen == [(1, True, 2), (2, False, 0), (2, False, 0), (1, True, 2)]  # alternated
    summary = out["summary"]
    # from two versions after the join (step 10) on, the grown fleet runs as fast as the
    # fixed one; before the request, one engine against two: half the rate
    assert summary["join_vs_fixed"] == 1.0 and summary["join_goal_met"] is True
    assert summary["before_join_vs_fixed"] == 0.5
    assert summary["others_lost_share"] > 0.05 and summary["lost_goal_met"] is False
    record = json.loads((tmp_path / "e2e.json").read_text())
    assert [k for k, _, _ in suite_headlines("e2e", record)] == ["join_vs_fixed", "others_lost_share"]  # fmt: skip
