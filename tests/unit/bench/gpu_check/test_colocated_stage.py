"""The GPU check's ``colocated`` stage without an engine: the figures it derives from
``check_colocated``'s (bytes released, memory returned, IPC ok, the switch's seconds), the
checks that fail it (``bench.colocated_check.problems``), and its verdict through the stage
interface, with ``check_colocated`` replaced by stand-ins that report known figures."""

from __future__ import annotations

import time

import pytest

from bench import colocated_check
from bench.gpu import colocated
from bench.gpu.plan import STAGES
from bench.gpu.stage import StageContext, run_in_this_process

MIB = 2**20


def cycle_figures(**changes) -> dict:
    """What ``check_colocated`` reports for a switch in which every check held."""
    figures = {
        "bytes_reported": 130 * MIB, "release_s": 0.05, "device_bytes_freed": 120 * MIB,
        "resume_weights_s": 0.01, "push_s": 0.2, "push_gbps": 0.5, "push_bytes": 100 * MIB,
        "resume_kv_s": 0.02, "served_version": "1", "device": "cuda", "offload_s": 0.3,
        "learner_bytes_freed": 400 * MIB, "onload_s": 0.4, "forward_unchanged": True,
    }  # fmt: skip
    return {**figures, **changes}


def context(tmp_path, device: str = "cuda") -> StageContext:
    return StageContext("colocated", device, tmp_path, time.monotonic() + 60,
                        tmp_path / "result.json")  # fmt: skip


def test_the_switch_is_every_part_a_step_pays_and_the_headlines_say_what_held():
    out = colocated.headline_figures(cycle_figures(), "cuda")
    assert out["switch_s"] == pytest.approx(0.05 + 0.3 + 0.4 + 0.01 + 0.2 + 0.02)
    assert out["bytes_released"] == 130 * MIB
    assert out["memory_returned"] is True and out["ipc_ok"] is True
    assert out["transport"] == "cuda_ipc"
    assert colocated.headline_figures(cycle_figures(), "cpu")["transport"].startswith(
        "shared_memory_file"
    )


def test_a_release_that_gave_back_too_little_and_a_stale_version_read_false():
    out = colocated.headline_figures(
        cycle_figures(device_bytes_freed=50 * MIB, served_version="0"), "cuda"
    )
    assert out["memory_returned"] is False and out["ipc_ok"] is False


def test_a_cycle_stopped_after_the_release_derives_only_what_it_measured():
    partial = {"bytes_reported": 130 * MIB, "release_s": 0.05, "device_bytes_freed": 120 * MIB}
    out = colocated.headline_figures(partial, "cuda")
    assert out["bytes_released"] == 130 * MIB
    assert not {"memory_returned", "ipc_ok", "switch_s"} & set(out)


def test_a_switch_in_which_everything_held_has_no_problems_on_either_device():
    assert colocated_check.problems(cycle_figures(), "cuda") == []
    cpu = cycle_figures(learner_bytes_freed=0, offload_s=0.0, onload_s=0.0)
    assert colocated_check.problems(cpu, "cpu") == []


@pytest.mark.parametrize(
    ("changes", "device", "says"),
    [
        ({"served_version": "0"}, "cuda", "serves version '0', not '1'"),
        ({"device_bytes_freed": 10 * MIB}, "cuda", "under 80 % of the 104857600 pushed"),
        ({"device_bytes_freed": None}, "cpu", "gave back None bytes"),
        ({"forward_unchanged": False}, "cpu", "forward changed"),
        ({"learner_bytes_freed": 0}, "cuda", "offload freed 0 bytes"),
    ],
)
def test_each_check_that_did_not_hold_is_named(changes, device, says):
    [problem] = colocated_check.problems(cycle_figures(**changes), device)
    assert says in problem


def test_the_learner_offload_freeing_nothing_is_expected_on_cpu_only():
    figures = cycle_figures(learner_bytes_freed=0)
    assert colocated_check.problems(figures, "cpu") == []
    assert len(colocated_check.problems(figures, "cuda")) == 1


def test_the_stage_passes_with_its_headline_figures_when_every_check_held(tmp_path, monkeypatch):
    def holds(out_dir, figures, device):
        figures.update(cycle_figures(device=device))
        return True

    monkeypatch.setattr(colocated_check, "check_colocated", holds)
    [result] = run_in_this_process(context(tmp_path), "bench.gpu.colocated")
    assert (result.status, result.why) == ("ok", "")
    assert set(STAGES["colocated"].headline) <= set(result.figures)
    assert result.figures["switch_s"] > 0 and result.figures["wall_s"] >= 0


def test_the_stage_fails_naming_every_check_that_did_not_hold(tmp_path, monkeypatch):
    def fails(out_dir, figures, device):
        figures.update(cycle_figures(served_version="0", learner_bytes_freed=0))
        return False

    monkeypatch.setattr(colocated_check, "check_colocated", fails)
    [result] = run_in_this_process(context(tmp_path), "bench.gpu.colocated")
    assert result.status == "failed"
    assert "serves version '0'" in result.why and "offload freed 0 bytes" in result.why
    assert result.figures["ipc_ok"] is False and result.figures["memory_returned"] is True


def test_a_cycle_that_raised_keeps_what_it_measured(tmp_path, monkeypatch):
    def dies_after_the_release(out_dir, figures, device):
        figures.update(bytes_reported=130 * MIB, release_s=0.05, device_bytes_freed=120 * MIB)
        raise RuntimeError("the engine exited with 1")

    monkeypatch.setattr(colocated_check, "check_colocated", dies_after_the_release)
    [result] = run_in_this_process(context(tmp_path, "cpu"), "bench.gpu.colocated")
    assert (result.status, result.why) == ("failed", "RuntimeError: the engine exited with 1")
    assert result.figures["bytes_released"] == 130 * MIB and "switch_s" not in result.figures
