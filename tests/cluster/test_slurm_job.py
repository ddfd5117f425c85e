"""scripts/slurm/fleetrl.sbatch under a real Slurm: slurmctld and two slurmd (n1, n2) from
Debian's packages on this machine (slurm_site.py).

One two-node job trains the CPU demo: the Ray head on n1 (the driver beside it), a worker
on n2 carrying the `learner` and `rollout` resources. Halfway, after a checkpoint,
``scontrol requeue`` ends it; Slurm starts it again and it resumes from that checkpoint
(the sbatch file's --requeue with trainer.resume=auto) and finishes with the held-out
score risen and exit status 0. After each run no Ray process of the job is left on either
node. A second job whose run fails (a bad config value) passes its exit status on.

Ray nodes listen on 127.0.0.2 (FLEETRL_HEAD_IP): Ray turns 127.0.0.1 into the host's
address, and these tests stay on loopback.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
from pathlib import Path

import pytest

from tests.cluster.slurm_site import SlurmSite, missing_tools

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "scripts" / "slurm" / "fleetrl.sbatch"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm():
    missing = missing_tools()
    if missing:
        pytest.skip(
            f"Slurm test: {' '.join(missing)} not installed (apt-get install slurm-wlm munge)"
        )
    site = SlurmSite()
    site.start()
    yield site
    site.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _job_env(slurm: SlurmSite, ray_tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in slurm.env.items() if k != "RAY_ADDRESS"}
    env.update(
        PATH=f"{Path(sys.executable).parent}:{env['PATH']}",
        FLEETRL_LEARNER_NODES="n2",
        FLEETRL_ROLLOUT_NODES="n2",
        FLEETRL_HEAD_IP="127.0.0.2",
        FLEETRL_RAY_PORT=str(_free_port()),
        FLEETRL_RAY_TEMP_DIR=str(ray_tmp),
        # a loaded 2-core machine starts a Ray node's agents slowly
        RAY_agent_register_timeout_ms="180000",
        RAY_raylet_start_wait_time_s="180",
        FLEETRL_RAY_WAIT_S="1200",
    )
    return env


def _submit(slurm: SlurmSite, env: dict[str, str], out: Path, *train_args: str) -> str:
    cmd = ["sbatch", "--parsable", "-N", "2", f"--output={out}", f"--chdir={REPO}", str(SBATCH)]
    result = slurm.run([*cmd, *train_args], env=env)
    return result.stdout.strip().split(";")[0]


def _job_state(slurm: SlurmSite, job_id: str) -> dict[str, str]:
    out = slurm.run(["scontrol", "show", "job", job_id, "--oneliner"], check=False).stdout
    return dict(re.findall(r"(\w+)=(\S+)", out))


def _wait_for(check, timeout: float, what: str, log: Path, slurm: SlurmSite):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            text = log.read_text(errors="replace")[-6000:] if log.exists() else "(no job log)"
            pytest.fail(f"timed out waiting for {what}\n{text}\n{slurm.logs()}")
        time.sleep(1)
    return result


def _ray_processes(ray_tmp: Path) -> list[str]:
    """Processes whose command line names this job's Ray session folder (raylets, GCS,
    agents, workers): any of them left after the job is a Ray node not stopped."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(ray_tmp) in cmdline:
            found.append(f"{proc.name}: {cmdline[:160]}")
    return found


def _assert_ray_stopped(ray_tmp: Path) -> None:
    deadline = time.monotonic() + 60
    while (left := _ray_processes(ray_tmp)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, "Ray processes left after the job:\n" + "\n".join(left)


def _checkpoints(run_dir: Path) -> list[int]:
    folder = run_dir / "checkpoints"
    return (
        sorted(int(p.name.split("_")[1]) for p in folder.glob("step_*")) if folder.is_dir() else []
    )


@pytest.mark.timeout(3600)
def test_two_node_job_trains_demo_requeues_resumes_and_stops_ray(slurm, tmp_path: Path):
    ray_tmp = Path(f"/tmp/frl-ray-{os.getpid()}")  # short: Ray's unix sockets live under it
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    env = _job_env(slurm, ray_tmp)
    job_id = _submit(
        slurm, env, log,
        "--config", "configs/demo_cpu.yaml", f"trainer.output_dir={run_dir}",
        f"model.path={tmp_path / 'model'}", f"data.train_files=[{tmp_path / 'data/train.parquet'}]",
        f"data.val_files=[{tmp_path / 'data/test.parquet'}]",
        "trainer.total_steps=12", "trainer.test_freq=6", "trainer.save_freq=2",
    )  # fmt: skip
    try:
        # first run: requeue it once a checkpoint exists and it has gone on training after it
        _wait_for(lambda: len(_checkpoints(run_dir)) >= 2, 2400, "two checkpoints", log, slurm)
        slurm.run(["scontrol", "requeue", job_id])
        _wait_for(
            lambda: _job_state(slurm, job_id).get("JobState") == "COMPLETED"
            or _job_state(slurm, job_id).get("JobState") in ("FAILED", "CANCELLED", "TIMEOUT"),
            1500, "the requeued job to end", log, slurm,
        )  # fmt: skip
    finally:
        if _job_state(slurm, job_id).get("JobState") in ("RUNNING", "PENDING", "REQUEUED"):
            slurm.run(["scancel", job_id], check=False)
    text = log.read_text(errors="replace")
    state = _job_state(slurm, job_id)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", (
        f"{state}\n{text[-6000:]}"
    )
    assert state["Restarts"] == "1"

    # the plan: the head on n1 carries no role; n2 carries both, on both runs
    assert text.count("ray on n1 with resources {}") == 2, text[-6000:]
    assert text.count('ray on n2 with resources {"learner":1,"rollout":1}') == 2
    assert "(restart 1)" in text
    assert text.count("ray stopped on n1") >= 2 and text.count("ray stopped on n2") >= 2
    assert "fleetrl train exited 0" in text
    _assert_ray_stopped(ray_tmp)

    # the second run resumed from a checkpoint of the first and finished the run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] is not None, summary
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "actor/pg_loss" in r]
    assert steps[-1] == 12 and sorted(set(steps)) == list(range(1, 13))
    vals = [(r["step"], r["val/score/mean"]) for r in records if "val/score/mean" in r]
    assert vals[0][0] == 0 and vals[-1][0] == 12, vals
    assert vals[-1][1] > vals[0][1] + 0.2, f"held-out score did not rise: {vals}"


@pytest.mark.timeout(900)
def test_failed_run_passes_its_exit_status_on_and_stops_ray(slurm, tmp_path: Path):
    ray_tmp = Path(f"/tmp/frl-ray-{os.getpid()}-fail")
    log = tmp_path / "job.out"
    env = _job_env(slurm, ray_tmp)
    job_id = _submit(
        slurm, env, log, "--config", "configs/demo_cpu.yaml", "trainer.total_steps=many"
    )
    state = _wait_for(
        lambda: (s := _job_state(slurm, job_id)).get("JobState") in ("COMPLETED", "FAILED") and s,
        600, "the job to end", log, slurm,
    )  # fmt: skip
    text = log.read_text(errors="replace")
    assert state["ExitCode"] == "2:0", f"{state}\n{text[-4000:]}"
    assert "trainer.total_steps" in text  # the run's own one-line config error
    assert "fleetrl train exited 2" in text
    assert "ray stopped on n1" in text and "ray stopped on n2" in text
    _assert_ray_stopped(ray_tmp)
