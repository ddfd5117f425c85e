"""Trajectory transport: ZeroMQ + msgspec vs a Ray actor queue of cloudpickled samples.

One producer process sends the same realistic trajectories (prompt 256 tokens,
response lognormal around 1k tokens, logprobs and per-token versions) to a
consumer in this process, four ways, alternated over ``reps`` so machine noise
hits all of them:

- ``zmq_msgspec``: ``buffer.transport.TrajectorySender`` (msgspec encode, PUSH)
  -> PULL, header check, decode, ``check_trajectory`` validation: the wire path;
- ``service_ingest``: the same sender -> a real ``BufferService`` (decode,
  validate, dedupe, group, durable bank write + flush), until all are accepted;
- ``ray_queue``: a Ray actor puts cloudpickled sample dicts (numpy arrays) into a
  ``ray.util.queue.Queue`` one by one and the consumer ``get``s and unpickles
  them: the channel of verl's fully-async MessageQueue and OpenRLHF's async queue;
- ``raw_zmq``: raw PUSH/PULL of byte strings of the same sizes, no encoding or
  decoding: the transport's limit.

Figures are trajectories/s (and MB/s of encoded payload); ``summary`` holds
``vs_ray_queue`` (zmq_msgspec / ray_queue), ``vs_raw_zmq`` (zmq_msgspec /
raw_zmq) and ``service_vs_ray_queue``. A benchmark, not a test: nothing is
asserted. Ray runs locally (``num_cpus=2``, no dashboard) and is shut down.

Run: ``python -m bench.transport --out DIR [--quick] [--reps N]`` (writes
``DIR/transport.json``); ``fleetrl bench transport`` calls ``run``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

PROMPT_TOKENS = 256
RESPONSE_MEDIAN = 1024
RECV_TIMEOUT_MS = 120_000


def _make_trajectories(count: int, seed: int, tag: str) -> list[Any]:
    from buffer.synthetic import make_trajectory, realistic_response_length

    rng = np.random.default_rng(seed)
    return [
        make_trajectory(
            f"{tag}-{i}",
            0,
            1,
            prompt_len=PROMPT_TOKENS,
            response_len=realistic_response_length(rng, RESPONSE_MEDIAN),
            rng=rng,
        )
        for i in range(count)
    ]


def _sample_dict(traj: Any) -> dict[str, Any]:
    """The Python-object form a Ray-queue system ships (numpy arrays in a dict)."""
    return {
        "uid": traj.uid,
        "group_id": traj.group_id,
        "prompt_ids": traj.prompt_ids.numpy().copy(),
        "response_ids": traj.response_ids.numpy().copy(),
        "behavior_logprobs": traj.behavior_logprobs.numpy().copy(),
        "token_versions": traj.token_versions.numpy().copy(),
        "score": traj.score,
        "finish_reason": traj.finish_reason,
        "reward_metrics": dict(traj.reward_metrics),
    }


def _producer(conn: Connection, count: int, seed: int) -> None:
    """Child process: waits for (mode, address, tag), sends ``count`` trajectories, repeats."""
    import msgspec
    import zmq

    from buffer.transport import TrajectorySender
    from buffer.wire import encode

    base = _make_trajectories(count, seed, "t")
    raw = [b"\x00" * len(encode(t)) for t in base]
    ctx = zmq.Context()
    while True:
        command = conn.recv()
        if command is None:
            break
        mode, address, tag = command
        trajs = [
            msgspec.structs.replace(t, uid=f"{tag}/{i}", group_id=f"{tag}/{i}")
            for i, t in enumerate(base)
        ]
        if mode == "raw":
            sock = ctx.socket(zmq.PUSH)
            sock.connect(address)
            conn.send("ready")
            conn.recv()
            for payload in raw:
                sock.send_multipart([b"FR\x01\x01", payload])
            sock.close(linger=-1)
        else:
            sender = TrajectorySender(address, context=ctx, linger_ms=-1)
            conn.send("ready")
            conn.recv()
            for traj in trajs:
                sender.send(traj)
            sender.close()
        conn.send("sent")
    ctx.term()


def _zmq_round(conn: Connection, mode: str, count: int, rep: list[int]) -> float:
    """Trajectories/s through PUSH/PULL, decoding+validating (msgspec) or not (raw)."""
    import zmq

    from buffer.core import check_trajectory
    from buffer.wire import KIND_TRAJECTORY, check_header, decode_trajectory

    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0
    pull.rcvtimeo = RECV_TIMEOUT_MS
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    rep[0] += 1
    conn.send((mode, f"tcp://127.0.0.1:{port}", f"r{rep[0]}"))
    assert conn.recv() == "ready"
    t0 = time.perf_counter()
    conn.send("go")
    for _ in range(count):
        header, payload = pull.recv_multipart(copy=True)
        if mode == "msgspec":
            check_header(header, KIND_TRAJECTORY)
            check_trajectory(decode_trajectory(payload))
    elapsed = time.perf_counter() - t0
    assert conn.recv() == "sent"
    pull.close()
    return count / elapsed


def _service_round(conn: Connection, count: int, rep: list[int], bank_root: Path) -> float:
    """Trajectories/s from a producer process into a real BufferService, until all accepted."""
    from buffer.config import BufferConfig
    from buffer.service import BufferService

    rep[0] += 1
    service = BufferService(
        BufferConfig(capacity_groups=count + 1),
        ingest_address="tcp://127.0.0.1:0",
        control_address="tcp://127.0.0.1:0",
        bank_dir=bank_root / f"bank{rep[0]}",
        groups_per_version=1,
        max_concurrent_groups=count,
    )
    ingest, _ = service.start()
    try:
        conn.send(("msgspec", ingest, f"s{rep[0]}"))
        assert conn.recv() == "ready"
        t0 = time.perf_counter()
        conn.send("go")
        core = service.core
        assert core is not None
        while core.store.counters["accepted_samples"] < count:
            with core.ready:
                core.ready.wait(0.005)
        elapsed = time.perf_counter() - t0
        assert conn.recv() == "sent"
    finally:
        service.stop()
    return count / elapsed


def _ray_round(queue: Any, producer: Any, count: int) -> float:
    from ray import cloudpickle

    t0 = time.perf_counter()
    done = producer.produce.remote(queue)
    for _ in range(count):
        cloudpickle.loads(queue.get(timeout=RECV_TIMEOUT_MS / 1000))
    elapsed = time.perf_counter() - t0
    import ray

    ray.get(done)
    return count / elapsed


def _ray_setup(count: int, seed: int) -> tuple[Any, Any]:
    import ray
    from ray.util.queue import Queue

    @ray.remote(num_cpus=0)
    class Producer:
        def __init__(self) -> None:
            self.samples = [_sample_dict(t) for t in _make_trajectories(count, seed, "ray")]

        def produce(self, queue: Any) -> int:
            from ray import cloudpickle

            for sample in self.samples:  # one put per sample, as verl and OpenRLHF do
                queue.put(cloudpickle.dumps(sample))
            return len(self.samples)

    queue = Queue(maxsize=count, actor_options={"num_cpus": 0})
    producer = Producer.remote()
    ray.get(producer.__ray_ready__.remote())
    return queue, producer


def run(
    out_dir: str | Path,
    quick: bool = False,
    reps: int | None = None,
    batch: int | None = None,
) -> dict[str, Any]:
    """Measure every channel, alternating; write ``out_dir/transport.json``; return the record."""
    import ray

    from bench.common import alternate, ratio
    from buffer.wire import encode

    count = batch or (1000 if quick else 4000)
    reps = reps or (3 if quick else 5)
    seed = 7
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sample = _make_trajectories(count, seed, "size")
    payload_bytes = [len(encode(t)) for t in sample]
    mean_mb = float(np.mean(payload_bytes)) / 1e6
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    proc = spawn.Process(target=_producer, args=(child, count, seed), daemon=True)
    proc.start()
    ray.init(  # "local": never join a cluster another `ray start` on this machine recorded
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    rep = [0]
    try:
        queue, producer = _ray_setup(count, seed)
        with tempfile.TemporaryDirectory() as banks:
            results = alternate(
                {
                    "zmq_msgspec": lambda: _zmq_round(parent, "msgspec", count, rep),
                    "service_ingest": lambda: _service_round(parent, count, rep, Path(banks)),
                    "ray_queue": lambda: _ray_round(queue, producer, count),
                    "raw_zmq": lambda: _zmq_round(parent, "raw", count, rep),
                },
                reps,
                warmup=1,
            )
    finally:
        parent.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        ray.shutdown()
    medians = {name: r["median"] for name, r in results.items()}
    record = {
        "suite": "transport",
        "config": {
            "trajectories": count,
            "reps": reps,
            "prompt_tokens": PROMPT_TOKENS,
            "response_tokens_median": RESPONSE_MEDIAN,
            "mean_payload_bytes": float(np.mean(payload_bytes)),
            "max_payload_bytes": int(np.max(payload_bytes)),
        },
        "results": {
            "trajectories_per_s": results,
            "mb_per_s": {name: m * mean_mb for name, m in medians.items()},
        },
        "summary": {
            "vs_ray_queue": ratio(medians["zmq_msgspec"], medians["ray_queue"]),
            "vs_raw_zmq": ratio(medians["zmq_msgspec"], medians["raw_zmq"]),
            "service_vs_ray_queue": ratio(medians["service_ingest"], medians["ray_queue"]),
            "zmq_msgspec_trajectories_per_s": medians["zmq_msgspec"],
            "zmq_msgspec_mb_per_s": medians["zmq_msgspec"] * mean_mb,
        },
    }
    (out_dir / "transport.json").write_text(json.dumps(record, indent=2))
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None, help="trajectories per measurement")
    args = parser.parse_args(argv)
    from fleetrl.log import setup_logging

    setup_logging("bench")
    record = run(args.out, args.quick, args.reps, args.batch)
    json.dump(record["summary"], sys.stdout)  # entry point: the headline on stdout
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
