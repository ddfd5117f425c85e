"""The Ray actor that hosts one engine (embedded engine, SGLang or vLLM server): a rollout engine,
or a reward-model server (``is_embedding``; the embedded engine picks its reward engine
from the folder).

``EngineActor`` is a plain class; ``engine_actor_class()`` applies ``ray.remote``
on demand, so importing this module needs neither a running Ray nor the ray
package. One actor = one engine: it starts the engine in its own process on
its node and returns the engine's URL; the rollout worker then talks to the
engine over HTTP directly (no Ray on the request path).

Binding: engines bind 127.0.0.1 unless the fleet spans nodes; then they bind
the node's IP. Either way an engine started with the run's API key (every run makes one)
requires it on every route but ``/health*``: loopback is no boundary between the users of
a host. The key reaches the engine through Ray (the embedded engine runs in the actor's
process) or a 0600 file (SGLang's ``--config``), never a command line.

Placement: on rollout nodes by a node-kind marker resource, or (co-located) in a
bundle of the learner's placement group beside a learner rank.

Left out: several engines per actor, and GPU placement groups for
multi-GPU tensor-parallel SGLang spanning nodes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fleetrl.log import get_logger, setup_logging
from fleetrl.threads import role_threads
from rollout_fleet.config import RolloutConfig
from rollout_fleet.engine_kinds import engine_kind

log = get_logger(__name__)

LOOPBACK = "127.0.0.1"
_SERVER_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
NODE_MARKER_SHARE = 0.001  # of the node-kind custom resource taken by one engine
DEFAULT_RUNNING_REQUESTS = 64  # an embedded engine whose spec leaves it to the server


@dataclass
class EngineSpec:
    """How to start one engine (everything the actor needs; sent to it by Ray)."""

    name: str
    model_path: str
    backend: Literal["embedded", "sglang", "vllm"] = "embedded"
    device: str = "cpu"
    dtype: str = "float32"
    max_running_requests: int | None = 64  # None: SGLang sizes it from memory
    expose_on_node_ip: bool = False
    api_key: str | None = field(default=None, repr=False)  # the run's: never logged
    port: int = 0
    torch_threads: int = 1
    # GPU servers (sglang, vllm) only
    tp_size: int = 1
    mem_fraction_static: float = 0.85  # SGLang's
    gpu_memory_utilization: float = 0.9  # vLLM's
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
        try:
            engine_kind(self.backend)
        except ValueError as err:
            raise ValueError(f"engine {self.name}: {err}") from None


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
    kind = engine_kind(config.backend)
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
        gpu_memory_utilization=config.gpu_memory_utilization,
        load_format=kind.load_format(config),  # type: ignore[arg-type]
        disable_radix_cache=radix_cache_disabled_for(pause_mode),
        lora_rank=lora_rank,
        lora_target_modules=list(lora_target_modules or ["all-linear"]),
        memory_saver=colocated,
        extra_args=kind.extra_args(config),
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
        if engine_kind(self.spec.backend).gpu_server:
            self._url = self._start_server(host)
        else:
            self._url = self._start_embedded(host)
        log.info("engine %s serving at %s (pid %d)", self.spec.name, self._url, os.getpid())
        return self._url

    def url(self) -> str:
        return self._url

    def ping(self) -> dict[str, Any]:
        """Liveness of the actor process (the fleet checks the engine's HTTP health apart)
        and the Ray node it runs on."""
        import ray

        alive = self._url != ""
        if self._engine is not None and engine_kind(self.spec.backend).gpu_server:
            alive = alive and self._engine.alive()
        elif self._engine is not None:
            alive = alive and self._engine.alive
        node = ray.get_runtime_context().get_node_id()
        return {
            "name": self.spec.name,
            "pid": os.getpid(),
            "url": self._url,
            "alive": alive,
            "node": node,
        }

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

    def _start_server(self, host: str) -> str:
        server_class, spec_of = engine_kind(self.spec.backend).load("server")()
        server = server_class(
            spec_of(self.spec, host),
            startup_timeout_s=self.spec.startup_timeout_s,
            log_path=(
                os.path.join(self.spec.log_dir, f"{self.spec.name}.{self.spec.backend}.log")
                if self.spec.log_dir
                else None
            ),
        )
        self._engine = server
        return server.start()


def sglang_server_spec(spec: EngineSpec, host: str = LOOPBACK) -> Any:
    """The ``SGLangServerSpec`` (command line) of an SGLang engine spec."""
    from rollout_fleet.sglang_launcher import SGLangServerSpec

    dtype = _SERVER_DTYPES.get(spec.dtype, "auto")
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


def vllm_server_spec(spec: EngineSpec, host: str = LOOPBACK) -> Any:
    """The ``VllmServerSpec`` (command line) of a vLLM engine spec."""
    from rollout_fleet.vllm_launcher import VllmServerSpec

    return VllmServerSpec(
        model_path=spec.model_path,
        api_key=spec.api_key or "",
        host=host,
        port=spec.port,
        tp_size=spec.tp_size,
        gpu_memory_utilization=spec.gpu_memory_utilization,
        load_format=spec.load_format,
        dtype=_SERVER_DTYPES.get(spec.dtype, "auto"),
        max_num_seqs=spec.max_running_requests,
        enable_prefix_caching=not spec.disable_radix_cache,
        enable_sleep_mode=spec.memory_saver,
        lora_rank=spec.lora_rank,
        extra_args=list(spec.extra_args),
    )


def sglang_server_kind() -> tuple[Any, Callable[[EngineSpec, str], Any]]:
    """SGLang's server class and its spec from ours (``rollout_fleet.engine_kinds``)."""
    from rollout_fleet.sglang_launcher import SGLangServer

    return SGLangServer, sglang_server_spec


def vllm_server_kind() -> tuple[Any, Callable[[EngineSpec, str], Any]]:
    """vLLM's server class and its spec from ours (``rollout_fleet.engine_kinds``)."""
    from rollout_fleet.vllm_launcher import VllmServer

    return VllmServer, vllm_server_spec


_REMOTE_CLASS: Any = None


def engine_actor_class() -> Any:
    """``ray.remote(EngineActor)``, built once (threaded: ping answers while start runs)."""
    global _REMOTE_CLASS
    if _REMOTE_CLASS is None:
        import ray

        _REMOTE_CLASS = ray.remote(max_concurrency=4, max_restarts=0)(EngineActor)
    return _REMOTE_CLASS


def node_strategy(node_id: str) -> Any:
    """Ray's scheduling strategy that places an actor on node ``node_id`` or nowhere (an
    elastic fleet chose that node: it has room, or it just joined)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


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
