"""kill -9 the buffer process mid-stream, restart it on its bank: nothing acknowledged is lost,
nothing is served twice, and producers and the learner reconnect to the same addresses."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from buffer.synthetic import make_group
from buffer.transport import BufferClient, BufferTimeout, TrajectorySender

REPO = Path(__file__).resolve().parents[3]
GROUP_SIZE = 2
NUM_GROUPS = 60


def _free_port_pair() -> int:
    """A port P with P+1 also free (the CLI binds control on ingest port + 1)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no free port pair")


def _start(port: int, bank: Path, ready: Path) -> tuple[subprocess.Popen, dict]:
    ready.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "buffer.service",
            "--bind",
            f"tcp://127.0.0.1:{port}",
            "--bank-dir",
            str(bank),
            "--ready-file",
            str(ready),
            "buffer.segment_rows=16",
            "buffer.ingest_drain_messages=4",
            "data.train_batch_size=2",
        ],
        cwd=REPO,
        env=env,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None, f"buffer exited with {proc.returncode}"
        assert time.monotonic() < deadline, "buffer never became ready"
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


def _fetch(client: BufferClient, received: list[str]) -> bool:
    try:
        batch = client.get_batch(2, learner_version=0, timeout_s=0.5)
    except BufferTimeout:
        return False
    if batch is None:
        return False
    received.extend(dict.fromkeys(batch.column("group_id").to_pylist()))
    return True


def test_kill_dash_nine_then_restart_loses_and_repeats_nothing(tmp_path):
    bank, ready = tmp_path / "bank", tmp_path / "ready.json"
    port = _free_port_pair()
    proc, addresses = _start(port, bank, ready)
    groups = {f"g{i:03d}": make_group(f"g{i:03d}", GROUP_SIZE) for i in range(NUM_GROUPS)}
    sender = TrajectorySender(addresses["ingest"], linger_ms=0)
    client = BufferClient(addresses["control"], timeout_s=3)
    all_ids = list(groups)

    def produce(ids: list[str]) -> None:
        for gid in ids:
            for traj in groups[gid]:
                sender.send(traj)
            time.sleep(0.002)

    producer = threading.Thread(target=produce, args=(all_ids,))
    producer.start()
    received: list[str] = []
    while len(received) < 10:
        _fetch(client, received)
    deadline = time.monotonic() + 60
    while sum(client.group_status(all_ids)) < NUM_GROUPS:  # half the samples are in
        assert time.monotonic() < deadline, "producer stalled"
    # a hand-out whose reply is lost (here: taken by a client that then vanishes)
    lost_reply = BufferClient(addresses["control"], timeout_s=3)
    assert lost_reply.get_batch(2, learner_version=0, timeout_s=10) is not None
    lost_reply.close()
    acknowledged = client.group_status(all_ids)  # what the buffer vouched for before dying
    proc.kill()  # SIGKILL, mid-stream: the producer is still sending
    proc.wait()
    producer.join(60)

    proc, again = _start(port, bank, ready)
    try:
        assert again == addresses  # same addresses: the old sockets reconnect by themselves
        after = client.group_status(all_ids)
        lost = [
            g for g, before, now in zip(all_ids, acknowledged, after, strict=True) if now < before
        ]
        assert lost == [], f"acknowledged samples lost: {lost}"
        # the fleet's job after a restart: resubmit every group not fully acknowledged
        missing = [g for g, n in zip(all_ids, after, strict=True) if n < GROUP_SIZE]
        resend = threading.Thread(target=produce, args=(missing,))
        resend.start()
        deadline = time.monotonic() + 120
        while len(received) < NUM_GROUPS:
            assert time.monotonic() < deadline, f"only {len(received)} groups received"
            _fetch(client, received)
        resend.join(60)
        assert sorted(received) == all_ids  # every group exactly once across both lives
        assert len(set(received)) == len(received)
        stats = client.stats()
        assert stats["handout_count"] == NUM_GROUPS and stats["ready_groups"] == 0
        assert stats["rewound_groups"] == 2  # the lost hand-out was served again
    finally:
        proc.kill()
        proc.wait()
        sender.close()
        client.close()


def test_kill_dash_nine_after_pruning_then_resume_loses_and_repeats_nothing(tmp_path):
    """Commits prune the bank (segments of 8 groups); a kill -9 and a learner resume from
    its last checkpoint still serve every group exactly once; a retained group re-sent by
    the fleet after the restart is recognised and dropped."""
    bank, ready = tmp_path / "bank", tmp_path / "ready.json"
    port = _free_port_pair()
    proc, addresses = _start(port, bank, ready)
    all_ids = [f"g{i:03d}" for i in range(NUM_GROUPS)]
    sender = TrajectorySender(addresses["ingest"], linger_ms=0)
    client = BufferClient(addresses["control"], timeout_s=3)
    try:
        for gid in all_ids:
            for traj in make_group(gid, GROUP_SIZE):
                sender.send(traj)
        deadline = time.monotonic() + 60
        while sum(client.group_status(all_ids)) < NUM_GROUPS * GROUP_SIZE:
            assert time.monotonic() < deadline, "samples not accepted"
            time.sleep(0.05)
        received: list[str] = []
        checkpoints: list[int] = []
        while len(received) < 40:  # the learner trains; a checkpoint every 10 groups
            _fetch(client, received)
            if len(received) % 10 == 0 and len(received) not in checkpoints:
                checkpoints.append(len(received))
                if len(checkpoints) > 1:  # the driver commits one checkpoint late
                    client.commit(checkpoints[-2], retain_groups=["g025"])
        assert client.stats()["pruned_segments"] >= 2
        proc.kill()  # SIGKILL after pruning; the learner dies too, back to checkpoint 40
        proc.wait()

        proc, again = _start(port, bank, ready)
        assert again == addresses
        client.resume(version=0, watermark=checkpoints[-1])
        for traj in make_group("g025", GROUP_SIZE):  # the fleet regenerates a retained group
            sender.send(traj)
        deadline = time.monotonic() + 60
        while len(received) < NUM_GROUPS:
            assert time.monotonic() < deadline, f"only {len(received)} groups received"
            _fetch(client, received)
        assert received == all_ids  # in order, none lost, none twice
        assert client.get_batch(1, 0, timeout_s=1) is None  # g025 was not accepted again
        stats = client.stats()
        assert stats["group_closed"] + stats.get("duplicates", 0) == GROUP_SIZE
        assert stats["handout_count"] == NUM_GROUPS and stats["ready_groups"] == 0
    finally:
        proc.kill()
        proc.wait()
        sender.close()
        client.close()
