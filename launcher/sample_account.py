"""The end-of-run account of samples: accepted, trained, lost, duplicated.

Read at the end of ``fleetrl train`` (``launcher.train.execute``) from what the run left:

- **accepted**: samples the buffer took into its durable bank (``buffer/accepted_samples``
  of the last step's metrics; a resumed run's buffer counts its bank from the start);
- **trained**: samples of the groups every learner step trained on, along the surviving
  history (``trained_groups.jsonl``: a step trained again after a resume replaces the lost
  one);
- **lost**: samples of groups given up after ``rollout.max_sample_attempts`` engine
  failures (``rollout/groups_failed`` × ``rollout.n``): work an engine that died or left
  took with it. Requests regenerated elsewhere are not lost;
- **duplicated**: samples trained more than once (a group in two steps of that history).

``refused_duplicates`` (samples that reached the buffer twice, e.g. re-sent after a buffer
restart, and were dropped there, never trained twice) is reported beside them.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

TRAINED_GROUPS_FILE = "trained_groups.jsonl"  # the groups of every learner step (rank 0 writes)


def trained_lineage(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    """Step -> the audit record of the step that survives (the last one written for it)."""
    path = Path(run_dir) / TRAINED_GROUPS_FILE
    lineage: dict[int, dict[str, Any]] = {}
    if not path.is_file():
        return lineage
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            lineage[int(record["step"])] = record
    return lineage


def sample_account(
    run_dir: str | Path, last_metrics: dict[str, Any], group_size: int
) -> dict[str, int]:
    """The four counts (and ``refused_duplicates``); see the module docstring."""
    lineage = trained_lineage(run_dir)
    steps = [lineage[s] for s in sorted(lineage)]
    times = Counter(g for record in steps for g in record["groups"])
    return {
        "accepted": int(last_metrics.get("buffer/accepted_samples", 0)),
        "trained": sum(int(record["num_samples"]) for record in steps),
        "lost": int(last_metrics.get("rollout/groups_failed", 0)) * group_size,
        "duplicated": sum(n - 1 for n in times.values()) * group_size,
        "refused_duplicates": int(last_metrics.get("buffer/rejected_frames.duplicates", 0)),
    }


def account_line(account: dict[str, int]) -> str:
    return (
        f"samples: {account['accepted']} accepted, {account['trained']} trained, "
        f"{account['lost']} lost, {account['duplicated']} duplicated"
    )
