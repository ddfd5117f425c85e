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
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from learner.checkpoint import latest_complete_checkpoint
from tests.cluster.slurm_site import SlurmSite

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "scripts" / "slurm" / "fleetrl.sbatch"

pytestmark = pytest.mark.slow


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    """The job's Ray temp folder, removed after the test (short: Ray's unix sockets live
    under it)."""
    path = Path(tempfile.mkdtemp(prefix="frl-ray-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


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


def _wait_for(check, timeout: float, what: str, log: Path, slurm: SlurmSite, poll_s: float = 1.0):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            text = log.read_text(errors="replace")[-6000:] if log.exists() else "(no job log)"
            pytest.fail(f"timed out waiting for {what}\n{text}\n{slurm.logs()}")
        time.sleep(poll_s)
    return result


def _job_processes(job_id: str, ray_tmp: Path) -> list[str]:
    """Processes of the job still alive: those whose environment carries its SLURM_JOB_ID
    (the batch script, its steps, and every Ray process `ray start` left: raylet, GCS,
    agents, workers, whatever their process title) or whose command line names its Ray
    session folder, each with the node it ran on."""
    found = []
    job_entry = f"SLURM_JOB_ID={job_id}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if job_entry in environ or str(ray_tmp) in cmdline:
            node = next(
                (e[16:].decode() for e in environ if e.startswith(b"SLURMD_NODENAME=")), "?"
            )
            found.append(f"{proc.name} on {node}: {cmdline[:160]}")
    return found


def _assert_job_left_nothing(job_id: str, ray_tmp: Path) -> None:
    deadline = time.monotonic() + 60
    while (left := _job_processes(job_id, ray_tmp)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, "processes of the job left after it ended:\n" + "\n".join(left)


def _checkpoint_step(run_dir: Path) -> int:
    """The step of the run's latest complete checkpoint (0: none yet)."""
    latest = latest_complete_checkpoint(run_dir / "checkpoints")
    return int(latest.name.split("_")[1]) if latest is not None else 0


def _job_ended(slurm: SlurmSite, job_id: str) -> dict[str, str] | None:
    state = _job_state(slurm, job_id)
    return state if state.get("JobState") in ENDED else None


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
# The demo's steps; the requeue comes after the checkpoint at SAVE_AT, and the second run
# trains the rest. The requeue must reach the first run before it ends: after that
# checkpoint it has STEPS - SAVE_AT steps to go (a demo step takes ~0.1 s on an idle 2-core
# machine; with 8 steps the first run once ended before the requeue arrived).
STEPS, SAVE_AT = 40, 4


# a whole training job (two Ray nodes, a warm start, a requeue): make test-deploy's, beside the
# image, so that make test keeps its hour
@pytest.mark.deploy
@pytest.mark.timeout(2400)
def test_two_node_job_trains_demo_requeues_resumes_and_stops_ray(
    slurm, ray_tmp: Path, tmp_path: Path
):
    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    env = _job_env(slurm, ray_tmp)
    job_id = _submit(
        slurm, env, log,
        "--config", "configs/demo_cpu.yaml", f"trainer.output_dir={run_dir}",
        f"model.path={tmp_path / 'model'}", f"data.train_files=[{tmp_path / 'data/train.parquet'}]",
        f"data.val_files=[{tmp_path / 'data/test.parquet'}]",
        f"trainer.total_steps={STEPS}", f"trainer.test_freq={STEPS}", f"trainer.save_freq={SAVE_AT}",
    )  # fmt: skip
    try:
        # the first run: requeued once it has a checkpoint to resume from
        _wait_for(
            lambda: _checkpoint_step(run_dir) >= SAVE_AT, 1800, "a checkpoint", log, slurm,
            poll_s=0.2,
        )  # fmt: skip
        slurm.run(["scontrol", "requeue", job_id])
        state = _wait_for(lambda: _job_ended(slurm, job_id), 1200, "the job's end", log, slurm)
    finally:
        if _job_ended(slurm, job_id) is None:
            slurm.run(["scancel", job_id], check=False)
    text = log.read_text(errors="replace")
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", (
        f"{state}\n{text[-6000:]}"
    )
    assert state["Restarts"] == "1"

    # the plan, on both runs: the Ray head on n1 with no role, n2 with both
    assert text.count("ray on n1 with resources {}") == 2, text[-6000:]
    assert text.count('ray on n2 with resources {"learner":1,"rollout":1}') == 2
    assert "(restart 1)" in text
    assert "fleetrl train exited 0" in text
    # the second run ends as the sbatch file ends it: Ray stopped on each node, then nothing
    # of the job is left (a raylet, GCS or worker that outlived `ray start` would be)
    last_run = text[text.index("(restart 1)") :]
    assert "ray stopped on n1" in last_run and "ray stopped on n2" in last_run, last_run[-4000:]
    _assert_job_left_nothing(job_id, ray_tmp)

    # the second run resumed from the first one's checkpoint and finished the run
    summary = json.loads((run_dir / "summary.json").read_text())
    resumed = summary["resumed_from"]
    assert resumed is not None and int(Path(resumed).name.split("_")[1]) >= SAVE_AT, summary
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "actor/pg_loss" in r]
    assert steps[-1] == STEPS and sorted(set(steps)) == list(range(1, STEPS + 1)), steps
    vals = [(r["step"], r["val/score/mean"]) for r in records if "val/score/mean" in r]
    assert vals[0][0] == 0 and vals[-1][0] == STEPS, vals
    assert vals[-1][1] > vals[0][1] + 0.1, f"held-out score did not rise: {vals}"


@pytest.mark.timeout(900)
def test_failed_run_passes_its_exit_status_on_and_stops_ray(slurm, ray_tmp: Path, tmp_path: Path):
    log = tmp_path / "job.out"
    env = _job_env(slurm, ray_tmp)
    job_id = _submit(
        slurm, env, log, "--config", "configs/demo_cpu.yaml", "trainer.total_steps=many"
    )
    state = _wait_for(lambda: _job_ended(slurm, job_id), 900, "the job's end", log, slurm)
    text = log.read_text(errors="replace")
    assert state["ExitCode"] == "2:0", f"{state}\n{text[-4000:]}"
    assert "trainer.total_steps" in text  # the run's own one-line config error
    assert "fleetrl train exited 2" in text
    assert "ray stopped on n1" in text and "ray stopped on n2" in text
    _assert_job_left_nothing(job_id, ray_tmp)
