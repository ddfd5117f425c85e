"""The memory saver a TP rank hands SGLang's ``SchedulerWeightUpdaterManager``, on CPU.

SGLang's ``release_memory_occupation`` / ``resume_memory_occupation`` (their tag rules,
the idle assertion, the resume order, the KV flush, the stashed buffers) run as they
are; only the allocator below them is ours: where ``torch_memory_saver`` unmaps CUDA
memory by tag, this adapter frees the rank's weight storages in place for ``weights``
(``rollout_fleet.engine.memory_saver.WeightStorages``: resumed weights hold garbage
until the next push, as SGLang's do without ``--enable-weights-cpu-backup``) and only
records ``kv_cache`` and ``cuda_graph`` (this engine has neither). Every call is logged
in order for the tests (``calls``).
"""

from __future__ import annotations

from contextlib import nullcontext

from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

from rollout_fleet.engine.memory_saver import WEIGHTS, WeightStorages, parameter_storages


class CpuMemorySaver(TorchMemorySaverAdapter):
    def __init__(self, model) -> None:
        self.model = model
        self.weights = WeightStorages(model)
        self.calls: list[str] = []

    def weights_nbytes(self) -> int:
        """Bytes the rank's weights hold now (0 while released)."""
        return sum(s.nbytes() for s in parameter_storages(self.model))

    @property
    def enabled(self) -> bool:
        return True

    def pause(self, tag: str) -> None:
        self.calls.append(f"pause:{tag}")
        if tag == WEIGHTS:
            self.weights.release()

    def resume(self, tag: str) -> None:
        self.calls.append(f"resume:{tag}")
        if tag == WEIGHTS:
            self.weights.resume()

    def region(self, tag: str, enable_cpu_backup: bool = False):
        return nullcontext()

    def cuda_graph(self, **kwargs):
        return nullcontext()

    def configure_subprocess(self):
        return nullcontext()

    def disable(self) -> None:
        self.calls.append("disable")
