"""The memory plan of a co-located device: a learner rank and an engine, in turns.

With ``rollout.placement: colocated`` one device holds learner rank i and engine i, so
it must hold the larger of two phases (GiB per device):

- generating: the engine's memory (SGLang's static pool, ``mem_fraction_static`` × the
  device, or for the embedded engine its weights and the KV cache its requests need)
  plus what the learner keeps on the device meanwhile (nothing on GPU with
  ``rollout.colocate.offload_learner``; everything on CPU, where the host is the device);
- training: the learner's estimate (``learner.memory``) plus what the released engine
  keeps (its weights when ``rollout.colocate.release`` leaves them out; the KV cache and
  CUDA graphs are always released).

On GPU each of the two processes also holds a CUDA context (``GPU_RUNTIME_RESERVE_GB``
each). ``fleetrl plan`` prints both phases and the verdict; ``fleetrl check`` refuses a
run whose devices cannot hold the larger one (``launcher.preflight``).

Left out: SGLang's CUDA-graph memory (outside its static pool) and the transient peak
of a push (one bucket, ``weight_sync.bucket_mb``, on top of the training phase).
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config import RunConfig
from learner.memory import GB, ModelShape
from rollout_fleet.engine_kinds import engine_kind

GPU_PROCESS_RESERVE_GB = 2.0  # CUDA context, allocator slack: per process on the device


@dataclass(frozen=True)
class ColocatedPhases:
    """GiB one co-located device holds in each phase, and what it has."""

    generating_gb: float
    training_gb: float
    reserve_gb: float  # CUDA contexts (0 on CPU)
    device_gb: float  # a GPU's memory, or on CPU the host's share per rank

    @property
    def larger_gb(self) -> float:
        return max(self.generating_gb, self.training_gb)

    @property
    def larger(self) -> str:
        return "generating" if self.generating_gb >= self.training_gb else "training"

    @property
    def fits(self) -> bool:
        return self.larger_gb + self.reserve_gb <= self.device_gb


def colocated_phases(
    cfg: RunConfig, shape: ModelShape, device_gb: float, *, on_gpu: bool
) -> ColocatedPhases:
    """Both phases of one device (``device_gb``: its memory, or the host's per rank on CPU)."""
    from launcher.plan import engine_plan, learner_roles

    learner = sum(r.total for r in learner_roles(cfg, shape)) / GB
    engine = engine_plan(cfg, shape, device_gb)
    engine_generating = engine.total_gb(engine_kind(cfg.rollout.backend).gpu_server)
    offloaded = on_gpu and cfg.rollout.colocate.offload_learner
    kept_weights = 0.0 if "weights" in cfg.rollout.colocate.release else engine.weights_gb
    return ColocatedPhases(
        generating_gb=engine_generating + (0.0 if offloaded else learner),
        training_gb=learner + kept_weights,
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
        f" + what the released engine keeps); the larger ({phases.larger}) + "
        f"{phases.reserve_gb:.0f} GiB of CUDA contexts vs {phases.device_gb:.1f} GiB: {verdict}"
    ]
