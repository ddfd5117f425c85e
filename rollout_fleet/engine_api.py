"""The one engine interface of the rollout side, and the choice of its implementation.

Two implementations speak it: ``rollout_fleet.client.EngineClient`` (SGLang's native API,
which the embedded engine serves too) and ``rollout_fleet.vllm_client.VllmEngineClient``
(vLLM's). Everything else (the sample runner, the fleet's health checks, co-location, the
launcher's roles) holds a ``RolloutEngine`` and never asks which one it is; the run's
``rollout.backend`` picks the class once, here (``rollout_client_class``), through the API
its row of ``rollout_fleet.engine_kinds`` names. The weight side's counterpart is
``weight_sync.engine_api``.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from rollout_fleet.client import EngineClient, GenerateOutput, PartialCallback
from rollout_fleet.engine_kinds import engine_kind

# the HTTP API engines speak -> the class of their rollout client
ROLLOUT_CLIENTS = {
    "sglang": "rollout_fleet.client:EngineClient",
    "vllm": "rollout_fleet.vllm_client:VllmEngineClient",
}


class RolloutEngine(Protocol):
    """Generate, health, pause/resume, release/resume memory, version: one engine over HTTP."""

    base_url: str

    async def generate_sample(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        *,
        rid: str | None = None,
        lora_path: str | None = None,
        top_logprobs: int = 0,
        on_partial: PartialCallback | None = None,
    ) -> GenerateOutput:
        """One piece of a sample; ``top_logprobs`` > 0 fills ``GenerateOutput.top_logprobs``;
        ``on_partial`` (where the engine's API streams) gets the tokens so far as they come."""

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None: ...

    async def health(self) -> bool: ...

    async def pause_generation(self, mode: str = "abort") -> Any: ...

    async def continue_generation(self) -> Any: ...

    async def release_memory_occupation(self, tags: list[str] | None) -> None: ...

    async def resume_memory_occupation(self, tags: list[str] | None) -> None: ...

    async def get_weight_version(self) -> str: ...

    async def close(self) -> None: ...


def engine_api(backend: str) -> str:
    """The HTTP API engines of ``backend`` speak: ``sglang`` or ``vllm``."""
    return engine_kind(backend).api


def rollout_client_class(backend: str) -> type[EngineClient]:
    """The client class of ``backend``'s engines (construct it as ``EngineClient``)."""
    module, _, name = ROLLOUT_CLIENTS[engine_api(backend)].partition(":")
    return getattr(importlib.import_module(module), name)
