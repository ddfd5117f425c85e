"""The embedded engine's memory occupation: what SGLang's release/resume tags free and take back.

SGLang 0.5.23 (``SchedulerWeightUpdaterManager.release_memory_occupation``) releases
by tag: ``kv_cache`` (flushed first), ``weights``, ``cuda_graph``; no tags means all.
It asserts the engine is idle (waiting requests are ignored while generation is
paused), and resumes in the order cuda_graph -> weights -> kv_cache whatever order
the tags come in; resuming a tag that was never released raises. This class does the
same for one ``ModelRunner``, on the scheduler thread (``Scheduler.call``):

- ``weights``: every storage behind the model's parameters is resized to zero bytes
  in place (``UntypedStorage.resize_(0)``), so every view of it, the fused decoder's
  fused projections included, stays a view; resuming resizes them back. Released
  weights are dropped, not copied to the host: the next ``/update_weights_from_tensor``
  fills them, as it does for SGLang without ``--enable-weights-cpu-backup``, whose
  resumed weights are garbage until that push too. Why not a host copy: on CPU the
  host is the device, so a copy frees nothing, and in the co-located cycle a push
  follows every resume anyway. Storages the model was loaded into that cannot be
  resized (safetensors memory maps) are replaced by owned copies once, at start.
  Buffers (rotary frequencies) are kept: they are small and no push carries them.
- ``kv_cache``: the running batch's KV and the prefix (prefill) cache are dropped; the
  cache refills as requests run again.
- ``cuda_graph``: the embedded engine captures no graphs; the tag is accepted and recorded.

After a release the freed memory goes back to the system: ``torch.cuda.empty_cache()``
on CUDA, glibc's ``malloc_trim(0)`` on CPU (the process's RSS drops by about the
released bytes: tests/unit/rollout_fleet/test_memory_saver.py). While any tag is
released the scheduler runs nothing: requests that arrive wait in its queue.

``enabled=False`` is SGLang without ``--enable-memory-saver``: the calls succeed and the
bookkeeping (and the KV flush) happens, but nothing is freed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Iterable

import torch

from fleetrl.log import get_logger
from rollout_fleet.engine.runner import ModelRunner
from rollout_fleet.engine.scheduler import Scheduler

log = get_logger(__name__)

WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"
MEMORY_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)  # SGLang's GPU_MEMORY_ALL_TYPES
RESUME_ORDER = (CUDA_GRAPH, WEIGHTS, KV_CACHE)
GB = 1024**3
NOT_IDLE = "release_memory_occupation should be called only when server is idle."


class MemoryOccupationError(ValueError):
    """A release or resume that does not apply (busy engine, unknown or unreleased tag)."""


def parse_tags(tags: Iterable[str] | None) -> list[str]:
    """SGLang's rule: no tags (None or []) means every tag; unknown tags are refused here."""
    tags = list(tags or [])
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise MemoryOccupationError(f"unknown memory tags {unknown}; accepted: {list(MEMORY_TAGS)}")
    return tags or list(MEMORY_TAGS)


def _trim_host_heap() -> None:
    """Give freed heap pages back to the OS (glibc; elsewhere a no-op)."""
    name = ctypes.util.find_library("c")
    if not name:
        return
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL(name).malloc_trim(0)


def parameter_storages(model: torch.nn.Module) -> list[torch.UntypedStorage]:
    """The distinct storages behind a model's parameters (fused and tied ones once)."""
    unique: dict[int, torch.UntypedStorage] = {}
    for param in model.parameters():
        storage = param.untyped_storage()
        unique.setdefault(storage.data_ptr(), storage)
    return list(unique.values())


class WeightStorages:
    """A model's parameter storages, freed and given back in place (views stay views)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._sizes: list[tuple[torch.UntypedStorage, int]] = []
        with torch.no_grad():  # memory-mapped checkpoint storages cannot be resized: own them
            for param in model.parameters():
                if not param.untyped_storage().resizable():
                    param.data = param.data.clone()

    def release(self) -> int:
        """Resize every storage to zero bytes; the bytes freed."""
        self._sizes = [(s, s.nbytes()) for s in parameter_storages(self.model)]
        for storage, _ in self._sizes:
            storage.resize_(0)
        return sum(n for _, n in self._sizes)

    def resume(self) -> None:
        """Give every storage its size back, uninitialised (the next push fills it)."""
        for storage, nbytes in self._sizes:
            storage.resize_(nbytes)
        self._sizes = []


class EngineMemory:
    """Release and resume of one engine's memory by tag; methods run on the scheduler thread."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, *, enabled: bool) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.enabled = enabled
        self.released: set[str] = set()
        self.released_bytes = 0  # the last release's
        self.weights = WeightStorages(runner.model) if enabled else None

    def weight_bytes(self) -> int:
        """Bytes the weights hold now (0 while released by the memory saver)."""
        return sum(s.nbytes() for s in parameter_storages(self.runner.model))

    def kv_bytes(self) -> int:
        return self.runner.kv.nbytes() + self.scheduler.prefill_cache.nbytes()

    def usage(self) -> dict[str, object]:
        """SGLang's ``memory_usage`` shape (GiB), with what is held now."""
        return {"weight": self.weight_bytes() / GB, "kvcache": self.kv_bytes() / GB, "graph": {}}

    # ---- release / resume (scheduler thread) -------------------------------------------

    def release(self, tags: Iterable[str] | None) -> int:
        """Free the memory of ``tags``; the bytes freed. Refused unless the engine is idle."""
        tags = parse_tags(tags)
        sched = self.scheduler
        busy = any(not s.finished for s in sched.running)
        if busy or (sched.waiting and sched.paused_mode is None):
            raise MemoryOccupationError(NOT_IDLE)
        new = [t for t in tags if t not in self.released]
        freed = 0
        if KV_CACHE in new:
            freed += self.kv_bytes()
            sched.flush_now()
        if WEIGHTS in new and self.weights is not None:
            freed += self.weights.release()
        self.released.update(new)
        sched.memory_released = bool(self.released)
        if self.enabled:
            self._return_to_system()
        else:
            freed = 0  # nothing leaves the process without the memory saver, as in SGLang
        self.released_bytes = freed
        log.info("%s: released %s (%.1f MiB)", sched.name, sorted(new), freed / 2**20)
        return freed

    def resume(self, tags: Iterable[str] | None) -> None:
        """Take the memory of ``tags`` back, cuda_graph -> weights -> kv_cache."""
        tags = parse_tags(tags)
        never = [t for t in tags if t not in self.released]
        if never:
            raise MemoryOccupationError(
                f"resume_memory_occupation: {never} were not released (released: "
                f"{sorted(self.released)})"
            )
        for tag in RESUME_ORDER:
            if tag not in tags:
                continue
            if tag == WEIGHTS and self.weights is not None:
                self.weights.resume()  # uninitialised until the next push fills it
            self.released.discard(tag)
        self.scheduler.memory_released = bool(self.released)
        log.info("%s: resumed %s", self.scheduler.name, [t for t in RESUME_ORDER if t in tags])

    def _return_to_system(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            _trim_host_heap()
