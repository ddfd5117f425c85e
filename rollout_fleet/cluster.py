"""What an elastic fleet sees of the Ray cluster: nodes, their free resources, and the
autoscaler's ear.

``RayCluster.nodes()`` lists every node Ray knows (``ray.nodes()``) with its total and
free resources (the GCS's view, refreshed about once a second, so an actor created a
moment ago may not show in it yet: the fleet counts its own placements apart; a node that
joined a moment ago may be listed before its free resources are, with none free).
``RayCluster.request(fleet, bundles)`` tells the autoscaler the bundles each fleet wants
at its target (``ray.autoscaler.sdk.request_resources``, which replaces the cluster's
previous request: the fleets' wishes are sent together). On a cluster without an
autoscaler the request is stored and read by nobody.

``engines_that_fit`` and ``missing_for`` are the arithmetic of one engine bundle against
one node's free resources. A fake cluster (tests) implements the same two methods.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from fleetrl.log import get_logger

log = get_logger(__name__)

UNBOUNDED = 1 << 20  # engines that fit when a bundle asks for nothing a node counts


@dataclass(frozen=True)
class NodeView:
    """One Ray node: its id, address, whether it is alive, its total and free resources."""

    node_id: str
    alive: bool
    total: Mapping[str, float] = field(default_factory=dict)
    free: Mapping[str, float] = field(default_factory=dict)
    address: str = ""

    def has(self, resource: str) -> bool:
        """Whether the node declares ``resource`` (a node-kind marker such as ``rollout``)."""
        return self.total.get(resource, 0.0) > 0.0

    @property
    def label(self) -> str:
        return f"node {self.address or self.node_id[:12]}"


class ClusterView(Protocol):
    """The two things an elastic fleet asks of the cluster."""

    def nodes(self) -> list[NodeView]: ...

    def request(self, fleet: str, bundles: list[dict[str, float]]) -> None: ...


def engines_that_fit(free: Mapping[str, float], bundle: Mapping[str, float]) -> int:
    """How many engines of ``bundle`` the ``free`` resources hold."""
    counts = [
        math.floor(free.get(key, 0.0) / need + 1e-9) for key, need in bundle.items() if need > 0
    ]
    return max(0, min(counts)) if counts else UNBOUNDED


def missing_for(node: NodeView, bundle: Mapping[str, float]) -> str:
    """What ``node`` lacks for one more engine of ``bundle`` ("" when it has room)."""
    short = [
        f"{key} {node.free.get(key, 0.0):g} free of {need:g} needed"
        for key, need in bundle.items()
        if need > 0 and node.free.get(key, 0.0) + 1e-9 < need
    ]
    return f"{node.label}: {', '.join(short)}" if short else ""


class RayCluster:
    """The joined Ray cluster, as seen from inside an actor or the driver."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[str, list[dict[str, float]]] = {}

    def nodes(self) -> list[NodeView]:
        import ray
        from ray._private.state import available_resources_per_node

        free = available_resources_per_node()  # alive nodes only
        return [
            NodeView(
                node_id=n["NodeID"],
                alive=bool(n.get("Alive")),
                total=dict(n.get("Resources") or {}),
                free=dict(free.get(n["NodeID"], {})),
                address=n.get("NodeManagerAddress", ""),
            )
            for n in ray.nodes()
        ]

    def request(self, fleet: str, bundles: list[dict[str, float]]) -> None:
        """``fleet`` wants ``bundles`` at its target: tell the autoscaler (every fleet's
        bundles together, since each request replaces the one before)."""
        from ray.autoscaler.sdk import request_resources

        with self._lock:
            if self._requests.get(fleet) == bundles:
                return
            self._requests[fleet] = bundles
            every = [b for wanted in self._requests.values() for b in wanted]
        request_resources(bundles=every)
        log.info("asked the autoscaler for %d engine bundles (%s)", len(every), fleet)
