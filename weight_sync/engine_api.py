"""The weight side of the one engine interface, and the choice of its implementation.

``WeightEngine`` is what the senders (``sender``, ``adapter_sender``, ``tensor_push``) call on
each engine: health, pause/resume, join the group, begin / push / end a weight update, the
version. ``weight_sync.engine_client.EngineClient`` implements it on SGLang's routes (the
embedded engine serves the same), ``weight_sync.vllm_engine_client.VllmWeightClient`` on
vLLM's; each also names the rank-0 group its engines join (``weight_group``). An endpoint's
``api`` picks the class, here only (``weight_client``); the rollout side's counterpart is
``rollout_fleet.engine_api``.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from weight_sync.engine_client import EngineClient, EngineEndpoint, GroupJoin


class WeightEngine(Protocol):
    """One engine as the weight senders see it."""

    endpoint: EngineEndpoint
    takes_per_tensor_broadcasts: bool

    @property
    def name(self) -> str: ...

    def healthy(self, timeout_s: float = 5.0) -> bool: ...

    def pause(self, mode: str) -> dict[str, Any]: ...

    def resume(self) -> dict[str, Any]: ...

    def init_group(self, join: GroupJoin) -> dict[str, Any]: ...

    def begin_update(self) -> dict[str, Any]: ...

    def update_weights(self, wire_fields: dict[str, list], **fields: Any) -> dict[str, Any]: ...

    def end_update(self, weight_version: str | None = None) -> dict[str, Any]: ...

    def weight_version(self) -> str: ...

    def close(self) -> None: ...


# the HTTP API an engine speaks -> the class of its weight-sync client
WEIGHT_CLIENTS = {
    "sglang": "weight_sync.engine_client:EngineClient",
    "vllm": "weight_sync.vllm_engine_client:VllmWeightClient",
}


def weight_client(endpoint: EngineEndpoint, timeout_s: float) -> EngineClient:
    """The client of ``endpoint`` for the API it speaks (``endpoint.api``)."""
    if endpoint.api not in WEIGHT_CLIENTS:
        raise ValueError(
            f"engine {endpoint.name}: api {endpoint.api!r}; accepted: {', '.join(WEIGHT_CLIENTS)}"
        )
    module, _, name = WEIGHT_CLIENTS[endpoint.api].partition(":")
    return getattr(importlib.import_module(module), name)(endpoint, timeout_s)
