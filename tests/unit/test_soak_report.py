"""scripts/soak_report.py: growth and drift per window after warm-up; the audit finds
groups trained twice, lost groups and accepted fuzz."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from buffer.bank import RolloutBank
from buffer.synthetic import make_group

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from soak_report import audit, summarize  # noqa: E402


def _sample(t: float, step: int, rss: float) -> dict:
    return {"t": t, "step": step, "load": 1.0, "roles": {"buffer": {"pid": 7, "rss_mb": rss}},
            "disk_mb": {"rollout bank": 1.0}}  # fmt: skip


def test_growth_and_drift_compare_the_first_and_last_windows_after_warmup():
    # warm-up 0-60 s (RSS climbs, ignored); then 2 steps/10 s, then 1.5 steps/10 s
    samples = [_sample(t, t // 5, 100 + t) for t in range(0, 61, 10)]
    samples += [_sample(t, 12 + (t - 60) // 5, 160) for t in range(70, 121, 10)]
    samples += [_sample(t, 24 + int((t - 120) * 0.15), 168) for t in range(130, 181, 10)]
    s = summarize(samples, samples_per_step=10, warmup_s=60, window_s=60)
    assert [round(w["samples_per_s"], 2) for w in s["throughput"]] == [2.0, 1.5]
    assert round(s["throughput_drift"], 3) == -0.25
    assert round(s["roles"]["buffer"]["growth"], 3) == round(
        (160 + 6 * 168) / 7 / 160 - 1, 3
    )  # windows share their edge


def test_audit_counts_duplicates_lost_and_fuzz(tmp_path):
    run = tmp_path / "run"
    bank = RolloutBank(run / "rollout_bank", segment_rows=64)
    bank.append(make_group("p9", 2) + make_group("fuzz-x", 2))
    bank.close()
    trail = [{"groups": ["p0", "p1", "p2"]}, {"groups": ["p2", "p4", "p8"]}]
    (run / "trained_groups.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trail))
    a = audit(run, margin=4)
    assert a["duplicated_groups"] == 1  # p2
    assert a["frontier_prompt"] == 9
    assert a["lost_groups"] == 1 and a["lost_prompt_indexes"] == [3]  # 5-7 are in flight
    assert a["in_flight_at_stop"] == 3
    assert a["fuzz_groups_accepted"] == 1
