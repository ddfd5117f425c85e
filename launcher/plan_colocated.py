"""The memory plan of a co-located device: a learner rank and an engine, in turns.

With ``rollout.placement: colocated`` one device holds learner rank i and engine i, so
it must hold the largest of three phases (GiB per device):

- generating: the engine's memory (SGLang's static pool, ``mem_fraction_static`` × the
  device, or for the embedded engine its weights and the KV cache its requests need)
  plus what the learner keeps on the device meanwhile (nothing on GPU with
  ``rollout.colocate.offload_learner``; everything on CPU, where the host is the device);
  the push's staging buffers are freed at its end (``weight_sync.tensor_push``);
- training: the learner's estimate (``learner.memory``) plus what the released engine
  keeps (its weights when ``rollout.colocate.release`` leaves them out; the KV cache and
  CUDA graphs are always released);
- pushing: the learner's models back on the device (their sharded weights, no
  gradients, one parameter gathered in full; the optimizer state stays on the host with
  ``offload_learner``, on the device without it), the engine's weights resumed, and the two staging buffers of the push, each
  as large as a bucket or the largest tensor (fp32, the learner's parameter dtype:
  ~2.2 GB for a 7B model's embedding).

On GPU each of the two processes also holds a CUDA context (``GPU_RUNTIME_RESERVE_GB``
each). ``fleetrl plan`` prints the phases and the verdict; ``fleetrl check`` refuses a
run whose devices cannot hold the largest (``launcher.preflight``).

Left out: SGLang's CUDA-graph memory (outside its static pool), the KV cache an engine
resumes after the push (generating counts it).
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config import RunConfig
from learner.memory import GB, ModelShape
from rollout_fleet.engine_kinds import engine_kind

GPU_PROCESS_RESERVE_GB = 2.0  # CUDA context, allocator slack: per process on the device
PUSH_TENSOR_BYTES = 4  # the learner's parameters are fp32 (its master copy): so are pushes


@dataclass(frozen=True)
class ColocatedPhases:
    """GiB one co-located device holds in each phase, and what it has."""

    generating_gb: float
    training_gb: float
    pushing_gb: float
    reserve_gb: float  # CUDA contexts (0 on CPU)
    device_gb: float  # a GPU's memory, or on CPU the host's share per rank

    @property
    def by_phase(self) -> dict[str, float]:
        return {
            "generating": self.generating_gb,
            "training": self.training_gb,
            "pushing": self.pushing_gb,
        }

    @property
    def larger_gb(self) -> float:
        return max(self.by_phase.values())

    @property
    def larger(self) -> str:
        return max(self.by_phase, key=self.by_phase.__getitem__)

    @property
    def fits(self) -> bool:
        return self.larger_gb + self.reserve_gb <= self.device_gb


def staging_buffer_bytes(cfg: RunConfig, shape: ModelShape, *, on_gpu: bool) -> int:
    """One staging buffer of the push: a bucket, or the largest tensor when it is larger."""
    from weight_sync.config import bucket_mb_for

    largest = max(shape.embed_params, shape.hidden * shape.intermediate) * PUSH_TENSOR_BYTES
    bucket = int(bucket_mb_for(cfg.weight_sync, "nccl" if on_gpu else "gloo") * 2**20)
    return max(bucket, largest)


def pushing_gb(cfg: RunConfig, shape: ModelShape, engine_weights_gb: float, *, on_gpu: bool) -> float:  # fmt: skip
    """The push phase (module docstring): learner resident, engine weights, two buffers."""
    from launcher.plan import learner_roles

    roles = learner_roles(cfg, shape)
    optimizer_kept = not (on_gpu and cfg.rollout.colocate.offload_learner)
    resident = sum(r.weights + (r.optimizer if optimizer_kept else 0.0) for r in roles)
    gathered = max(shape.embed_params, shape.hidden * shape.intermediate) * PUSH_TENSOR_BYTES
    staging = 2 * staging_buffer_bytes(cfg, shape, on_gpu=on_gpu)
    return (resident + gathered + staging) / GB + engine_weights_gb


def colocated_phases(
    cfg: RunConfig, shape: ModelShape, device_gb: float, *, on_gpu: bool
) -> ColocatedPhases:
    """Every phase of one device (``device_gb``: its memory, or the host's per rank on CPU)."""
    from launcher.plan import engine_plan, learner_roles

    learner = sum(r.total for r in learner_roles(cfg, shape)) / GB
    engine = engine_plan(cfg, shape, device_gb)
    engine_generating = engine.total_gb(engine_kind(cfg.rollout.backend).gpu_server)
    offloaded = on_gpu and cfg.rollout.colocate.offload_learner
    kept_weights = 0.0 if "weights" in cfg.rollout.colocate.release else engine.weights_gb
    return ColocatedPhases(
        generating_gb=engine_generating + (0.0 if offloaded else learner),
        training_gb=learner + kept_weights,
        pushing_gb=pushing_gb(cfg, shape, engine.weights_gb, on_gpu=on_gpu),
        reserve_gb=2 * GPU_PROCESS_RESERVE_GB if on_gpu else 0.0,
        device_gb=device_gb,
    )


def render_phases(phases: ColocatedPhases, on_gpu: bool) -> list[str]:
    """The plan's lines for a co-located device."""
    where = "device" if on_gpu else "host share per rank"
    verdict = "fits" if phases.fits else "DOES NOT FIT"
    return [
        f"co-located {where}: generating {phases.generating_gb:.3f} GiB (engine"
        f"{'' if on_gpu else ' + learner'}), training {phases.training_gb:.3f} GiB (learner"
        f" + what the released engine keeps), pushing {phases.pushing_gb:.3f} GiB (learner"
        f" resident + engine weights + two staging buffers); the largest ({phases.larger}) + "
        f"{phases.reserve_gb:.0f} GiB of CUDA contexts vs {phases.device_gb:.1f} GiB: {verdict}"
    ]
