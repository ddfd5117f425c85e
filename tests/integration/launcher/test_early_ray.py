"""The local Ray instance starts beside the preflight's slow checks (``launcher.early_ray``).

Only once the quick checks have passed; a slow check that fails ends the instance before
the failure is reported, with every one of its processes gone; a run that goes on takes
the instance over, alive after the thread that started it would have returned (Ray's
processes die with the thread that started them).
"""

from __future__ import annotations

import pytest
import ray
from ray._private import worker

from launcher import preflight
from launcher.early_ray import EarlyRay, starts_local_instance
from launcher.preflight import PreflightFailed
from launcher.train import run as train_run
from tests.unit.launcher.test_preflight import _cfg, _probes

pytestmark = pytest.mark.timeout(180)


def test_the_callback_comes_after_the_quick_checks_and_before_the_slow_ones(tmp_path, monkeypatch):
    order: list[str] = []
    rendering = preflight.check_rendering
    monkeypatch.setattr(
        preflight,
        "check_rendering",
        lambda cfg, samples: order.append("slow") or rendering(cfg, samples),
    )
    cfg = _cfg(tmp_path)
    assert preflight.run_checks(cfg, None, _probes(), after_quick_checks=lambda: order.append("quick passed")) == []  # fmt: skip
    assert order == ["quick passed", "slow"]

    order.clear()  # a quick check fails: nothing is started early, every check still runs
    cfg = _cfg(tmp_path, "data.val_files=[/no/such.parquet]")
    found = preflight.run_checks(cfg, None, _probes(), after_quick_checks=lambda: order.append("quick passed"))  # fmt: skip
    assert [f.key for f in found] == ["data.val_files"]
    assert order == ["slow"]


def test_only_a_local_instance_starts_early(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = _cfg(tmp_path)
    assert starts_local_instance(cfg, None)
    assert not starts_local_instance(cfg, "10.0.0.1:6379")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert not starts_local_instance(cfg, None)


def test_a_failing_slow_check_ends_the_instance_before_the_failure_is_reported(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    reward = tmp_path / "my_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return extra_info['missing']\n")  # fmt: skip
    cfg = _cfg(tmp_path, f"reward.custom_function.path={reward}", "logging.wandb=false")
    begun: list[EarlyRay] = []
    begin = EarlyRay.begin
    monkeypatch.setattr(EarlyRay, "begin", lambda self: begun.append(self) or begin(self))
    processes: list = []
    check_rewards = preflight.check_rewards

    def rewards_once_ray_is_up(cfg, samples):  # a slow check, run while the instance is up
        assert begun[0].result() is True
        node = worker._global_node
        processes.extend(i.process for infos in node.all_processes.values() for i in infos)
        return check_rewards(cfg, samples)

    monkeypatch.setattr(preflight, "check_rewards", rewards_once_ray_is_up)
    with pytest.raises(PreflightFailed) as err:
        train_run(cfg)
    assert [f.key for f in err.value.findings] == ["reward.custom_function.path"]
    assert processes  # the instance was up while the slow checks ran
    assert not ray.is_initialized()
    assert all(p.poll() is not None for p in processes), [p.args[:2] for p in processes]
    assert not (tmp_path / "run").exists()  # nothing of the run was made


def test_the_instance_outlives_the_thread_until_it_is_ended(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    early = EarlyRay(_cfg(tmp_path, "ray.num_cpus=1"))
    early.begin()
    assert early.result() is True
    node = worker._global_node
    gcs = [i.process for i in node.all_processes["gcs_server"]][0]

    @ray.remote
    def answer():
        return 42

    assert ray.get(answer.remote(), timeout=60) == 42  # usable from this thread
    assert gcs.poll() is None
    early.end()
    assert not ray.is_initialized() and gcs.poll() is not None
    early.end()  # twice: nothing more to do


@pytest.mark.parametrize("user_omp", [None, "3"])
def test_the_drivers_torch_gets_back_the_threads_the_roles_variable_took(
    tmp_path, monkeypatch, user_omp
):
    import torch

    from fleetrl.machine import usable_cpus

    if user_omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", user_omp)
    before = torch.get_num_threads()
    monkeypatch.setattr(EarlyRay, "_start", lambda self: self._ready.set())  # no instance
    early = EarlyRay(_cfg(tmp_path))
    early.begin()
    try:
        torch.set_num_threads(1)  # as a torch first imported under the roles' variable is
        early.keep_driver_threads()
        assert torch.get_num_threads() == (int(user_omp) if user_omp else usable_cpus())
    finally:
        torch.set_num_threads(before)
        early._release.set()
