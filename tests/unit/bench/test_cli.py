"""bench.cli: suite runs are called with the flags they accept, and failures become error records."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from bench import cli
from bench.common import read_json
from launcher.cli import build_parser


def test_bind_maps_flags_to_the_parameter_names_a_suite_uses():
    def run(out_dir, quick, reps, *, hidden_sizes=None, num_engines=1, batch_size=8):
        return {}

    kwargs, ignored = cli.bind_run_arguments(
        run, Path("o"), True, 2, {"hidden": [64, 128], "engines": 3, "batch": 4, "layers": 6}
    )
    assert kwargs == {
        "out_dir": Path("o"),
        "quick": True,
        "reps": 2,
        "hidden_sizes": [64, 128],
        "num_engines": 3,
        "batch_size": 4,
    }
    assert ignored == ["layers"]


def test_bind_passes_one_hidden_size_to_a_scalar_parameter_and_reports_the_rest():
    def run(out_dir, quick, hidden=64):
        return {}

    kwargs, ignored = cli.bind_run_arguments(run, Path("o"), False, None, {"hidden": [32, 256]})
    assert kwargs["hidden"] == 32 and "reps" not in kwargs
    assert ignored == ["hidden[1:]=[256]"]


def test_bind_reads_the_annotation_to_choose_one_size_or_the_list():
    def one(out_dir, quick, reps=None, hidden: int | None = None):
        return {}

    def many(out_dir, quick, hidden: list[int] | None = None):
        return {}

    assert cli.bind_run_arguments(one, Path("o"), True, None, {"hidden": [32]})[0] == {
        "out_dir": Path("o"),
        "quick": True,
        "hidden": 32,
    }
    assert cli.bind_run_arguments(many, Path("o"), True, 3, {"hidden": [32, 64]}) == (
        {"out_dir": Path("o"), "quick": True, "hidden": [32, 64]},
        ["reps"],
    )


def test_bind_refuses_a_run_with_required_parameters_it_cannot_fill():
    def run(out_dir, quick, reps, model_path):
        return {}

    with pytest.raises(cli.SuiteUnavailable, match="model_path"):
        cli.bind_run_arguments(run, Path("o"), True, 1, {})


def test_size_flags_keeps_only_what_the_user_set():
    args = build_parser().parse_args(["bench", "rollout", "--out", "x", "--layers", "4"])
    assert cli.size_flags(args) == {"layers": 4}
    args = build_parser().parse_args(["bench", "rollout", "--out", "x", "--device", "cuda"])
    assert cli.size_flags(args) == {"device": "cuda"}


def _fake_suite(monkeypatch, name: str, run) -> None:
    module = types.ModuleType(f"bench_fake_{name}")
    module.run = run
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(cli.SUITE_MODULES, name, module.__name__)


def test_run_suite_wraps_the_result_in_the_envelope_and_flags_missing_headlines(
    tmp_path, monkeypatch
):
    _fake_suite(
        monkeypatch,
        "transport",
        lambda out_dir, quick, reps: {"summary": {"vs_ray_queue": 3.0}, "results": {"x": 1}},
    )
    record = cli.run_suite("transport", tmp_path, quick=True, reps=1, flags={})
    on_disk = read_json(tmp_path / "transport.json")
    assert on_disk["status"] == "ok" and on_disk["summary"]["vs_ray_queue"] == 3.0
    assert on_disk["results"] == {"x": 1} and on_disk["machine"]["cpu_cores"] >= 1
    assert record["missing_headlines"] == ["vs_ray_queue_per_sample", "vs_raw_zmq"]


def test_a_missing_suite_module_is_recorded_as_unavailable(tmp_path, monkeypatch):
    monkeypatch.setitem(cli.SUITE_MODULES, "learner", "bench.no_such_module_for_test")
    record = cli.run_suite("learner", tmp_path, quick=True, reps=1, flags={})
    assert record["status"] == "error"
    assert record["error"].startswith("suite unavailable: cannot import bench.no_such_module")
    assert read_json(tmp_path / "learner.json")["status"] == "error"


def test_a_crashing_suite_is_recorded_with_its_exception(tmp_path, monkeypatch):
    def run(out_dir, quick, reps):
        raise RuntimeError("engine died")

    _fake_suite(monkeypatch, "rollout", run)
    record = cli.run_suite("rollout", tmp_path, quick=True, reps=1, flags={})
    assert record["error"] == "suite failed: RuntimeError: engine died"


def test_main_writes_the_report_and_exits_1_when_the_suite_failed(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(cli.SUITE_MODULES, "learner", "bench.no_such_module_for_test")
    args = build_parser().parse_args(["bench", "learner", "--out", str(tmp_path), "--quick"])
    assert cli.main(args) == 1
    assert (tmp_path / "report.md").is_file() and (tmp_path / "summary.png").is_file()
    assert "suite unavailable" in capsys.readouterr().out


def test_child_command_forwards_every_size_flag():
    args = build_parser().parse_args(
        ["bench", "all", "--out", "d", "--quick", "--hidden", "64", "128", "--learner-ranks", "2"]
    )
    cmd = cli._child_command("e2e", args, reps=1)
    assert cmd[1:6] == ["-m", "launcher.cli", "bench", "e2e", "--out"]
    assert "--quick" in cmd and cmd[cmd.index("--hidden") + 1 : cmd.index("--hidden") + 3] == [
        "64",
        "128",
    ]
    assert cmd[cmd.index("--learner-ranks") + 1] == "2"


def test_a_child_of_all_writes_its_json_but_leaves_the_report_to_the_parent(
    tmp_path, monkeypatch, capsys
):
    _fake_suite(
        monkeypatch,
        "learner",
        lambda out_dir, quick: {"summary": {"packed_vs_padded": 1.2}},
    )
    monkeypatch.setenv(cli.CHILD_ENV, "1")
    args = build_parser().parse_args(["bench", "learner", "--out", str(tmp_path), "--quick"])
    assert cli.main(args) == 0
    assert read_json(tmp_path / "learner.json")["summary"]["packed_vs_padded"] == 1.2
    assert not (tmp_path / "report.md").exists() and capsys.readouterr().out == ""
