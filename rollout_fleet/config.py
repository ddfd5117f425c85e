"""Rollout section of the run config: sampling, engines, workers, placement (co-located
engines: ``ColocateConfig``), multi-turn conversations and agent programs as the rollout."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from rollout_fleet.agents.config import AgentConfig
from rollout_fleet.engine_kinds import engine_kind
from rollout_fleet.multi_turn.config import MultiTurnConfig

MemoryTag = Literal["kv_cache", "weights", "cuda_graph"]


def engine_range(start: int, fewest: int, most: int) -> tuple[int, int]:
    """A fleet's (min, max) engines from its config, where 0 stands for the start size."""
    return (fewest or start, most or start)


class ColocateConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How co-located engines give their devices to the learner (``rollout.placement: colocated``)."""

    pause_mode: Annotated[
        Literal["retract", "abort"],
        Meta(
            description="How a co-located engine pauses when the learner takes its device: retract = running samples go back to the head of the engine's queue, their KV recomputed after the step, so the oldest groups still finish first (their HTTP requests stay open: rollout.request_timeout_s must outlast a learner step); abort = samples in flight return their tokens so far and are resubmitted after the step, in no particular order, so old groups can fall behind new ones and past the staleness bound. (in_place keeps running requests, whose KV must be freed: not offered.)"
        ),
    ] = "retract"
    release: Annotated[
        list[MemoryTag],
        Meta(
            min_length=1,
            description="Memory an engine releases for each learner step (SGLang's /release_memory_occupation tags). Must hold kv_cache; without weights the engine keeps them resident through the step (more memory, no weight resume before the push).",
        ),
    ] = msgspec.field(default_factory=lambda: ["kv_cache", "weights", "cuda_graph"])
    offload_learner: Annotated[
        bool,
        Meta(
            description="On GPU: move the learner's weights and optimizer state to host memory while the engines generate, and back before each step. On CPU nothing moves (the host is the device)."
        ),
    ] = True
    remote_engines: Annotated[
        int,
        Meta(
            ge=0,
            description="A mixed run: this many of rollout.num_engines run on rollout nodes instead, on devices of their own (the last ones, engine-<num_ranks> on); they get each version by broadcast (weight_sync.*, paused as weight_sync.pause_mode says) and keep generating through the learner's steps. The others, one per learner rank, are co-located.",
        ),
    ] = 0


class RolloutConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    backend: Annotated[
        Literal["embedded", "sglang", "vllm"],
        Meta(
            description="Engine kind: the embedded SGLang-compatible engine (CPU, one GPU), SGLang servers (GPU) or vLLM servers (GPU, `vllm serve` with its weight-transfer routes)."
        ),
    ] = "embedded"
    num_engines: Annotated[
        int,
        Meta(
            ge=1, description="Number of rollout engines (scaled independently of learner ranks)."
        ),
    ] = 1
    min_engines: Annotated[
        int,
        Meta(
            ge=0,
            description="Elastic fleets (rollout.elastic): the fewest engines. Engines whose node left are not replaced down to this many; below it the fleet waits for room, saying what is missing, and stops the run after ray.placement_timeout_s. 0 = rollout.num_engines.",
        ),
    ] = 0
    max_engines: Annotated[
        int,
        Meta(
            ge=0,
            description="Elastic fleets (rollout.elastic): the most engines, the top of `fleetrl fleet scale --engines` and of the engines placed on rollout nodes that join the cluster. 0 = rollout.num_engines.",
        ),
    ] = 0
    elastic: Annotated[
        bool,
        Meta(
            description="The fleet follows the cluster between min_engines and max_engines, starting at num_engines: a rollout node that joins gets as many engines as fit on it, a node that leaves takes its engines with it (their requests regenerated elsewhere, not replaced down to min_engines), and `fleetrl fleet scale --run RUN_DIR --engines N` sets the target while the run trains (scale-down drains). The reward fleet follows the same rule on reward nodes (reward.model.min_engines, max_engines)."
        ),
    ] = False
    drain_timeout_s: Annotated[
        float,
        Meta(
            ge=0,
            description="Scale-down: with weight_sync.pause_mode in_place, requests in flight on a leaving engine get this long to finish there; the rest (and, with abort or retract, all of them at once) are aborted and resubmitted elsewhere with their tokens so far.",
        ),
    ] = 60.0
    placement_check_interval_s: Annotated[
        float,
        Meta(
            gt=0,
            description="An elastic fleet looks at the cluster's nodes this often: arrivals, losses, and room for the engines it still wants.",
        ),
    ] = 2.0
    n: Annotated[int, Meta(ge=1, description="Samples per prompt (the GRPO group size).")] = 4
    temperature: Annotated[
        float,
        Meta(
            gt=0,
            description="Sampling temperature; the learner recomputes logprobs at the same temperature.",
        ),
    ] = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1, description="Nucleus sampling mass.")] = 1.0
    top_k: Annotated[int, Meta(ge=-1, description="Top-k sampling (-1 = off).")] = -1
    max_new_tokens: Annotated[
        int,
        Meta(
            ge=1,
            description="Maximum response length in tokens (with multi_turn: generated and environment tokens together).",
        ),
    ] = 64
    val_temperature: Annotated[
        float, Meta(ge=0, description="Temperature for validation (0 = greedy).")
    ] = 0.0
    max_concurrent_groups: Annotated[
        int, Meta(ge=1, description="Concurrency cap: groups in flight across the fleet.")
    ] = 64
    request_timeout_s: Annotated[
        float, Meta(gt=0, description="Timeout of one engine HTTP request.")
    ] = 120.0
    reward_timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            description="A reward function running longer than this fails its samples (they train nothing), counted.",
        ),
    ] = 10.0
    reward_workers: Annotated[
        int,
        Meta(ge=1, description="Threads running (non-async) reward functions off the event loop."),
    ] = 2
    cpus_per_engine: Annotated[
        float, Meta(ge=0, description="Ray CPUs reserved per engine actor.")
    ] = 1.0
    gpus_per_engine: Annotated[
        float,
        Meta(
            ge=0,
            description="Ray GPUs per engine actor (the tensor parallel size when backend=sglang or vllm).",
        ),
    ] = 0.0
    mem_fraction_static: Annotated[
        float, Meta(gt=0, le=1, description="SGLang --mem-fraction-static.")
    ] = 0.85
    gpu_memory_utilization: Annotated[
        float,
        Meta(
            gt=0,
            le=1,
            description="vLLM --gpu-memory-utilization: the share of each GPU the engine may use in all (weights, activations and KV cache), unlike SGLang's mem_fraction_static (weights and KV pool).",
        ),
    ] = 0.9
    max_running_requests: Annotated[
        int,
        Meta(
            ge=1, description="Embedded engine: sequences decoded together (continuous batch size)."
        ),
    ] = 64
    sglang_load_format: Annotated[
        Literal["dummy", "auto"],
        Meta(
            description="SGLang --load-format: dummy = random init, the first weights come from the learner's broadcast (the engine is not routed to before); auto = load model.path from disk."
        ),
    ] = "dummy"
    sglang_extra_args: Annotated[
        list[str],
        Meta(
            description="Extra SGLang server arguments appended verbatim, e.g. ['--attention-backend', 'fa3']."
        ),
    ] = []
    vllm_load_format: Annotated[
        Literal["dummy", "auto"],
        Meta(
            description="vLLM --load-format: dummy = random init, the first weights come from the learner's broadcast (the engine is not routed to before); auto = load model.path from disk."
        ),
    ] = "dummy"
    vllm_extra_args: Annotated[
        list[str],
        Meta(
            description="Extra `vllm serve` arguments appended verbatim, e.g. ['--enforce-eager']. The API key never goes here: fleetrl hands it to vLLM in VLLM_API_KEY."
        ),
    ] = []
    engine_startup_timeout_s: Annotated[
        float,
        Meta(gt=0, description="An engine not healthy this long after launch counts as failed."),
    ] = 600.0
    health_check_interval_s: Annotated[
        float, Meta(gt=0, description="Seconds between fleet health checks of every engine.")
    ] = 5.0
    health_check_timeout_s: Annotated[
        float, Meta(gt=0, description="A health check taking longer than this counts as failed.")
    ] = 5.0
    health_failures_before_dead: Annotated[
        int,
        Meta(
            ge=1,
            description="Consecutive failed health checks after which an engine is declared dead and restarted.",
        ),
    ] = 3
    max_engine_restarts: Annotated[
        int,
        Meta(
            ge=0,
            description="Restarts allowed per engine slot; after that the slot stays dead and the run continues with the others.",
        ),
    ] = 3
    suspect_cooldown_s: Annotated[
        float,
        Meta(
            ge=0,
            description="An engine whose request failed gets no new groups for this long unless it is the only one left (the fleet's health checks may clear or kill it sooner).",
        ),
    ] = 30.0
    max_sample_attempts: Annotated[
        int,
        Meta(
            ge=1,
            description="Engine failures one sample may meet (each retried on another engine) before its group is dropped and counted.",
        ),
    ] = 8
    batch_groups: Annotated[
        bool,
        Meta(
            description="Send a group's n samples as one /generate request (SGLang's batch form) for their first piece, where the engine's API takes batches (SGLang, the embedded engine; vLLM's client sends each sample); a sample left unfinished (an abort, a failed or lost request) continues alone. Off: one request per sample from the start. Multi-turn samples and LoRA runs always go one by one.",
        ),
    ] = True
    retry_backoff_s: Annotated[
        float,
        Meta(ge=0, description="Pause before a failed request is retried on another engine."),
    ] = 0.5
    admission_poll_interval_s: Annotated[
        float,
        Meta(
            gt=0,
            description="How often the worker asks the buffer for its staleness counters while it may not start new groups.",
        ),
    ] = 0.2
    stop_deadline_s: Annotated[
        float,
        Meta(
            ge=0,
            description="On stop, groups in flight get this long to finish (and be sent) before they are aborted.",
        ),
    ] = 30.0
    placement: Annotated[
        Literal["disaggregated", "colocated"],
        Meta(
            description="Where engines run: disaggregated = on rollout nodes, generating while the learner trains; colocated = engine i on learner rank i's device (or CPU share), time-sharing it: per version the engine pauses and releases its memory, the learner steps, the new weights are pushed by handle (/update_weights_from_tensor) and the engine resumes (docs/colocation.md)."
        ),
    ] = "disaggregated"
    colocate: ColocateConfig = msgspec.field(default_factory=ColocateConfig)
    multi_turn: MultiTurnConfig = msgspec.field(default_factory=MultiTurnConfig)
    agent: AgentConfig = msgspec.field(default_factory=AgentConfig)

    @property
    def engine_range(self) -> tuple[int, int]:
        """(fewest, most) engines: ``min_engines`` and ``max_engines``, 0 read as ``num_engines``."""
        return engine_range(self.num_engines, self.min_engines, self.max_engines)

    @property
    def colocated(self) -> bool:
        return self.placement == "colocated"

    @property
    def colocated_engines(self) -> int:
        """Engines on learner ranks' devices (engine-0 ... engine-<this - 1>)."""
        return self.num_engines - self.colocate.remote_engines if self.colocated else 0

    def is_colocated_slot(self, index: int) -> bool:
        """Whether engine slot ``index`` shares learner rank ``index``'s device."""
        return index < self.colocated_engines

    @property
    def tp_size(self) -> int:
        """Ranks per engine: a GPU server's tensor-parallel size (``gpus_per_engine``), or 1 for
        the embedded engine. Each engine takes this many consecutive ranks in the weight group."""
        return max(1, int(self.gpus_per_engine)) if self.runs_gpu_servers else 1

    @property
    def runs_gpu_servers(self) -> bool:
        """Whether the engines are GPU server processes (SGLang or vLLM), not the embedded engine."""
        return engine_kind(self.backend).gpu_server
