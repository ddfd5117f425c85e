"""SIGTERM while the run waits for placement: one line, exit 128 + 15, no process of the run left;
then the same wait with a short ray.placement_timeout_s stops the run by itself (exit 1, one line).

The test starts its own one-node Ray cluster (``ray start --head --block``, loopback, a
token of its own) that offers ``rollout`` but no ``learner`` resource, and points
``fleetrl train`` at it with ``ray.autoscaling=true`` (so the preflight lets the run wait
for learner nodes that may still come) and a long ``ray.placement_timeout_s``. A local
instance cannot stage this: the preflight refuses a placement the local instance could
never satisfy before anything starts. Once the driver logs what it waits for, it gets
SIGTERM. Every process it started (its children, and the Ray workers that appeared on the
cluster for it: the buffer) is collected by pid before the signal and must be gone after.
The cluster is ended by its own pid (``ray start --block`` ends its processes on SIGTERM).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RAY = Path(sys.executable).with_name("ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pids) -> list[int]:
    import psutil

    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


def _descendants(pid: int) -> set[int]:
    import psutil

    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _names(pids) -> list[str]:
    import psutil

    out = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            out.append(f"{pid} {' '.join(psutil.Process(pid).cmdline())[:120]}")
    return out


def _settled(pid: int, quiet_s: float = 5.0, timeout_s: float = 120.0) -> set[int]:
    """The process tree under ``pid`` once it has not changed for ``quiet_s``."""
    deadline = time.monotonic() + timeout_s
    last, since = _descendants(pid), time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.5)
        now = _descendants(pid)
        if now != last:
            last, since = now, time.monotonic()
    return last


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def _wait_gone(pids, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := _alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def test_sigterm_during_placement_ends_every_role_and_the_timeout_stops_with_one_line(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    # a temp dir of its own: `ray start` records its address there, where a plain ray.init()
    # of another test on this machine would otherwise find and join it (short: socket paths)
    temp_dir = tempfile.mkdtemp(prefix="frl-", dir="/tmp")
    head_cmd = [
        str(RAY), "start", "--head", "--block", f"--port={port}", f"--temp-dir={temp_dir}",
        "--node-ip-address=127.0.0.1", "--num-cpus=2", "--num-gpus=0",
        '--resources={"rollout": 4}', "--include-dashboard=false", "--disable-usage-stats",
        f"--ray-client-server-port={_free_port()}", f"--dashboard-agent-listen-port={_free_port()}",
    ]  # fmt: skip
    head_log = open(tmp_path / "head.log", "w")  # noqa: SIM115 - closed in finally
    head = subprocess.Popen(head_cmd, env=env, stdout=head_log, stderr=head_log)
    driver = None
    try:
        _wait_for(
            lambda: any("raylet" in n for n in _names(_descendants(head.pid))),
            120,
            "the Ray head's raylet",
        )
        cluster_before = _settled(head.pid)  # GCS, raylet and its agents, before the run
        log_path = tmp_path / "train.log"
        cmd = [
            sys.executable, "-m", "launcher.cli", "train",
            "--config", "configs/demo_cpu.yaml", "--address", f"127.0.0.1:{port}",
            f"trainer.output_dir={tmp_path / 'run'}",
            f"model.path={tmp_path / 'model'}", "model.warmstart.steps=0",
            f"data.train_files=[{tmp_path / 'data' / 'train.parquet'}]",
            f"data.val_files=[{tmp_path / 'data' / 'test.parquet'}]",
            "data.synth_train_size=64", "data.synth_test_size=16", "ray.autoscaling=true",
        ]  # fmt: skip
        driver_env = {**env, "PYTHONPATH": str(REPO)}
        with open(log_path, "w") as out:
            driver = subprocess.Popen(
                [*cmd, "ray.placement_timeout_s=3600"],
                cwd=REPO,
                env=driver_env,
                stdout=out,
                stderr=out,
            )
            _wait_for(
                lambda: (
                    "to place the learner group" in log_path.read_text()
                    or driver.poll() is not None
                ),
                240,
                "the driver to wait for placement",
            )
            assert driver.poll() is None, log_path.read_text()[-3000:]
            # the run's Ray workers are named after their actor (ray::BufferRole); the
            # raylet's pooled ray::IDLE workers and its agents belong to the cluster
            new_on_cluster = _descendants(head.pid) - cluster_before
            run_pids = _descendants(driver.pid) | {
                int(n.split()[0])
                for n in _names(new_on_cluster)
                if n.split()[1].startswith("ray::")
                and n.split()[1] not in ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent")
            }
            assert run_pids, "the run started no process on the cluster (the buffer is one)"
            driver.send_signal(signal.SIGTERM)
            rc = driver.wait(timeout=120)
        text = log_path.read_text()
        ours = [line for line in text.splitlines() if line.startswith("fleetrl: ")]
        assert rc == 128 + signal.SIGTERM, text[-3000:]
        assert ours == [
            "fleetrl: stopped by SIGTERM while placing the learner group; "
            "every role started so far has been ended"
        ], text[-3000:]
        assert "Traceback" not in text, text[-3000:]
        assert "waiting" in text and "no node offers the 'learner' resource" in text
        left = _wait_gone(run_pids, 60)
        assert left == [], f"processes of the run left after SIGTERM: {_names(left)}"

        # the same placement with a short limit: the run stops by itself, saying what is missing
        timed_out = subprocess.run(
            [*cmd, "ray.placement_timeout_s=6"],
            cwd=REPO,
            env=driver_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        text = timed_out.stdout + timed_out.stderr
        assert timed_out.returncode == 1, text[-3000:]
        [line] = [ln for ln in text.splitlines() if "training stopped:" in ln]
        assert (
            "the learner group was not placed within 6s (ray.placement_timeout_s): "
            "the learner group needs 1 rank × {CPU 1} on 'learner' nodes, 0 fit: "
            "no node offers the 'learner' resource (ray.learner_resource)"
        ) in line
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
            driver.wait()
        cluster = _descendants(head.pid)
        head.send_signal(signal.SIGTERM)  # ray start --block ends the cluster's processes
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        head_log.close()
        _wait_gone(cluster, 30)
        shutil.rmtree(temp_dir, ignore_errors=True)
