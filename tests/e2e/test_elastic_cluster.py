"""Elastic rollout on a multi-node Ray cluster on this machine: engines join and leave a
training run, nothing is lost, nothing trains twice, and η holds.

Run A (`fleetrl train --address` on a head with the learner, one engine and one reward
server, `rollout.elastic=true`, `max_engines=3`, `reward.model.max_engines=2`) meets, in
order:
  1. a rollout node joins (a raylet with `rollout: 1`)   -> an engine is placed there and
                                                            serves a version no older than
                                                            the one current before it came;
  2. `fleetrl fleet scale --engines 3 --reward-engines 2` -> a third engine and a second
                                                            reward server serve;
  3. `fleetrl fleet scale --reward-engines 1`            -> a reward server drains and stops;
  4. meanwhile the joined node's raylet is killed by pid -> its engine is dead at once and not
                                                            replaced (target 2);
  5. `fleetrl fleet scale --engines 1`                   -> an engine drains and stops;
  6. SIGTERM                                             -> a checkpoint, exit 0.
Run B resumes it with `rollout.num_engines=2` (a different fleet size) for three steps.

Then the record: every step's staleness/max <= η, no group given up; the audit trail and
the rollout bank show every trained group once and whole, every trained sample within η of
the version it was trained at, and each joined engine serving only versions current at its
join or later; the summary's account says 0 lost and 0 duplicated.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from buffer.bank import RolloutBank
from fleetrl.models.tiny import make_tiny_model
from launcher.cli import main as cli
from launcher.fleet_control import StatusReply, StatusRequest, call
from tests.e2e.demo_run import demo_train_cmd
from tests.e2e.ray_cluster import local_cluster

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ETA = 2
WAIT_S = 300.0  # generous: engines start slowly on a loaded 2-core machine


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line]


def _step(run_dir: Path) -> int:
    return max((r.get("step", 0) for r in _records(run_dir) if "actor/pg_loss" in r), default=0)


def _until(check, what: str, proc: subprocess.Popen, log: Path, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert proc.poll() is None, f"run ended waiting for {what}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"{what} not within {timeout_s:.0f}s"
        time.sleep(0.5)
    return value


def _status(run_dir: Path) -> StatusReply:
    reply = call(run_dir, StatusRequest())
    assert isinstance(reply, StatusReply), reply
    return reply


def _fleet(reply: StatusReply, name: str):
    return next(f for f in reply.fleets if f.fleet == name)


def _serving(run_dir: Path, fleet: str) -> dict[str, str]:
    """Engines of ``fleet`` that serve now: name -> node."""
    engines = _fleet(_status(run_dir), fleet).engines
    return {e.name: e.node for e in engines if e.state in ("ready", "suspect")}


def _scale(run_dir: Path, *args: str) -> None:
    assert cli(["fleet", "scale", "--run", str(run_dir), *args]) == 0


@pytest.mark.timeout(1500)
def test_engines_join_and_leave_a_training_run_on_a_cluster_and_nothing_is_lost(tmp_path):
    rm = make_tiny_model(tmp_path / "rm", layers=1, hidden=32, heads=4, max_positions=64, seed=3, reward_model=True)  # fmt: skip
    run_dir = tmp_path / "run"
    common = (
        "trainer.save_freq=1000", f"buffer.max_staleness={ETA}", "buffer.prune_committed=false",
        "rollout.elastic=true", "rollout.max_engines=3", "rollout.cpus_per_engine=1",
        f"reward.model.path={rm}", "reward.model.max_engines=2", "reward.model.cpus_per_engine=1",
        "rollout.placement_check_interval_s=1", "rollout.health_check_interval_s=1",
        "rollout.drain_timeout_s=10", "logging.console_every=1",
    )  # fmt: skip
    # head: learner 1 + engine 1 + reward server 1, and room for one more of each
    with local_cluster(5, {"learner": 1, "rollout": 1, "reward": 1}) as cluster:
        cmd_a = demo_train_cmd(tmp_path, run_dir, 1000, *common, "trainer.resume=auto")
        cmd_a += ["--address", cluster.address]
        log_a = tmp_path / "run_a.log"
        with log_a.open("w") as out:
            proc = subprocess.Popen(cmd_a, cwd=REPO, env=cluster.env, stdout=out, stderr=out)
        try:
            _until(lambda: _step(run_dir) >= 2, "step 2", proc, log_a, 600)
            # 1. a rollout node joins: an engine is placed there and serves
            before_join = _status(run_dir).policy_version
            node = cluster.add_node(num_cpus=1, resources={"rollout": 1})
            joined = _until(
                lambda: [n for n, where in _serving(run_dir, "rollout").items() if where == node.node_id],  # fmt: skip
                "an engine serving on the node that joined", proc, log_a,
            )  # fmt: skip
            assert _fleet(_status(run_dir), "rollout").target == 2
            # 2. + 3. both fleets up to their maximum at once; past it is refused
            before_scale = _status(run_dir).policy_version
            assert cli(["fleet", "scale", "--run", str(run_dir), "--engines", "4"]) == 2
            _scale(run_dir, "--engines", "3", "--reward-engines", "2")
            _until(lambda: len(_serving(run_dir, "rollout")) == 3, "3 engines", proc, log_a)
            scaled = sorted(set(_serving(run_dir, "rollout")) - {"engine-0", *joined})
            _until(lambda: len(_serving(run_dir, "reward")) == 2, "2 reward servers", proc, log_a)
            # 3. + 4. a reward server drains while the joined node leaves: its engine is dead
            # at once and not replaced
            at_loss = _step(run_dir)
            _scale(run_dir, "--reward-engines", "1")
            cluster.kill_raylet(node)
            _until(
                lambda: joined[0] not in [e.name for e in _fleet(_status(run_dir), "rollout").engines],  # fmt: skip
                "the lost engine forgotten", proc, log_a, 60,
            )  # fmt: skip
            rollout = _fleet(_status(run_dir), "rollout")
            assert rollout.target == 2 and rollout.lost == 1
            _until(
                lambda: len(_fleet(_status(run_dir), "reward").engines) == 1,
                "a reward server drained", proc, log_a,
            )  # fmt: skip
            # 5. scale down to one: the newest engine drains and stops
            _scale(run_dir, "--engines", "1")
            _until(
                lambda: len(_fleet(_status(run_dir), "rollout").engines) == 1,
                "one engine left", proc, log_a,
            )  # fmt: skip
            _until(lambda: _step(run_dir) >= at_loss + 2, "two more steps", proc, log_a)
            proc.send_signal(signal.SIGTERM)  # 6. stop: a checkpoint is written
            assert proc.wait(timeout=300) == 0, log_a.read_text()[-4000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        records_a = [r for r in _records(run_dir) if "actor/pg_loss" in r]
        last_a = records_a[-1]
        assert last_a["fleet/joins"] == 2 and last_a["fleet/engines_lost_with_node"] == 1
        assert last_a["fleet/leaves"] == 1 and last_a["reward_fleet/leaves"] == 1
        assert last_a["fleet/join_s_max"] > 0
        assert any("fleet/regroup_s" in r for r in records_a)  # the weight group changed

        # run B: the same run, resumed with a fleet of another size
        stopped_at = last_a["step"]
        cmd_b = demo_train_cmd(tmp_path, run_dir, stopped_at + 3, *common, "trainer.resume=auto", "rollout.num_engines=2")  # fmt: skip
        cmd_b += ["--address", cluster.address]
        done = subprocess.run(cmd_b, cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
    records = [r for r in _records(run_dir) if "actor/pg_loss" in r]
    resumed = records[len(records_a) :]
    assert [r["step"] for r in resumed] == list(range(stopped_at + 1, stopped_at + 4))
    assert resumed[-1]["fleet/engines"] == 2 and resumed[-1]["fleet/engines_target"] == 2
    assert all(r["staleness/max"] <= ETA for r in records)
    assert all(r["rollout/groups_failed"] == 0 for r in records)  # no group given up
    account = json.loads((run_dir / "summary.json").read_text())["sample_account"]
    assert account["lost"] == 0 and account["duplicated"] == 0
    assert account["trained"] == (stopped_at + 3) * 16 * 8

    # the audit trail and the bank: each trained group once and whole, within η
    trail = [json.loads(x) for x in (run_dir / "trained_groups.jsonl").read_text().splitlines()]
    lineage = {r["step"]: r for r in trail}
    trained = [g for step in sorted(lineage) for g in lineage[step]["groups"]]
    assert len(trained) == len(set(trained)) == (stopped_at + 3) * 16
    trained_at = {g: lineage[s]["policy_version"] for s in lineage for g in lineage[s]["groups"]}
    uids, per_group, served = [], {}, {}
    for _, trajs in RolloutBank(run_dir / "rollout_bank", segment_rows=256).iter_trajectories():
        for t in trajs:
            uids.append(t.uid)
            per_group[t.group_id] = per_group.get(t.group_id, 0) + 1
            versions = t.token_versions.numpy()
            if t.group_id in trained_at and len(versions):
                assert trained_at[t.group_id] - int(versions.min()) <= ETA, t.uid
            for engine in t.engine_id.split("+"):
                served.setdefault(engine, []).append(int(versions.min()) if len(versions) else 0)
    assert len(uids) == len(set(uids)), "a sample was accepted twice"
    assert all(per_group[g] == 8 for g in trained)
    # an engine that joined served nothing older than the version current before it came
    assert min(served[joined[0]]) >= before_join
    for name in scaled:
        assert min(served[name]) >= before_scale, name
