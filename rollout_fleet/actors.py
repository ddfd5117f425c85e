"""The Ray actor that hosts one engine (embedded engine or SGLang server): a rollout engine,
or a reward-model server (``is_embedding``; the embedded engine picks its reward engine
from the folder).

``EngineActor`` is a plain class; ``engine_actor_class()`` applies ``ray.remote``
on demand, so importing this module needs neither a running Ray nor the ray
package. One actor = one engine: it starts the engine in its own process on
its node and returns the engine's URL; the rollout worker then talks to the
engine over HTTP directly (no Ray on the request path).

Binding: engines bind 127.0.0.1 unless the fleet spans nodes; then they bind
the node's IP and require a bearer API key (DESIGN section 4).

Placement: on rollout nodes by a node-kind marker resource, or (co-located) in a
bundle of the learner's placement group beside a learner rank.

Left out: several engines per actor, and GPU placement groups for
multi-GPU tensor-parallel SGLang spanning nodes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from fleetrl.log import get_logger, setup_logging
from fleetrl.threads import role_threads
from rollout_fleet.config import RolloutConfig

log = get_logger(__name__)

LOOPBACK = "127.0.0.1"
NODE_MARKER_SHARE = 0.001  # of the node-kind custom resource taken by one engine
DEFAULT_RUNNING_REQUESTS = 64  # an embedded engine whose spec leaves it to the server


@dataclass
class EngineSpec:
    """How to start one engine (everything the actor needs; sent to it by Ray)."""

    name: str
    model_path: str
    backend: Literal["embedded", "sglang"] = "embedded"
    device: str = "cpu"
    dtype: str = "float32"
    max_running_requests: int | None = 64  # None: SGLang sizes it from memory
    expose_on_node_ip: bool = False
    api_key: str | None = None
    port: int = 0
    torch_threads: int = 1
    # sglang only
    tp_size: int = 1
    mem_fraction_static: float = 0.85
    load_format: Literal["dummy", "auto"] = "dummy"
    disable_radix_cache: bool = False
    lora_rank: int = 0  # learner.lora.rank: > 0 launches SGLang with LoRA on
    memory_saver: bool = False  # co-located: released memory is freed (--enable-memory-saver)
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    is_embedding: bool = False  # a reward model: SGLang's --is-embedding (/classify)
    extra_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 600.0
    log_dir: str | None = None

    def validate(self) -> None:
        if self.expose_on_node_ip and not self.api_key:
            raise ValueError(
                f"engine {self.name}: binding the node IP (fleet spans nodes) requires an api_key"
            )
        if self.backend not in ("embedded", "sglang"):
            raise ValueError(
                f"engine {self.name}: backend {self.backend!r}; accepted: embedded, sglang"
            )


def engine_spec(
    config: RolloutConfig,
    name: str,
    model_path: str,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    api_key: str | None = None,
    expose_on_node_ip: bool = False,
    log_dir: str | None = None,
    pause_mode: str = "in_place",
    lora_rank: int = 0,
    lora_target_modules: list[str] | None = None,
    colocated: bool = False,
) -> EngineSpec:
    """The spec of engine ``name`` from the rollout config (``pause_mode``: how it pauses
    for weight updates, weight_sync.pause_mode; ``lora_rank`` / ``lora_target_modules``:
    learner.lora). A ``colocated`` engine (on a learner rank's device) pauses as
    rollout.colocate.pause_mode says and frees released memory (SGLang's
    ``--enable-memory-saver``)."""
    from rollout_fleet.sglang_launcher import radix_cache_disabled_for

    if colocated:
        pause_mode = config.colocate.pause_mode
    return EngineSpec(
        name=name,
        model_path=str(model_path),
        backend=config.backend,
        device=device,
        dtype=dtype,
        max_running_requests=config.max_running_requests,
        expose_on_node_ip=expose_on_node_ip,
        api_key=api_key,
        torch_threads=role_threads(config.cpus_per_engine),
        tp_size=config.tp_size,
        mem_fraction_static=config.mem_fraction_static,
        load_format=config.sglang_load_format,
        disable_radix_cache=radix_cache_disabled_for(pause_mode),
        lora_rank=lora_rank,
        lora_target_modules=list(lora_target_modules or ["all-linear"]),
        memory_saver=colocated,
        extra_args=list(config.sglang_extra_args),
        startup_timeout_s=config.engine_startup_timeout_s,
        log_dir=log_dir,
    )


class EngineActor:
    """Starts, reports and stops one engine inside a Ray worker process."""

    def __init__(self, spec: EngineSpec):
        spec.validate()
        setup_logging(role=f"engine:{spec.name}")
        self.spec = spec
        self._engine: Any = None  # EmbeddedEngine or SGLangServer
        self._url = ""

    def start(self) -> str:
        """Start the engine (blocking until it serves); returns its base URL."""
        if self._url:
            return self._url
        host = self._host()
        if self.spec.backend == "embedded":
            self._url = self._start_embedded(host)
        else:
            self._url = self._start_sglang(host)
        log.info("engine %s serving at %s (pid %d)", self.spec.name, self._url, os.getpid())
        return self._url

    def url(self) -> str:
        return self._url

    def ping(self) -> dict[str, Any]:
        """Liveness of the actor process (the fleet checks the engine's HTTP health apart)."""
        alive = self._url != ""
        if self._engine is not None and self.spec.backend == "sglang":
            alive = alive and self._engine.alive()
        elif self._engine is not None:
            alive = alive and self._engine.alive
        return {"name": self.spec.name, "pid": os.getpid(), "url": self._url, "alive": alive}

    def stop(self) -> None:
        engine, self._engine = self._engine, None
        self._url = ""
        if engine is not None:
            engine.stop()

    def _host(self) -> str:
        if not self.spec.expose_on_node_ip:
            return LOOPBACK
        import ray

        return ray.util.get_node_ip_address()

    def _start_embedded(self, host: str) -> str:
        from rollout_fleet.engine.kinds import open_engine

        engine = open_engine(  # a reward-model folder gets the reward engine
            self.spec.model_path,
            engine_id=self.spec.name,
            device=self.spec.device,
            max_running_requests=self.spec.max_running_requests or DEFAULT_RUNNING_REQUESTS,
            dtype=self.spec.dtype,
            api_key=self.spec.api_key,
            require_api_key=self.spec.expose_on_node_ip,
            num_threads=self.spec.torch_threads,
            memory_saver=self.spec.memory_saver,
        )
        url = engine.start_server(host=host, port=self.spec.port)
        self._engine = engine
        return url

    def _start_sglang(self, host: str) -> str:
        from rollout_fleet.sglang_launcher import SGLangServer

        server = SGLangServer(
            sglang_server_spec(self.spec, host),
            startup_timeout_s=self.spec.startup_timeout_s,
            log_path=(
                os.path.join(self.spec.log_dir, f"{self.spec.name}.sglang.log")
                if self.spec.log_dir
                else None
            ),
        )
        self._engine = server
        return server.start()


def sglang_server_spec(spec: EngineSpec, host: str = LOOPBACK) -> Any:
    """The ``SGLangServerSpec`` (command line) of an SGLang engine spec."""
    from rollout_fleet.sglang_launcher import SGLangServerSpec

    dtype = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(
        spec.dtype, "auto"
    )
    return SGLangServerSpec(
        model_path=spec.model_path,
        host=host,
        port=spec.port,
        tp_size=spec.tp_size,
        mem_fraction_static=spec.mem_fraction_static,
        api_key=spec.api_key,
        load_format=spec.load_format,
        dtype=dtype,
        max_running_requests=spec.max_running_requests,
        disable_radix_cache=spec.disable_radix_cache,
        lora_rank=spec.lora_rank,
        lora_target_modules=list(spec.lora_target_modules),
        is_embedding=spec.is_embedding,
        enable_memory_saver=spec.memory_saver,
        extra_args=list(spec.extra_args),
    )


_REMOTE_CLASS: Any = None


def engine_actor_class() -> Any:
    """``ray.remote(EngineActor)``, built once (threaded: ping answers while start runs)."""
    global _REMOTE_CLASS
    if _REMOTE_CLASS is None:
        import ray

        _REMOTE_CLASS = ray.remote(max_concurrency=4, max_restarts=0)(EngineActor)
    return _REMOTE_CLASS


def create_engine_actor(
    spec: EngineSpec,
    *,
    num_cpus: float,
    num_gpus: float,
    resource_name: str | None = None,
    scheduling_strategy: Any = None,
) -> Any:
    """Create the actor for ``spec`` with its Ray resources (not yet started).

    ``scheduling_strategy``: a co-located engine's bundle in the learner's placement group
    (``launcher.placement.colocated_engine_strategy``); it then needs no node marker.
    """
    options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
    if scheduling_strategy is not None:
        options["scheduling_strategy"] = scheduling_strategy
    elif resource_name:
        # the resource marks a node *kind*: a node declaring rollout: 1 hosts many engines
        options["resources"] = {resource_name: NODE_MARKER_SHARE}
    return engine_actor_class().options(**options).remote(spec)
