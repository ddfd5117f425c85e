"""The end-of-run sample account: accepted, trained, lost and duplicated, from the audit
trail and the last step's metrics, and its line in the summary."""

from __future__ import annotations

import json

from launcher.report import summary_lines
from launcher.sample_account import TRAINED_GROUPS_FILE, account_line, sample_account

N = 4  # rollout.n


def _trail(run_dir, steps: list[tuple[int, list[str]]]) -> None:
    lines = [
        json.dumps({"step": s, "policy_version": s - 1, "groups": g, "num_samples": len(g) * N})
        for s, g in steps
    ]
    (run_dir / TRAINED_GROUPS_FILE).write_text("\n".join(lines) + "\n")


def test_a_clean_run_counts_what_it_trained_and_nothing_lost_or_twice(tmp_path):
    _trail(tmp_path, [(1, ["a", "b"]), (2, ["c", "d"])])
    last = {"buffer/accepted_samples": 24, "rollout/groups_failed": 0}
    account = sample_account(tmp_path, last, N)
    assert account == {
        "accepted": 24,
        "trained": 16,
        "lost": 0,
        "duplicated": 0,
        "refused_duplicates": 0,
    }
    assert account_line(account) == "samples: 24 accepted, 16 trained, 0 lost, 0 duplicated"


def test_groups_given_up_are_lost_and_a_group_in_two_steps_is_duplicated(tmp_path):
    # step 2 was trained, lost to a stop and trained again after the resume (the last
    # record of a step is the one that survives); step 3 trained group "b" a second time
    _trail(tmp_path, [(1, ["a", "b"]), (2, ["x", "y"]), (2, ["c", "d"]), (3, ["b", "e"])])
    last = {"rollout/groups_failed": 3, "buffer/rejected_frames.duplicates": 2}
    account = sample_account(tmp_path, last, N)
    assert account["trained"] == 24
    assert account["lost"] == 3 * N
    assert account["duplicated"] == N
    assert account["refused_duplicates"] == 2


def test_the_summary_prints_the_account(tmp_path):
    summary = {
        "run_dir": str(tmp_path),
        "sample_account": {"accepted": 8, "trained": 8, "lost": 0, "duplicated": 0},
    }
    assert "samples: 8 accepted, 8 trained, 0 lost, 0 duplicated" in summary_lines(summary)
