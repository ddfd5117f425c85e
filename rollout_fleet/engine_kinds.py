"""The rollout backends side by side: one row per ``rollout.backend``, and the one lookup.

What differs between the embedded engine, SGLang servers and vLLM servers, other than the
HTTP API the engines speak (two client pairs implement that: ``rollout_fleet.engine_api``
and ``weight_sync.engine_api``), is a field of ``EngineKind`` here. The launcher, the
fleet, the config rules, ``check`` and ``plan`` read the row of the run's backend
(``engine_kind``) and never ask which backend it is:

- ``label``: how one-line messages name its engines;
- ``api``: the HTTP API its engines speak (the embedded engine speaks SGLang's);
- ``gpu_server``: a server process on GPUs with a tensor-parallel size (``gpus_per_engine``),
  not the embedded engine;
- ``memory_field`` / ``memory_flag``: the ``RolloutConfig`` field of its memory fraction and
  the server flag it becomes; ``memory_is_total``: the fraction bounds everything the
  engine holds (vLLM's ``--gpu-memory-utilization``: weights, activations and KV cache), not
  only a static pool of weights and KV (SGLang's ``--mem-fraction-static``);
- ``load_format_field`` / ``extra_args_field``: its ``RolloutConfig`` fields;
- ``by_handle``: it takes a version by handle on a device it shares with a learner rank,
  which co-location needs (vLLM 0.34's CUDA-IPC transfer is a launch-time backend fleetrl
  does not drive: ``docs/architecture.md``, "Engines");
- ``sync_backends``: the collectives its ranks receive a broadcast on (vLLM's workers build
  an NCCL communicator, nothing else);
- ``server``: ``MODULE:FUNCTION`` giving its server class and the function that turns an
  ``EngineSpec`` into that class's spec (``rollout_fleet.actors``);
- ``preflight``: ``MODULE:FUNCTION(version, environ, instead) -> list[(problem, fix)]``,
  what ``fleetrl check`` says of the installed release (``package``) and the environment;
  ``colocation_package``: what a co-located engine releases its memory with.

This module imports nothing heavy: the config structs use it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineKind:
    """One rollout backend (see the module docstring for each field)."""

    backend: str
    label: str
    api: str
    gpu_server: bool
    memory_field: str = ""
    memory_flag: str = ""
    memory_is_total: bool = False
    load_format_field: str = ""
    extra_args_field: str = ""
    by_handle: bool = True
    sync_backends: tuple[str, ...] = ("gloo", "nccl")  # what its ranks receive a broadcast on
    server: str = ""
    preflight: str = ""
    package: str = ""  # the distribution its servers need installed where they run
    colocation_package: str = ""  # what its engines release memory with when co-located

    def memory_fraction(self, config: Any) -> float:
        """Its memory fraction in ``config`` (a ``RolloutConfig``); 0 for the embedded engine."""
        return float(getattr(config, self.memory_field)) if self.memory_field else 0.0

    def load_format(self, config: Any) -> str:
        """How a fresh engine gets its first weights: ``dummy`` (from the first push) or ``auto``
        (from ``model.path``; the embedded engine always loads the folder)."""
        return str(getattr(config, self.load_format_field)) if self.load_format_field else "auto"

    def extra_args(self, config: Any) -> list[str]:
        """The arguments appended to its server's command line."""
        return list(getattr(config, self.extra_args_field)) if self.extra_args_field else []

    def load(self, what: str) -> Any:
        """The object a ``MODULE:NAME`` field names (imported on first use)."""
        module, _, name = getattr(self, what).partition(":")
        return getattr(importlib.import_module(module), name)


KINDS: dict[str, EngineKind] = {
    kind.backend: kind
    for kind in (
        EngineKind("embedded", "embedded", "sglang", gpu_server=False),
        EngineKind(
            "sglang", "SGLang", "sglang", gpu_server=True,
            memory_field="mem_fraction_static", memory_flag="--mem-fraction-static",
            load_format_field="sglang_load_format", extra_args_field="sglang_extra_args",
            server="rollout_fleet.actors:sglang_server_kind",
            preflight="rollout_fleet.sglang_version:preflight_problems", package="sglang",
            colocation_package="torch_memory_saver",
        ),
        EngineKind(
            "vllm", "vLLM", "vllm", gpu_server=True,
            memory_field="gpu_memory_utilization", memory_flag="--gpu-memory-utilization",
            memory_is_total=True,
            load_format_field="vllm_load_format", extra_args_field="vllm_extra_args",
            by_handle=False, sync_backends=("nccl",),
            server="rollout_fleet.actors:vllm_server_kind",
            preflight="rollout_fleet.vllm_launcher:preflight_problems", package="vllm",
        ),
    )
}  # fmt: skip


def engine_kind(backend: str) -> EngineKind:
    """The row of ``backend`` (``rollout.backend``, or a reward server's backend)."""
    try:
        return KINDS[backend]
    except KeyError:
        raise ValueError(f"backend {backend!r}; accepted: {', '.join(KINDS)}") from None


def server_backends() -> list[str]:
    """The backends whose engines are GPU server processes."""
    return [name for name, kind in KINDS.items() if kind.gpu_server]
