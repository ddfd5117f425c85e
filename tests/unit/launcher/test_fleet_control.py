"""The fleet control endpoint and `fleetrl fleet scale|status` against it: real ZeroMQ with
CURVE on loopback, the run's own keys only, the key file's mode, one-line refusals."""

from __future__ import annotations

import asyncio
import json
import logging
import stat

import pytest
import zmq

from buffer.security import CurveClientKeys
from launcher.cli import main as cli
from launcher.config import load_run_config
from launcher.elastic_rollout import RolloutScaling
from launcher.fleet_control import (
    CONTROL_FILE,
    ControlError,
    StatusRequest,
    call,
    make_control_keys,
    read_control_file,
    write_control_file,
)
from rollout_fleet.fleet import EngineFleet
from rollout_fleet.membership import Membership, SyncOutcome
from rollout_fleet.router import Router
from tests.unit.rollout_fleet.fakes import FakeActor
from tests.unit.rollout_fleet.test_elastic import FakeCluster


def cli_lines(stderr: str) -> list[str]:
    """The command's own lines (the fleet's log lines share stderr in this process)."""
    return [line for line in stderr.splitlines() if line.startswith("fleetrl:")]


def scaling(overrides: list[str]) -> RolloutScaling:
    cfg = load_run_config("configs/demo_cpu.yaml", overrides)
    members = Membership()

    async def healthy(url):
        return True

    fleet = EngineFleet(
        cfg.rollout,
        "/model",
        membership=members,
        actor_factory=lambda spec: FakeActor(spec, node="head"),
        health_probe=healthy,
        weights_pushed=True,
    )
    fleet._node_actor_factory = lambda spec, node: FakeActor(spec, node=node)
    return RolloutScaling(
        cfg,
        fleet=fleet,
        router=Router(members),
        reward_servers=None,
        api_key=None,
        cluster=FakeCluster(free={"head": 4.0}),
    )


async def serving(tmp_path, overrides, caplog):
    """A started fleet behind its endpoint, the control file written as the driver does."""
    scale = scaling(overrides)
    await scale.fleet.start()
    members = scale.fleet.membership
    members.apply_sync(SyncOutcome(version=3, targets=members.weight_targets().engines))
    server_keys, client_keys = make_control_keys()
    with caplog.at_level(logging.DEBUG):
        address = scale.serve(server_keys, "127.0.0.1")
    write_control_file(tmp_path, address, client_keys)
    scale.start()
    return scale, client_keys


def test_scale_and_status_reach_the_run_and_a_target_outside_the_range_is_refused(
    tmp_path, capsys, caplog
):
    async def scenario():
        scale, keys = await serving(tmp_path, ["rollout.elastic=true", "rollout.max_engines=3"], caplog)  # fmt: skip
        try:
            run = str(tmp_path)
            assert await asyncio.to_thread(cli, ["fleet", "scale", "--run", run, "--engines", "5"]) == 2  # fmt: skip
            err = cli_lines(capsys.readouterr().err)
            assert err == [
                "fleetrl: rollout fleet: 5 engines is outside rollout.min_engines..max_engines"
                " = 1..3"
            ]
            assert await asyncio.to_thread(cli, ["fleet", "scale", "--run", run, "--engines", "3"]) == 0  # fmt: skip
            out = capsys.readouterr().out
            assert out == "rollout fleet: target 1 -> 3 engines (range 1..3); 1 serving now\n"
            await asyncio.sleep(0.5)  # the controller places them
            await scale.fleet.wait_replacements()
            assert await asyncio.to_thread(cli, ["fleet", "status", "--run", run]) == 0
            lines = capsys.readouterr().out.splitlines()
            assert lines[0] == "policy version 3"
            assert lines[1].startswith("rollout fleet: 1 serving, target 3 (elastic, 1..3)")
            rows = {line.split()[0]: line.split() for line in lines[3:]}
            assert rows["engine-0"][1:4] == ["ready", "3", "head"]
            assert rows["engine-1"][1] == rows["engine-2"][1] == "needs_weights"
            # the run's keys never reach a log
            assert keys.secret.decode() not in caplog.text
        finally:
            await scale.stop()

    asyncio.run(scenario())


def test_a_fixed_fleet_answers_status_and_refuses_scale_in_one_line(tmp_path, capsys, caplog):
    async def scenario():
        scale, _ = await serving(tmp_path, [], caplog)
        try:
            code = await asyncio.to_thread(cli, ["fleet", "scale", "--run", str(tmp_path), "--engines", "2"])  # fmt: skip
            assert code == 2
            err = cli_lines(capsys.readouterr().err)
            assert len(err) == 1 and "not elastic (rollout.elastic=false)" in err[0]
            code = await asyncio.to_thread(cli, ["fleet", "scale", "--run", str(tmp_path), "--reward-engines", "2"])  # fmt: skip
            assert code == 2
            assert "places no reward fleet" in capsys.readouterr().err
        finally:
            await scale.stop()

    asyncio.run(scenario())


def test_the_control_file_is_private_and_a_client_with_other_keys_is_refused(tmp_path, caplog):
    async def scenario():
        scale, keys = await serving(tmp_path, [], caplog)
        try:
            path = tmp_path / CONTROL_FILE
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            address, read = read_control_file(tmp_path)
            assert read == keys and address.startswith("tcp://127.0.0.1:")
            # a key pair the run did not make, with the right server key: refused at the
            # handshake by the ZAP handler, so no reply ever comes
            public, secret = zmq.curve_keypair()
            stranger = CurveClientKeys(public, secret, keys.server_public)
            write_control_file(tmp_path, address, stranger)
            with pytest.raises(ControlError, match="did not answer"):
                await asyncio.to_thread(call, tmp_path, StatusRequest(), 2.0)
            assert scale._server is not None and scale._server.requests == 0
        finally:
            await scale.stop()

    asyncio.run(scenario())


def test_a_missing_or_broken_control_file_is_one_line_with_status_2(tmp_path, capsys):
    assert cli(["fleet", "status", "--run", str(tmp_path)]) == 2
    assert "fleet_control.json not found: no run is training in" in capsys.readouterr().err
    (tmp_path / CONTROL_FILE).write_text(json.dumps({"address": "tcp://127.0.0.1:1"}))
    assert cli(["fleet", "status", "--run", str(tmp_path)]) == 2
    assert "not a fleet control file" in capsys.readouterr().err


def test_each_fleet_gets_its_own_range_resources_and_marker():
    from launcher.elastic_rollout import fleet_settings

    cfg = load_run_config(
        "configs/demo_cpu.yaml",
        [
            "rollout.elastic=true", "rollout.max_engines=3", "rollout.cpus_per_engine=2",
            "weight_sync.pause_mode=abort", "reward.model.path=/rm", "reward.model.num_engines=2",
            "reward.model.min_engines=1", "reward.model.max_engines=4",
        ],
    )  # fmt: skip
    rollout, reward = fleet_settings(cfg, "rollout"), fleet_settings(cfg, "reward")
    assert (rollout.start, rollout.min_engines, rollout.max_engines) == (1, 1, 3)
    assert rollout.bundle == {"CPU": 2.0, "GPU": 0.0, "rollout": 0.001} and rollout.abort_on_drain
    assert (reward.start, reward.min_engines, reward.max_engines) == (2, 1, 4)
    assert reward.bundle == {"CPU": 1.0, "GPU": 0.0, "reward": 0.001}
    assert reward.key == "reward.model" and not reward.abort_on_drain
    assert reward.metrics_prefix == "reward_fleet"
