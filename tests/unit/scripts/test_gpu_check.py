"""scripts/gpu_check.py on a machine without a GPU: it refuses in one line, and its
figure and report functions work on fake inputs (the GPU stages run under `make gpu-check`)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["gpu_check"]


def test_without_cuda_it_exits_2_with_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the no-GPU refusal cannot be observed here")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
    )
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2
    assert len(lines) == 1 and "no CUDA device" in lines[0]
    assert not (tmp_path / "gpu_check.json").exists()


def test_logprob_figures_report_the_largest_and_mean_difference(gpu_check):
    figures = gpu_check.logprob_figures([[-1.0, -2.0], [-0.5]], [[-1.1, -2.0], [-0.25]])
    assert figures["tokens"] == 3
    assert figures["max_abs_diff"] == pytest.approx(0.25)
    assert figures["mean_abs_diff"] == pytest.approx(0.35 / 3)
    with pytest.raises(ValueError, match="engine gave 2 logprobs, learner 1"):
        gpu_check.logprob_figures([[-1.0, -2.0]], [[-1.0]])


def test_sync_figures_are_medians_and_ratios_to_the_baselines(gpu_check):
    figures = gpu_check.sync_figures([10.0, 12.0, 11.0], [20.0, 22.0, 24.0], [2.0, 2.5, 3.0])
    assert figures["bucket_gbps"] == 11.0
    assert figures["raw_broadcast_gbps"] == 22.0
    assert figures["bucket_vs_raw"] == pytest.approx(0.5)
    assert figures["bucket_vs_per_tensor"] == pytest.approx(4.4)
    missing = gpu_check.sync_figures([10.0], [], [])
    assert missing["bucket_vs_raw"] is None and missing["per_tensor_gbps"] is None


def test_demo_figures_read_losses_from_metrics_jsonl(gpu_check):
    lines = [
        json.dumps({"step": 0, "val/score/mean": 0.1}),
        json.dumps({"step": 1, "actor/pg_loss": 0.5, "timing_s/step": 1.25}),
        json.dumps({"step": 2, "actor/pg_loss": -0.25, "timing_s/step": 1.0}),
        "",
    ]
    figures = gpu_check.demo_figures(lines)
    assert figures == {"steps": 2, "pg_losses": [0.5, -0.25], "step_s": [1.25, 1.0]}


def test_a_failing_or_slow_stage_is_recorded_and_the_report_says_so(gpu_check, tmp_path):
    results = []

    def passes(figures):
        figures["tokens_per_s"] = 1234.5
        return True

    def fails(_figures):
        raise RuntimeError("engine said no\nsecond line")

    def too_slow(_figures):
        time.sleep(5)
        return True

    gpu_check.run_stage("throughput", passes, 5, results)
    gpu_check.run_stage("weight_sync", fails, 5, results)
    gpu_check.run_stage("demo", too_slow, 0.2, results)
    assert [r.ok for r in results] == [True, False, False]
    assert results[1].error == "RuntimeError: engine said no"
    assert "StageTimeout" in results[2].error and results[2].seconds < 2
    table = gpu_check.render_table(results)
    assert "tokens_per_s=1234" in table and "FAIL" in table
    path = gpu_check.write_report(tmp_path, results, {"gpus": 0})
    report = json.loads(path.read_text())
    assert report["ok"] is False
    assert [s["name"] for s in report["stages"]] == ["throughput", "weight_sync", "demo"]
    assert report["stages"][0]["figures"]["tokens_per_s"] == 1234.5
    assert math.isfinite(report["stages"][2]["seconds"])
