"""One TP rank of the engine: a process that runs SGLang's weight-update code on our model.

Each rank joins a gloo default process group with the other TP ranks (its
``tp_cpu_group``), publishes the ``ServerArgs`` under the scheduler role,
loads the HF model, and builds SGLang's own weight-update objects:

- ``SchedulerWeightUpdaterManager`` (scheduler side: the begin..end session
  rule, ``flush_cache_after_weight_update``, ``record_weight_version_after_update``,
  barriers on the TP group),
- ``WeightUpdater`` (model-runner side: ``init_custom_process_group`` with rank
  ``rank_offset + tp_rank``, ``receive_weights_from_distributed`` with
  ``FlattenedTensorBucket`` or one broadcast per tensor,
  ``load_weights_from_distributed``) and ``WeightExporter`` (``get_weights_by_name``),
- ``SchedulerFlushWrapper`` for ``/flush_cache`` (with its deferred-timeout path),
- ``BaseTpWorker.init_weights_update_group`` / ``destroy_weights_update_group`` /
  ``get_weights_by_name`` on our thin tp-worker adapter;
- LoRA load / unload requests go to ``lora.LoraAdapters`` (peft on the rank's
  model, in place of SGLang's GPU ``LoRAManager``);
- co-location: the manager's ``release_memory_occupation`` /
  ``resume_memory_occupation`` over ``memory.CpuMemorySaver`` (in place of
  ``torch_memory_saver``), and ``update_weights_from_tensor`` with
  ``BaseTpWorker.deserialize_own_rank`` (each rank reads its own payload entry with
  SGLang's ``SafeUnpickler``) and the model runner's flattened-bucket loader. An
  exception SGLang's scheduler would die of (a failed assertion, a resume of a tag
  never released) is kept in ``errors`` and read by the test (``RankMemoryRequest``).
  SGLang synchronizes ``torch.get_device_module()`` after a release, which on a
  CUDA build of torch is ``torch.cuda`` even with no GPU: on this CPU engine it is
  ``torch.cpu`` (``_cpu_device_module``).

The loop serves two pipes: control requests from the HTTP process (SGLang's
``io_struct`` types, answered with theirs) and the test's weight read-out.
TP rank 0 also generates (see ``scheduler.py``) between control requests, as
SGLang's event loop interleaves them, or, serving a reward model, scores the embedding
requests dispatched to it (``embedding.score``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from multiprocessing.connection import Connection, wait
from typing import Any

from . import messages as m

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.05


@dataclasses.dataclass(frozen=True)
class RankConfig:
    model_dir: str
    tp_rank: int
    tp_size: int
    tp_group_port: int
    lora_rank: int = 0  # > 0: --enable-lora with this --max-lora-rank
    is_embedding: bool = False  # a reward model: --is-embedding, rank 0 scores


def lora_server_args(rank: int) -> dict:
    """The ``ServerArgs`` fields fleetrl's launcher sets for LoRA (``sglang_launcher.lora_args``)."""
    from rollout_fleet.sglang_launcher import LORA_SLOTS

    if not rank:
        return {}
    return {
        "enable_lora": True,
        "max_lora_rank": rank,
        "lora_target_modules": ["all"],
        "max_loras_per_batch": LORA_SLOTS,
        "max_loaded_loras": LORA_SLOTS,
    }


class _TpGroup:
    """What ``get_parallel().tp_group`` holds for the code that runs here."""

    def __init__(self, cpu_group: Any, world_size: int):
        self.cpu_group = cpu_group
        self.world_size = world_size


class _ModelRunner:
    """The model-runner attributes SGLang's scheduler-side weight code reads."""

    def __init__(self, model, weight_updater, weight_exporter):
        self.model = model
        self.weight_updater = weight_updater
        self.weight_exporter = weight_exporter


def _build_tp_worker(model_runner: _ModelRunner):
    from sglang.srt.managers.tp_worker import BaseTpWorker, TpModelWorker

    class _TpWorker:
        """SGLang's own tp-worker methods for the weight ops, over our model runner."""

        init_weights_update_group = BaseTpWorker.init_weights_update_group
        destroy_weights_update_group = BaseTpWorker.destroy_weights_update_group
        get_weights_by_name = BaseTpWorker.get_weights_by_name
        deserialize_own_rank = BaseTpWorker.deserialize_own_rank
        weight_update_runners = TpModelWorker.weight_update_runners

        def __init__(self, runner: _ModelRunner):
            self.model_runner = runner
            self._model_runner = runner

    return _TpWorker(model_runner)


class RankProcess:
    def __init__(self, cfg: RankConfig, ctrl: Connection, inspect: Connection):
        import torch
        import torch.distributed as dist
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.managers.scheduler_components.flush_wrapper import SchedulerFlushWrapper
        from sglang.srt.managers.scheduler_components.weight_updater import (
            SchedulerWeightUpdaterManager,
        )
        from sglang.srt.model_executor.model_runner_components.weight_exporter import (
            WeightExporter,
        )
        from sglang.srt.model_executor.model_runner_components.weight_updater import (
            WeightUpdater,
        )
        from sglang.srt.runtime_context import get_parallel, publish
        from sglang.srt.server_args import ServerArgs

        from .memory import CpuMemorySaver
        from .model import HFModelAdapter
        from .scheduler import EngineScheduler

        torch.set_num_threads(1)
        self.cfg = cfg
        self.ctrl = ctrl
        self.inspect = inspect
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{cfg.tp_group_port}",
            rank=cfg.tp_rank,
            world_size=cfg.tp_size,
        )
        server_args = ServerArgs(
            model_path=cfg.model_dir,
            device="cpu",
            load_format="dummy",
            tp_size=cfg.tp_size,
            is_embedding=cfg.is_embedding,
            **lora_server_args(cfg.lora_rank),
        )
        publish(server_args, role="scheduler")
        get_parallel().override_permanently(
            tp_rank=cfg.tp_rank, tp_group=_TpGroup(dist.group.WORLD, cfg.tp_size)
        )
        model_config = ModelConfig.from_server_args(server_args)
        self.model = HFModelAdapter.from_pretrained(cfg.model_dir)

        def unsupported(*args, **kwargs):
            raise NotImplementedError("not part of this engine")

        weight_updater = WeightUpdater(
            tp_rank=cfg.tp_rank,
            device="cpu",
            gpu_id=0,
            model_config=model_config,
            custom_weight_loaders={},
            get_model=lambda: self.model,
            update_model_fields=unsupported,
            recapture_cuda_graph=lambda: None,
            get_model_runner=lambda: self.model_runner,
        )
        weight_exporter = WeightExporter(
            tp_rank=cfg.tp_rank,
            tp_size=cfg.tp_size,
            gpu_id=0,
            get_model_path=lambda: cfg.model_dir,
            get_model=lambda: self.model,
        )
        self.model_runner = _ModelRunner(self.model, weight_updater, weight_exporter)
        eos = getattr(self.model.config, "eos_token_id", None)
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.scheduler = EngineScheduler(
            self.model,
            send_output=lambda out: self.ctrl.send_bytes(m.encode(out)),
            context_len=model_config.context_len,
            eos_token_ids=eos_ids,
        )
        self.memory_saver = CpuMemorySaver(self.model)
        self.errors: list[str] = []  # what would have killed SGLang's scheduler process
        self.weight_manager = SchedulerWeightUpdaterManager(
            tp_worker=_build_tp_worker(self.model_runner),
            draft_worker=None,
            memory_saver_adapter=self.memory_saver,
            flush_cache=self.scheduler.flush_cache,
            is_fully_idle=self.scheduler.is_fully_idle,
            scheduler=self.scheduler,
        )
        self._deferred_flush_seq = 0
        self.flush_wrapper = SchedulerFlushWrapper(
            flush_cache=self.scheduler.flush_cache,
            is_fully_idle=lambda: self.scheduler.is_fully_idle(
                ignore_waiting=self.scheduler._engine_paused
            ),
            send_output=lambda out, _req: self.ctrl.send_bytes(
                m.encode(out, self._deferred_flush_seq)
            ),
        )
        self.running = True

    # -- dispatch -----------------------------------------------------------------------
    def handle_control(self, obj: Any, seq: int) -> Any:
        """Handle one request from the HTTP process; return the reply, or None for none."""
        from sglang.srt.managers import io_struct as io

        from .embedding import score

        wm, sched = self.weight_manager, self.scheduler
        if isinstance(obj, m.GenerateRequest):
            sched.add_request(obj)
        elif isinstance(obj, m.ScoreRequest):  # unsolicited output, as generate's
            self.ctrl.send_bytes(m.encode(score(self.model, obj)))
        elif isinstance(obj, io.AbortReq):
            sched.abort_request(obj.rid or "", obj.abort_all)
        elif isinstance(obj, io.PauseGenerationReqInput):
            sched.pause_generation(obj.mode)
        elif isinstance(obj, io.ContinueGenerationReqInput):
            sched.continue_generation()
        elif isinstance(obj, io.InitWeightsUpdateGroupReqInput):
            return wm.init_weights_update_group(obj)
        elif isinstance(obj, io.DestroyWeightsUpdateGroupReqInput):
            return wm.destroy_weights_update_group(obj)
        elif isinstance(obj, io.BeginWeightUpdateReqInput):
            return wm.begin_weight_update(obj)
        elif isinstance(obj, io.EndWeightUpdateReqInput):
            return wm.end_weight_update(obj)
        elif isinstance(obj, io.UpdateWeightsFromDistributedReqInput):
            return wm.update_weights_from_distributed(obj)
        elif isinstance(obj, io.GetWeightsByNameReqInput):
            return wm.get_weights_by_name(obj)
        elif isinstance(obj, io.UpdateWeightsFromTensorReqInput):
            return wm.update_weights_from_tensor(obj)
        elif isinstance(obj, io.ReleaseMemoryOccupationReqInput):
            return wm.release_memory_occupation(obj)
        elif isinstance(obj, io.ResumeMemoryOccupationReqInput):
            return wm.resume_memory_occupation(obj)
        elif isinstance(obj, io.LoadLoRAAdapterReqInput):
            return self.model.lora.load(obj)
        elif isinstance(obj, io.UnloadLoRAAdapterReqInput):
            return self.model.lora.unload(obj)
        elif isinstance(obj, io.UpdateWeightVersionReqInput):
            sched.record_weight_version_change(new_version=obj.new_version)
            return io.UpdateWeightVersionReqOutput()
        elif isinstance(obj, io.FlushCacheReqInput):
            reply = self.flush_wrapper.handle(obj)
            if reply is None:  # deferred until idle or timeout; answered by check_pending
                self._deferred_flush_seq = seq
            return reply
        else:
            raise TypeError(f"unsupported request {type(obj).__name__}")
        return None

    def handle_inspect(self, obj: Any) -> Any:
        from sglang.srt.runtime_context import get_serving

        if isinstance(obj, m.Shutdown):
            self.running = False
            return None
        if isinstance(obj, m.RankWeightsRequest):
            tensors = [
                m.TensorBytes(
                    name, str(t.dtype).removeprefix("torch."), list(t.shape), _tensor_bytes(t)
                )
                for name, t in self.model.named_weights().items()
            ]
            return m.RankWeightsReply(tensors=tensors, weight_version=get_serving().weight_version)
        if isinstance(obj, m.RankMemoryRequest):
            return m.RankMemoryReply(
                offload_tags=sorted(self.weight_manager.offload_tags),
                calls=list(self.memory_saver.calls),
                errors=list(self.errors),
                weight_bytes=self.memory_saver.weights_nbytes(),
                running=len(self.scheduler.running_batch.reqs),
            )
        raise TypeError(f"unsupported inspect request {type(obj).__name__}")

    def serve(self) -> None:
        while self.running:
            timeout = 0.0 if self.scheduler.has_work() else IDLE_POLL_S
            for conn in wait([self.ctrl, self.inspect], timeout=timeout):
                try:
                    data = conn.recv_bytes()
                except EOFError:
                    self.running = False
                    break
                seq, obj = m.decode(data)
                try:
                    if conn is self.ctrl:
                        reply = self.handle_control(obj, seq)
                    else:
                        reply = self.handle_inspect(obj)
                except Exception as exc:
                    logger.exception(
                        "TP rank %d failed on %s", self.cfg.tp_rank, type(obj).__name__
                    )
                    self.errors.append(f"{type(obj).__name__}: {type(exc).__name__}: {exc}")
                    reply = _failure_reply(obj, exc) if seq else None
                if reply is not None:
                    conn.send_bytes(m.encode(reply, seq))
            if self.running:
                self.scheduler.step()
                self.flush_wrapper.check_pending()


def _cpu_device_module() -> None:
    """``torch.get_device_module()`` (no device given) names the CPU in this process."""
    import torch

    named = torch.get_device_module

    def get_device_module(device=None):
        return torch.cpu if device is None else named(device)

    torch.get_device_module = get_device_module


def _failure_reply(obj: Any, exc: Exception) -> Any:
    """SGLang's failed ``*ReqOutput`` for a request whose handler raised."""
    out_type = m.output_type(obj)
    return None if out_type is None else m.failed_output(out_type, f"{type(exc).__name__}: {exc}")


def _tensor_bytes(t) -> bytes:
    import torch

    flat = t.detach().contiguous().view(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def rank_main(cfg: RankConfig, ctrl: Connection, inspect: Connection) -> None:
    """Process entry (spawn target)."""
    logging.basicConfig(
        level=os.environ.get("SGLANG_ENGINE_LOG_LEVEL", "WARNING"),
        format=f"[tp{cfg.tp_rank}] %(levelname)s %(name)s: %(message)s",
    )
    _cpu_device_module()
    rank = RankProcess(cfg, ctrl, inspect)
    inspect.send_bytes(m.encode(m.Ready()))
    rank.serve()
    # Leave without torch's exit-time teardown: a gloo group whose peers are gone can block it.
    logging.shutdown()
    os._exit(0)
