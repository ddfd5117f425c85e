"""bench.common: medians, ratios, alternating repetitions, JSON records, machine facts."""

from __future__ import annotations

import json
import math

import pytest

from bench.common import (
    alternate,
    end_process_group,
    machine_info,
    median,
    ratio,
    suite_json_path,
    suite_record,
    write_json,
)


def test_median_ignores_non_finite_values_and_handles_even_counts():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert median([1.0, math.nan, 5.0, math.inf]) == 3.0
    assert math.isnan(median([]))


def test_ratio_is_none_when_a_side_is_missing_zero_or_not_finite():
    assert ratio(6.0, 3.0) == 2.0
    assert ratio(None, 3.0) is None
    assert ratio(1.0, 0.0) is None
    assert ratio(math.nan, 1.0) is None


def test_alternate_discards_warmup_and_reverses_the_order_on_odd_rounds():
    calls: list[str] = []

    def make(name: str, value: float):
        def measure() -> float:
            calls.append(name)
            return value

        return measure

    out = alternate({"a": make("a", 2.0), "b": make("b", 1.0)}, reps=3, warmup=1)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert out["a"]["reps"] == [2.0, 2.0, 2.0]
    assert out["a"]["median"] == 2.0 and out["b"]["max"] == 1.0


def test_alternate_stops_at_its_deadline_after_at_least_one_round():
    import time

    clock = {"t": 0.0}

    def measure() -> float:
        clock["t"] += 1.0
        return 1.0

    deadline = time.monotonic() + 0.2
    out = alternate({"a": measure}, reps=50, warmup=0, deadline=deadline)
    assert len(out["a"]["reps"]) >= 1
    time.sleep(0.25)
    late = alternate({"a": measure}, reps=50, warmup=0, deadline=deadline)
    assert late["a"]["reps"] == [1.0]  # past the deadline: one round, not none


def test_end_process_group_stops_a_child_and_what_it_started():
    import subprocess
    import sys

    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    end_process_group(proc, grace_s=5.0)
    assert proc.poll() is not None
    import time

    deadline = time.monotonic() + 10  # the grandchild got the signal too; it ends soon after
    while time.monotonic() < deadline:
        alive = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True)
        if not alive.stdout.strip():
            break
        time.sleep(0.1)
    assert alive.stdout.strip() == ""  # nothing left in its process group


def test_alternate_rejects_zero_repetitions():
    with pytest.raises(ValueError, match="reps"):
        alternate({"a": lambda: 1.0}, reps=0)


def test_write_json_turns_nan_into_null_and_tuples_into_lists(tmp_path):
    path = write_json(tmp_path / "x" / "s.json", {"v": math.nan, "t": (1, 2), "p": tmp_path})
    data = json.loads(path.read_text())
    assert data == {"v": None, "t": [1, 2], "p": str(tmp_path)}
    assert not list((tmp_path / "x").glob(".*tmp"))


def test_suite_record_carries_machine_versions_and_error_status():
    record = suite_record("transport", config={"quick": True}, error="suite unavailable: x")
    assert record["status"] == "error" and record["error"] == "suite unavailable: x"
    machine = record["machine"]
    for key in ("cpu_model", "cpu_cores", "memory_gib", "versions", "git_commit"):
        assert key in machine
    assert set(machine["versions"]) >= {"torch", "ray", "pyzmq", "msgspec", "pyarrow"}
    assert machine_info()["cpu_cores"] >= 1


def test_suite_json_path_uses_the_cli_suite_name(tmp_path):
    assert suite_json_path(tmp_path, "weight-sync") == tmp_path / "weight-sync.json"
