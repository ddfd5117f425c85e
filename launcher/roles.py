"""The Ray actors of a run: one module per role, each a thin shell around the role's own code.

- ``BufferRole``   (launcher/buffer_role.py) wraps ``buffer.service.BufferService``
                   (ZeroMQ ingest + control).
- ``LearnerRole``  (launcher/learner_role.py) one per FSDP rank, wraps
                   ``learner.worker.LearnerWorker``; rank 0 also pulls its batches from a
                   ``BatchSource`` (launcher/batch_source.py) and owns the weight publisher:
                   ``WeightSender`` (full weights), or ``AdapterSender`` (LoRA adapters only)
                   when ``learner.lora.rank > 0``; whom to send to arrives with each
                   ``publish`` as ``WeightTargets``.
- ``RolloutRole``  (launcher/rollout_role.py) an async actor hosting the engine
                   ``Membership`` (the one owner of "may engine-1 take requests?",
                   rollout_fleet/membership.py), the engine fleet (engine actors of its own),
                   the router, the reward pipeline (rule and reward-model scores,
                   rollout_fleet/rewards/pipeline.py) with, under ``reward.model``, its
                   ``RewardServers`` (the urls, or a reward fleet placed here:
                   rollout_fleet/rewards/servers.py), and the asyncio ``RolloutWorker`` that
                   streams trajectories to the buffer.

Co-located runs (``rollout.placement: colocated``): engine i sits in learner rank i's
bundle; the rollout role's ``RolloutColocation`` (launcher/colocated_rollout.py) pauses
and releases the engines before each step (``yield_devices``) and resumes them around
the push; every learner rank pushes to its own engine by handle and moves its state off
the device while the engine generates (``LearnerColocation``, launcher/colocated_publish.py).

The classes are plain Python; ``remote_class(cls)`` applies ``ray.remote`` on demand so
importing them needs no running Ray. Every actor receives the run config as
plain builtins (``msgspec.to_builtins``) and re-validates it (``role_config``). Calls the
driver branches on return typed results (launcher/results.py). Batches and trajectories
never travel through Ray: they go over ZeroMQ (msgspec / Arrow IPC) and, inside the
learner group, by broadcasting the Arrow bytes. This module holds what the roles share.
"""

from __future__ import annotations

import socket
from typing import Any

from fleetrl.config import convert
from launcher.config import RunConfig

# A control request to a dead buffer fails after this long (the driver then restarts it);
# short, because the learner and the fleet are otherwise blocked on a buffer that is gone.
BUFFER_REPLY_TIMEOUT_S = 5.0


def role_config(raw: dict[str, Any]) -> RunConfig:
    """The run config an actor received as builtins, validated again on its side."""
    return convert(RunConfig, raw)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node_ip(local: bool) -> str:
    if local:
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()


def remote_class(cls: type, **options: Any) -> Any:
    import ray

    return ray.remote(**options)(cls) if options else ray.remote(cls)
