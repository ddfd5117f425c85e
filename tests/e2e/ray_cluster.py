"""A multi-node Ray cluster on this machine for the elastic tests: a head and raylets that
join and leave, each with resources of its own (``ray.cluster_utils.Cluster``).

The cluster requires Ray's token authentication (its ports listen on this shared machine)
and keeps its address out of /tmp/ray, where a plain ``ray.init()`` of another process
would find and join it. A node leaves the way a machine does for Ray: its raylet is killed
by pid (SIGKILL); the worker processes it leaves behind (an engine actor's process outlives
its raylet for a while) are recorded first and ended by pid when the cluster shuts down.
"""

from __future__ import annotations

import os
import secrets
import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from launcher.supervision import import_psutil

# a node whose raylet stops answering is declared dead after ~1.5 s (default ~15 s)
FAST_NODE_DEATH = {
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}


class LocalCluster:
    def __init__(self, cluster: Any, env: dict[str, str]) -> None:
        self.cluster = cluster
        self.env = env  # what a driver needs to join (the auth token)
        self.orphans: set[int] = set()

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_node(self, num_cpus: int, resources: dict[str, float]) -> Any:
        return self.cluster.add_node(num_cpus=num_cpus, resources=resources)

    def kill_raylet(self, node: Any) -> int:
        """Kill ``node``'s raylet with SIGKILL (its pid); returns that pid."""
        from ray._private import ray_constants

        psutil = import_psutil()
        pid = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
        self.orphans |= {p.pid for p in psutil.Process(pid).children(recursive=True)}
        os.kill(pid, signal.SIGKILL)
        return pid

    def end_orphans(self) -> None:
        for pid in self.orphans:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _auth_env(values: dict[str, str | None]) -> None:
    """Set (None: unset) Ray's auth variables, and make this process see them: Ray caches
    its config and the token at first use."""
    from ray._private.authentication.authentication_token_setup import Config
    from ray._raylet import AuthenticationTokenLoader

    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@contextmanager
def local_cluster(head_cpus: int, head_resources: dict[str, float]) -> Iterator[LocalCluster]:
    """A head node with ``head_cpus`` CPUs and ``head_resources``; shut down on exit."""
    import ray._private.utils
    from ray.cluster_utils import Cluster

    token = secrets.token_hex(32)
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    _auth_env({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
    write_address = ray._private.utils.write_ray_address
    ray._private.utils.write_ray_address = lambda *args, **kwargs: None
    cluster = None
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": head_cpus,
                "resources": head_resources,
                "temp_dir": tempfile.mkdtemp(prefix="frl-", dir="/tmp"),  # short: socket paths
                "include_dashboard": False,
                "_system_config": FAST_NODE_DEATH,
            },
        )
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        local = LocalCluster(cluster, env)
        try:
            yield local
        finally:
            cluster.shutdown()
            local.end_orphans()
    finally:
        ray._private.utils.write_ray_address = write_address
        _auth_env(saved)
