"""The GPU check's driver (bench.gpu.check): every stage in a process of its own, time-boxed,
within one budget; what a stage measured survives its failure, time-out or crash; the report
names every stage with ok, failed or skipped and why."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.gpu import check
from bench.gpu.report import REPORT_NAME, StageResult, out_folder_problems
from bench.gpu.stage import StageSpec

REPO = Path(__file__).resolve().parents[4]
FAKE = "tests.unit.bench.gpu_check.fake_stages"


def spec(name: str, function: str, limit: float = 60.0, min_s: float = 1.0) -> StageSpec:
    return StageSpec(name, f"{FAKE}:{function}", {"cpu": limit, "cuda": limit}, min_s=min_s)


def run_one(
    tmp_path: Path, name: str, function: str, limit: float = 60.0, **kw
) -> list[StageResult]:
    return check.run_stage_process(
        spec(name, function, limit),
        device="cpu",
        work=tmp_path,
        limit_s=limit,
        options={"colocated_push": "pkg.mod:push"},
        **kw,
    )


def test_a_passing_stage_reports_its_figures_from_its_own_process(tmp_path):
    [result] = run_one(tmp_path, "fast", "passes")
    assert result.status == "ok" and result.why == ""
    assert result.figures == {"tokens_per_s": 1234.5, "device": "cpu", "option": "pkg.mod:push"}
    assert 0 < result.seconds < 60 and result.limit_s == 60


def test_a_failed_check_keeps_its_figures_and_says_why_in_one_line(tmp_path):
    [result] = run_one(tmp_path, "demo", "check_fails")
    assert result.status == "failed"
    assert result.why == "logged 3 steps, not 5"
    assert result.figures == {"steps": 3}


def test_an_error_fails_the_stage_with_its_type_and_first_line_and_logs_the_traceback(tmp_path):
    [result] = run_one(tmp_path, "engine", "raises")
    assert (result.status, result.why) == ("failed", "RuntimeError: engine said no")
    assert "Traceback" in (tmp_path / "engine" / "stage.log").read_text()


def test_a_stage_that_lacks_what_it_needs_is_skipped_with_the_reason(tmp_path):
    [result] = run_one(tmp_path, "needs", "skips")
    assert (result.status, result.why) == ("skipped", "needs a thing this machine lacks")


def test_a_hanging_stage_is_ended_at_its_limit_and_keeps_what_it_measured(tmp_path):
    started = time.monotonic()
    [result] = run_one(tmp_path, "slow", "hangs_after_a_figure", limit=8.0)
    assert time.monotonic() - started < 8.0 + check.TERM_GRACE_S + 15
    assert (result.status, result.why) == ("failed", "over its 8 s limit")
    assert result.figures == {"measured_before_the_hang": 7.0}


def test_a_crashed_stage_fails_with_its_exit_status_and_keeps_what_it_measured(tmp_path):
    [result] = run_one(tmp_path, "crash", "crashes_after_a_figure")
    assert result.status == "failed"
    assert result.why.startswith("the stage process exited with status 3 before reporting")
    assert result.figures == {"measured_before_the_crash": 1.0}


def test_a_stage_gets_a_deadline_inside_its_limit(tmp_path):
    [result] = run_one(tmp_path, "timed", "respects_its_deadline", limit=6.0)
    assert result.status == "ok"
    assert 0 < result.figures["seconds_left_at_start"] < 6.0


def test_a_group_stage_that_dies_keeps_its_finished_parts_and_fails_the_rest(tmp_path):
    results = run_one(tmp_path, "group", "group_dies_midway", expected=("part_one", "part_two"))
    assert [(r.name, r.status) for r in results] == [("part_one", "ok"), ("part_two", "failed")]
    assert "exited with status 4" in results[1].why


def _argv(tmp_path: Path) -> list[str]:
    out, work = str(tmp_path / "out"), str(tmp_path / "work")
    return ["--device", "cpu", "--out", out, "--work", work, "--no-import-guard"]


def _args(tmp_path: Path, **changes) -> object:
    args = check.parse(_argv(tmp_path))
    for key, value in changes.items():
        setattr(args, key, value)
    return args


def test_stages_run_in_order_and_one_that_no_longer_fits_the_budget_is_skipped(tmp_path):
    stages = {
        "first": spec("first", "respects_its_deadline", limit=4.0),
        "second": spec("second", "passes", min_s=30.0),
    }
    results = check.run_check(_args(tmp_path, budget_s=10.0), stages)
    assert [(r.name, r.status) for r in results] == [("first", "ok"), ("second", "skipped")]
    assert results[1].why.startswith("the time budget is spent")
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert "==== first: the last" in log


def test_unknown_stage_names_are_refused_naming_the_known_ones(tmp_path):
    with pytest.raises(SystemExit, match=r"unknown stage\(s\) \['nope'\]"):
        check.run_check(_args(tmp_path, stages="nope"), {"first": spec("first", "passes")})


@pytest.mark.parametrize("stage", ["sglang", "vllm"])
def test_a_servers_stages_are_skipped_in_one_line_each_named_without_a_gpu(tmp_path, capsys, stage):
    from bench.gpu.plan import MULTI_STAGES

    results = check.run_check(_args(tmp_path, stages=stage))
    assert [r.name for r in results] == list(MULTI_STAGES[stage][0])
    assert all(r.status == "skipped" and "needs a GPU" in r.why for r in results)
    assert capsys.readouterr().out.count("skipped") == 1


def test_the_vllm_stages_run_on_a_cpu_only_against_a_named_server():
    from bench.gpu.plan import vllm_skip_reason

    assert "--vllm-server" in vllm_skip_reason("cpu", {})
    assert vllm_skip_reason("cpu", {"vllm_server": "pkg.mod:start"}) is None  # vllm is installed


def test_the_summary_lifts_headline_figures_and_pairs_mfu_with_the_measured_product():
    results = [
        StageResult("machine", "ok", figures={"matmul_tflops": 800.0, "device": "NVIDIA H200"}),
        StageResult(
            "learner",
            "ok",
            figures={"tflops_packed": 400.0, "tflops_padded": 200.0, "tokens_per_s_packed": 9.0},
        ),
    ]
    out = check.summary(results)
    assert out["machine.device"] == "NVIDIA H200" and out["learner.tokens_per_s_packed"] == 9.0
    assert out["learner.mfu_vs_measured_matmul_packed"] == pytest.approx(0.5)
    assert out["learner.mfu_vs_measured_matmul_padded"] == pytest.approx(0.25)


def test_main_writes_a_report_naming_every_stage_within_the_out_folder_limits(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(
        check, "STAGES", {"first": spec("first", "passes"), "second": spec("second", "check_fails")}
    )
    code = check.main(_argv(tmp_path))
    report = json.loads((tmp_path / "out" / REPORT_NAME).read_text())
    assert code == 1 and report["ok"] is False
    assert [(s["name"], s["status"]) for s in report["stages"]] == [
        ("first", "ok"),
        ("second", "failed"),
    ]
    assert report["counts"] == {"ok": 1, "failed": 1, "skipped": 0}
    assert out_folder_problems(tmp_path / "out") == []


def test_without_cuda_the_cuda_check_exits_2_with_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the no-GPU refusal cannot be observed here")
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2
    assert len(lines) == 1 and "no CUDA device" in lines[0]
    assert not (tmp_path / REPORT_NAME).exists()


def test_the_cuda_stages_fit_one_device_command_with_room_to_unpack():
    from bench.gpu.plan import MULTI_STAGES

    # the servers' stages (SGLang's, vLLM's) are skipped on the GPU machine: it cannot have them
    stages = [s for name, s in check.STAGES.items() if name not in MULTI_STAGES]
    assert sum(s.limit_s["cuda"] for s in stages) <= check.DEFAULT_BUDGET_S["cuda"]
    # the GPU machine runs one command for at most 600 s; unpacking and the driver need ~60
    assert check.DEFAULT_BUDGET_S["cuda"] <= 600 - 60
    script = (REPO / "scripts" / "device" / "gpu_check.sh").read_text()
    assert f"BUDGET_S:-{check.DEFAULT_BUDGET_S['cuda']:.0f}" in script
    docs = (REPO / "docs" / "gpu_check.md").read_text()  # the command the GPU check is run with
    assert "| `command` | `bash scripts/device/gpu_check.sh` |" in docs
    assert '| `carry` | `[".device-bundle"]` |' in docs
