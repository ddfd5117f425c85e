"""The GPU check's report (bench.gpu.report): the table, the JSON, and the rules of the
folder a remote run brings back."""

from __future__ import annotations

import json
import os

from bench.gpu.report import (
    StageResult,
    headline,
    out_folder_problems,
    overall,
    render_table,
    write_report,
)


def test_skipped_stages_are_reported_but_only_a_failed_one_fails_the_check():
    ok = StageResult("learner", "ok")
    skipped = StageResult("sglang_engine", "skipped", "sglang is not installed")
    assert overall([ok, skipped]) is True
    assert overall([ok, skipped, StageResult("demo", "failed", "boom")]) is False


def test_the_table_shows_each_stages_headline_figures_or_its_reason():
    results = [
        StageResult("learner", "ok", seconds=12.3, limit_s=85,
                    figures={"sizes": {"hidden": 896}, "reps": 4, "tokens_per_s_packed": 1.5e5}),
        StageResult("demo", "failed", "fleetrl train exited with status 1", seconds=2.0),
    ]  # fmt: skip
    table = render_table(results, {"learner": ("tokens_per_s_packed",)})
    learner_line, demo_line = table.splitlines()[1:]
    assert "12.3/85" in learner_line and "tokens_per_s_packed=1.5e+05" in learner_line
    assert "reps" not in learner_line  # only the headline figures when they are named
    assert "failed" in demo_line and "exited with status 1" in demo_line
    assert headline(results[0]) == "reps=4, tokens_per_s_packed=1.5e+05"  # scalars only


def test_the_report_names_every_stage_with_status_why_and_figures(tmp_path):
    results = [StageResult("machine", "ok", figures={"device": "cpu"}),
               StageResult("sglang_demo", "skipped", "needs SGLang")]  # fmt: skip
    path = write_report(tmp_path, results, machine={"cores": 2}, config={"device": "cpu"},
                        summary={"machine.device": "cpu"})  # fmt: skip
    report = json.loads(path.read_text())
    assert report["ok"] is True
    assert report["counts"] == {"ok": 1, "failed": 0, "skipped": 1}
    assert report["summary"] == {"machine.device": "cpu"}
    assert [(s["name"], s["status"], s["why"]) for s in report["stages"]] == [
        ("machine", "ok", ""),
        ("sglang_demo", "skipped", "needs SGLang"),
    ]


def test_out_folder_problems_name_what_the_device_tool_would_not_bring_back(tmp_path):
    out = tmp_path / "out"
    (out / "a" / "b" / "c").mkdir(parents=True)
    (out / "gpu_check.json").write_text("{}")
    (out / "a" / "b" / "ok.txt").write_text("fine")
    (out / "a" / "b" / "c" / "deep.txt").write_text("too deep")
    (out / "bad name.txt").write_text("space")
    with open(out / "big.bin", "wb") as f:
        f.truncate(16 * 1024 * 1024 + 1)
    os.symlink(out / "gpu_check.json", out / "link.json")
    problems = out_folder_problems(out)
    assert any("deep.txt: deeper than" in p for p in problems)
    assert any(p.startswith("bad name.txt: a name") for p in problems)
    assert any(p.startswith("big.bin:") and "over 16 MiB" in p for p in problems)
    assert any(p.startswith("link.json: not a plain file") for p in problems)
    assert not any(p.startswith(("gpu_check.json", "a/b/ok.txt")) for p in problems)
    for i in range(8):
        (out / f"extra{i}.txt").write_text("x")
    assert any("files, at most 8 come back" in p for p in out_folder_problems(out))
