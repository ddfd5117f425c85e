"""What one weight publication measured, per version and per engine.

``SyncMetrics.as_log_dict`` flattens it for the learner's metrics stream
(``weight_sync/total_s`` ...). Times are seconds of wall clock on learner rank
0; ``gbps`` is gigabytes (1e9 bytes) per second of the bucket stream, from the
first update request to the last engine reply.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineSyncStatus:
    """How one engine fared in one publication."""

    name: str
    ok: bool = True
    error: str | None = None
    load_s: float = 0.0  # summed over buckets: broadcast done -> the engine's HTTP reply
    verified: bool | None = None  # None: not verified


@dataclass
class SyncMetrics:
    """Timings and sizes of one ``WeightSender.publish``."""

    version: int
    gather_s: float = 0.0  # blocked pulling full tensors from the learner and packing buckets
    broadcast_s: float = 0.0  # summed per bucket: request sent -> broadcast complete
    engine_load_s: float = 0.0  # the slowest engine's summed load_s
    pause_s: float = 0.0
    group_setup_s: float = 0.0
    resume_s: float = 0.0
    paused_s: float = 0.0  # the engines' pause window: pause sent -> every continue answered
    verify_s: float = 0.0  # keeping the sent rows plus the engines' /model_info and row replies
    write_s: float = 0.0  # LoRA: writing the adapter folder the engines load (adapter_sender)
    total_s: float = 0.0
    bytes: int = 0
    gbps: float = 0.0
    num_buckets: int = 0
    num_tensors: int = 0
    engines: dict[str, EngineSyncStatus] = field(default_factory=dict)

    @property
    def failed_engines(self) -> list[str]:
        return sorted(name for name, status in self.engines.items() if not status.ok)

    def as_log_dict(self, prefix: str = "weight_sync/") -> dict[str, float]:
        keys = (
            "version",
            "gather_s",
            "broadcast_s",
            "engine_load_s",
            "pause_s",
            "group_setup_s",
            "resume_s",
            "paused_s",
            "verify_s",
            "write_s",
            "total_s",
            "bytes",
            "gbps",
            "num_buckets",
            "num_tensors",
        )
        out = {prefix + k: float(getattr(self, k)) for k in keys}
        out[prefix + "num_engines"] = float(len(self.engines))
        out[prefix + "num_failed"] = float(len(self.failed_engines))
        return out

    def summary(self) -> str:
        return (
            f"weights v{self.version}: {self.bytes / 2**20:.1f} MiB in {self.num_buckets} buckets "
            f"to {len(self.engines)} engines, {self.total_s:.3f}s total "
            f"(gather {self.gather_s:.3f}s, broadcast {self.broadcast_s:.3f}s, "
            f"load {self.engine_load_s:.3f}s, verify {self.verify_s:.3f}s), {self.gbps:.2f} GB/s"
            + (f", failed: {', '.join(self.failed_engines)}" if self.failed_engines else "")
        )
