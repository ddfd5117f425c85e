"""The Slurm job's node plan (launcher/slurm.py): which node gets which Ray resources from
counts, host lists and `rest`, and the one-line refusals. Host lists are expanded by a
stand-in for `scontrol show hostnames` here; tests/cluster runs the real one."""

from __future__ import annotations

import pytest

from launcher.slurm import PlanError, main, node_roles, plan, units_per_node

NODES = ["h", "a", "b", "c", "d"]


def _expand(hostlist: str) -> list[str]:
    return hostlist.split(",")


def test_defaults_one_learner_node_and_rollout_on_the_rest():
    roles = node_roles("h", NODES, {}, _expand)
    assert roles == {
        "h": [],
        "a": ["learner"],
        "b": ["rollout"],
        "c": ["rollout"],
        "d": ["rollout"],
    }


def test_counts_take_nodes_in_order_learner_then_reward_then_rollout():
    env = {"FLEETRL_LEARNER_NODES": "2", "FLEETRL_REWARD_NODES": "1"}
    roles = node_roles("h", NODES, env, _expand)
    assert roles == {"h": [], "a": ["learner"], "b": ["learner"], "c": ["reward"], "d": ["rollout"]}


def test_host_lists_name_nodes_and_a_node_in_two_lists_serves_both():
    env = {"FLEETRL_LEARNER_NODES": "b", "FLEETRL_ROLLOUT_NODES": "b,h"}
    assert node_roles("h", ["h", "b"], env, _expand) == {
        "h": ["rollout"],
        "b": ["learner", "rollout"],
    }


def test_plan_gives_each_role_units_per_gpu_as_slurm_counts_them():
    resources = plan("h", ["h", "a", "b"], {"SLURM_GPUS_ON_NODE": "8"})
    assert resources == {"h": {}, "a": {"learner": 8}, "b": {"rollout": 8}}
    assert units_per_node({}) == 1
    assert units_per_node({"SLURM_GPUS_ON_NODE": "8", "FLEETRL_UNITS_PER_NODE": "4"}) == 4


@pytest.mark.parametrize(
    ("env", "nodes", "says"),
    [
        ({"FLEETRL_LEARNER_NODES": "5"}, NODES, "FLEETRL_LEARNER_NODES=5: only 4 worker node(s)"),
        (
            {"FLEETRL_LEARNER_NODES": "x"},
            NODES,
            "FLEETRL_LEARNER_NODES=x: x not in this job's nodes",
        ),
        ({}, ["h", "a"], "FLEETRL_ROLLOUT_NODES: no node serves the rollout role"),
        ({"FLEETRL_UNITS_PER_NODE": "0"}, NODES, "FLEETRL_UNITS_PER_NODE=0"),
    ],
)
def test_a_plan_the_nodes_cannot_meet_is_refused_with_the_variable(env, nodes, says):
    with pytest.raises(PlanError, match=says.replace("(", r"\(").replace(")", r"\)")):
        if "UNITS" in says:
            units_per_node(env)
        else:
            node_roles("h", nodes, env, _expand)


def test_cli_prints_one_line_per_node_and_exits_2_on_a_bad_plan(capsys, monkeypatch):
    monkeypatch.setenv("FLEETRL_LEARNER_NODES", "1")
    monkeypatch.delenv("SLURM_GPUS_ON_NODE", raising=False)
    monkeypatch.delenv("FLEETRL_UNITS_PER_NODE", raising=False)
    assert main(["plan", "--head", "h", "--nodes", "h a b"]) == 0
    assert capsys.readouterr().out.splitlines() == ["h {}", 'a {"learner":1}', 'b {"rollout":1}']
    monkeypatch.setenv("FLEETRL_LEARNER_NODES", "3")
    assert main(["plan", "--head", "h", "--nodes", "h a b"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fleetrl slurm: FLEETRL_LEARNER_NODES=3") and err.count("\n") == 1
