"""What the launcher drives on learner rank 0, whichever way a version travels.

``WeightSender`` (full weights over a collective group) and ``AdapterSender``
(LoRA adapter folders through SGLang's adapter routes) share this surface, so
``launcher.learner_role.LearnerRole`` picks one by ``learner.lora.rank`` and calls the
same methods: ``set_members`` (the engines the rollout side's membership chose),
``add_engine`` / ``remove_engine`` / ``connect``, ``publish(stream, version)``,
``publish_restored`` after a resume, ``close``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch

from fleetrl.log import get_logger
from weight_sync.config import WeightSyncConfig
from weight_sync.engine_api import weight_client
from weight_sync.engine_client import EngineClient, EngineEndpoint
from weight_sync.metrics import SyncMetrics

log = get_logger(__name__)


class Publisher:
    """The shared part of both senders: membership bookkeeping and the resume call."""

    def __init__(self, config: WeightSyncConfig) -> None:
        self.config = config
        self._lock = threading.Lock()  # guards _clients (membership may change from other threads)
        self._clients: dict[str, EngineClient] = {}
        self.latest_version: int | None = None

    @property
    def engines(self) -> list[str]:
        with self._lock:
            return list(self._clients)

    def set_members(self, endpoints: Iterable[Any]) -> None:
        """Send to exactly these engines from the next ``publish`` on (a run's membership
        decides who); an endpoint that changed (URL, or a new process) is a new member."""
        wanted = {e.name: e for e in endpoints}
        with self._lock:
            current = {n: c.endpoint for n, c in self._clients.items()}
        for name, endpoint in current.items():
            if wanted.get(name) != endpoint:
                self.remove_engine(name)
        for name, endpoint in wanted.items():
            if current.get(name) != endpoint:
                self.add_engine(endpoint)

    def add_engine(self, endpoint: EngineEndpoint) -> None:
        """Add an engine; it gets the policy at the next ``publish``."""
        with self._lock:
            if endpoint.name in self._clients:
                raise ValueError(f"engine {endpoint.name!r} is already a weight-sync member")
            self._clients[endpoint.name] = weight_client(endpoint, self.config.timeout_s)
            self._member_added(endpoint.name)
        log.info(
            "engine %s (%s) joins weight sync at the next version", endpoint.name, endpoint.url
        )

    def remove_engine(self, name: str) -> None:
        """Remove an engine from the next ``publish`` on."""
        with self._lock:
            if name not in self._clients:
                raise ValueError(
                    f"engine {name!r} is not a weight-sync member; members: {list(self._clients)}"
                )
            self._member_removed(self._clients.pop(name))
        log.info("engine %s leaves weight sync at the next version", name)

    def _member_added(self, name: str) -> None:
        """The sender's own bookkeeping for a new member (called holding ``_lock``)."""

    def _member_removed(self, client: EngineClient) -> None:
        """The sender's own bookkeeping for a removed member (called holding ``_lock``)."""

    def publish(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        verify: bool | None = None,
    ) -> SyncMetrics:
        raise NotImplementedError

    def publish_restored(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> SyncMetrics:
        """The call after resuming from a checkpoint at ``version``: publish (verified)
        before any engine generates (they otherwise serve weights they are not tagged with)."""
        log.info("publishing the restored policy as version %d before generation resumes", version)
        return self.publish(named_tensors, version, verify=True)

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
