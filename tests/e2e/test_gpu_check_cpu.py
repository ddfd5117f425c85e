"""``scripts/gpu_check.py --device cpu``: every stage of the GPU check runs its code path at
tiny sizes on the CPU, with what the GPU machine (one H200, Python 3.12, torch 2.11, no
package registry; docs/gpu_check.md) lacks refused (the import guard), so that a run on a
GPU cannot die on a typo, a missing module or a bad config key.

Marked ``device_check`` (``make device-check``): 13.5 minutes on a loaded 2-core machine
without the ``colocated`` stage, which takes about a minute more (53 and 67 s, run alone).
The vLLM stages, which a CPU has no vLLM server for, run apart against vLLM's own app over
the conformance harness (``tests.conformance.vllm.launch.gpu_check_server``): about 3 minutes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu.plan import MULTI_STAGES, STAGES, VLLM_STAGE_NAMES
from bench.gpu.report import REPORT_NAME, out_folder_problems

REPO = Path(__file__).resolve().parents[2]
RUN_LIMIT_S = 2700
pytestmark = [pytest.mark.device_check, pytest.mark.timeout(RUN_LIMIT_S + 60)]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_check_cpu")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--device", "cpu",
         "--out", str(root / "out"), "--work", str(root / "work")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_LIMIT_S,
    )  # fmt: skip
    print(proc.stdout[-6000:])
    report = json.loads((root / "out" / REPORT_NAME).read_text())
    return proc, report, root


def stage(report: dict, name: str) -> dict:
    return next(s for s in report["stages"] if s["name"] == name)


def test_every_stage_is_named_and_each_one_that_can_run_here_is_ok(report):
    proc, data, _ = report
    names = [s["name"] for s in data["stages"]]
    servers = [name for stage_names, _ in MULTI_STAGES.values() for name in stage_names]
    expected = [name for stage in STAGES for name in MULTI_STAGES.get(stage, ((stage,), None))[0]]  # fmt: skip
    assert names == expected
    not_ok = {s["name"]: s["why"] for s in data["stages"]
              if s["status"] != "ok" and s["name"] not in servers}  # fmt: skip
    assert not not_ok, not_ok
    for name in servers:
        assert stage(data, name)["status"] == "skipped"
        assert "needs a GPU" in stage(data, name)["why"]
    assert proc.returncode == 0 and data["ok"] is True


def test_the_stages_measured_what_they_say(report):
    _, data, _ = report
    learner = stage(data, "learner")["figures"]
    assert learner["tokens_per_s_packed"] > 0 and learner["tokens_per_s_padded"] > 0
    assert learner["plan_learner_gib"] > 0 and learner["peak_gib_packed"] > 0
    rollout = stage(data, "rollout")["figures"]
    assert rollout["engine_tokens_per_s"] > 0 and rollout["hf_generate_tokens_per_s"] > 0
    sync = stage(data, "weight_sync")["figures"]
    assert sync["checksum_matches"] is True and sync["gloo_bucketed_gbps"] > 0
    assert sync["colocated"].startswith("not wired in")
    coloc = stage(data, "colocated")["figures"]
    assert coloc["ipc_ok"] is True and coloc["memory_returned"] is True
    assert coloc["device_bytes_freed"] >= 0.8 * coloc["push_bytes"] > 0
    assert coloc["forward_unchanged"] is True and coloc["switch_s"] > 0
    demo = stage(data, "demo")["figures"]
    assert demo["steps"] == 5 and all(math.isfinite(x) for x in demo["pg_losses"])
    accuracy = stage(data, "accuracy")["figures"]
    assert accuracy["grid_complete"] is True
    assert accuracy["final_score_eta0"] is not None and accuracy["final_score_eta4"] is not None


def test_nothing_of_fleetrls_asked_for_what_the_machine_lacks(report):
    _, data, _ = report
    guard = data["machine"]["import_guard"]
    assert guard["on"] is True
    ours = {module: [c for c in callers if c.startswith(str(REPO)) and "/.venv/" not in c]
            for module, callers in guard["refused"].items()}  # fmt: skip
    assert not {m: c for m, c in ours.items() if c}, ours


def test_the_report_folder_is_what_the_device_tool_brings_back(report):
    _, _, root = report
    assert out_folder_problems(root / "out") == []
    assert sorted(p.name for p in (root / "out").iterdir()) == ["gpu_check.json", "gpu_check.log"]


@pytest.fixture(scope="module")
def vllm_report(tmp_path_factory):
    """The vLLM stages alone, on vLLM's own app and weight-transfer engine (the conformance
    harness) instead of a CUDA server: the import guard is off (the harness is vLLM)."""
    root = tmp_path_factory.mktemp("gpu_check_vllm")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--device", "cpu",
         "--stages", "vllm", "--no-import-guard",
         "--vllm-server", "tests.conformance.vllm.launch:gpu_check_server",
         "--out", str(root / "out"), "--work", str(root / "work")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    print(proc.stdout[-4000:])
    return proc, json.loads((root / "out" / REPORT_NAME).read_text())


def test_the_vllm_stages_run_their_code_on_vllms_own_app_at_tiny_sizes(vllm_report):
    proc, data = vllm_report
    assert [s["name"] for s in data["stages"]] == list(VLLM_STAGE_NAMES)
    assert {s["name"]: s["status"] for s in data["stages"]} == dict.fromkeys(VLLM_STAGE_NAMES, "ok")
    assert stage(data, "vllm_engine")["figures"]["weight_version"] == "0"
    logprobs = stage(data, "vllm_logprobs")["figures"]
    assert logprobs["sampled_max_abs_diff"] <= logprobs["tolerance"] and logprobs["tokens"] > 0
    assert stage(data, "vllm_throughput")["figures"]["tokens_per_s"] > 0
    sync = stage(data, "vllm_weight_sync")["figures"]
    assert sync["version_after_push"] == "1" and sync["greedy_output_changed"] is True
    assert proc.returncode == 0
