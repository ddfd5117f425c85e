"""Preflight of a run with a reward model: the folder, the URLs, the reward servers' resources
(per node, on 'reward' nodes) and backend, each finding naming its key; nothing is asked of
a run that places no reward servers."""

from __future__ import annotations

import pytest

from fleetrl.models.tiny import make_tiny_model
from launcher.placement import requested_cpus
from launcher.preflight import check_backend, check_reward_urls, run_checks
from launcher.preflight_findings import Node
from launcher.preflight_resources import check_resources, local_node
from launcher.preflight_rewards import check_reward_model
from tests.unit.launcher.test_preflight import _cfg, _probes


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("rm"), layers=1, hidden=16, heads=2, reward_model=True)  # fmt: skip


def keys(findings) -> list[str]:
    return [f.key for f in findings]


def test_a_reward_folder_passes_and_a_causal_lm_is_refused_naming_the_key(tmp_path, rm_dir):
    assert check_reward_model(_cfg(tmp_path, f"reward.model.path={rm_dir}")) == []
    lm = make_tiny_model(tmp_path / "lm", layers=1, hidden=16, heads=2)
    (finding,) = check_reward_model(_cfg(tmp_path, f"reward.model.path={lm}"))
    assert finding.key == "reward.model.path" and "ForSequenceClassification" in finding.problem
    (missing,) = check_reward_model(_cfg(tmp_path, "reward.model.path=/no/rm"))
    assert missing.key == "reward.model.path" and "no config.json" in missing.problem


def test_urls_must_be_http_and_answer_and_carry_a_key_loopback_included(tmp_path, rm_dir):
    base = [f"reward.model.path={rm_dir}"]
    bad = _cfg(tmp_path, *base, "reward.model.urls=[10.0.0.5:30000]")
    assert keys(check_reward_urls(bad, _probes())) == ["reward.model.urls[0]"]
    silent = _cfg(tmp_path, *base, "reward.model.urls=[http://127.0.0.1:30000]")
    (down,) = check_reward_urls(silent, _probes(reachable=lambda h, p: False))
    assert (
        down.key == "reward.model.urls[0]" and "nothing answers at 127.0.0.1:30000" in down.problem
    )
    keyed = _probes(env={"FLEETRL_API_KEY": "k"})  # the variable `fleetrl engine` reads too
    for url in ("http://10.0.0.5:30000", "http://127.0.0.1:30000"):
        cfg = _cfg(tmp_path, *base, f"reward.model.urls=[{url}]")
        (no_key,) = check_reward_urls(cfg, _probes())
        assert no_key.key == "reward.model.api_key_env" and no_key.fatal, url
        assert "$FLEETRL_API_KEY is empty" in no_key.problem
        assert check_reward_urls(cfg, keyed) == []


def test_a_cluster_without_reward_nodes_is_refused_naming_ray_reward_resource(tmp_path, rm_dir):
    cfg = _cfg(tmp_path, f"reward.model.path={rm_dir}", "reward.model.num_engines=2")
    nodes = [
        Node("gpu-learner", {"CPU": 16, "GPU": 8, "learner": 1}),
        Node("rollout", {"CPU": 16, "rollout": 1}),
    ]
    (finding,) = check_resources(cfg, nodes, local=False)
    assert finding.key == "ray.reward_resource"
    assert "the reward fleet needs 2 servers" in finding.problem
    assert "no node offers the 'reward' resource" in finding.problem


def test_reward_servers_are_placed_per_node_and_a_gpu_shortfall_names_their_key(tmp_path, rm_dir):
    cfg = _cfg(
        tmp_path,
        f"reward.model.path={rm_dir}",
        "reward.model.backend=sglang",
        "reward.model.num_engines=3",
        "reward.model.gpus_per_engine=2",
    )
    two_gpus = [Node("r1", {"CPU": 8, "GPU": 2, "reward": 1}), Node("r2", {"CPU": 8, "GPU": 2, "reward": 1})]  # fmt: skip
    enough = [*two_gpus, Node("r3", {"CPU": 8, "GPU": 2, "reward": 1})]
    base = [Node("l", {"CPU": 16, "learner": 1}), Node("r", {"CPU": 16, "rollout": 1})]
    (short,) = check_resources(cfg, base + two_gpus, local=False)
    assert short.key == "reward.model.gpus_per_engine" and "2 fit" in short.problem
    assert check_resources(cfg, base + enough, local=False) == []


def test_a_local_run_counts_the_reward_servers_cpus_and_offers_the_reward_resource(tmp_path, rm_dir):  # fmt: skip
    plain = _cfg(tmp_path, "learner.cpus_per_rank=1", "rollout.cpus_per_engine=1")
    with_rm = _cfg(
        tmp_path,
        "learner.cpus_per_rank=1",
        "rollout.cpus_per_engine=1",
        f"reward.model.path={rm_dir}",
        "reward.model.num_engines=2",
        "reward.model.cpus_per_engine=3",
    )
    assert requested_cpus(with_rm) == requested_cpus(plain) + 6
    node = local_node(with_rm, _probes(cpu_count=lambda: 2))
    assert node.resources["reward"] > 0 and node.resources["CPU"] >= requested_cpus(with_rm)
    assert check_resources(with_rm, [node], local=True) == []
    urls = _cfg(tmp_path, f"reward.model.path={rm_dir}", "reward.model.urls=[http://127.0.0.1:1]")
    assert requested_cpus(urls) == requested_cpus(plain)  # servers run elsewhere: nothing placed


def test_sglang_reward_servers_on_this_cpu_machine_are_refused(tmp_path, rm_dir):
    cfg = _cfg(
        tmp_path,
        f"reward.model.path={rm_dir}",
        "reward.model.backend=sglang",
        "reward.model.gpus_per_engine=1",
    )
    findings = check_backend(cfg, _probes(), local=True)
    assert keys(findings) == ["reward.model.backend"] and "need CUDA" in findings[0].problem
    auto = _cfg(tmp_path, f"reward.model.path={rm_dir}")  # auto: the embedded rollout backend
    assert check_backend(auto, _probes(), local=True) == []


def test_run_checks_report_the_reward_folder_beside_the_others(tmp_path):
    cfg = _cfg(tmp_path, "reward.model.path=/no/rm")
    assert "reward.model.path" in keys(run_checks(cfg, probes=_probes()))
