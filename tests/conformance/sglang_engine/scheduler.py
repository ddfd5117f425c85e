"""The scheduler state of one TP rank, and TP rank 0's token-by-token generation loop.

What SGLang's ``Scheduler`` keeps that the weight-sync protocol depends on is
kept here with the same names: ``running_batch`` requests, a ``waiting_queue``,
``_engine_paused``, per-request ``output_ids`` and ``weight_version_events``.
SGLang's own code runs on this state:

- ``Scheduler.record_weight_version_change`` (bound below) is what
  ``SchedulerWeightUpdaterManager.record_weight_version_after_update`` calls:
  it moves the served version and records a ``WeightVersionEvent`` on every
  live request that already has output tokens;
- ``compute_weight_version_spans`` turns those events into the spans a
  finished request reports; ``FINISH_*`` reasons are SGLang's classes.

Ours (SGLang's batches, KV pools and radix cache have no CPU path): the
generation step (one forward of the HF model per running request, no KV
cache, greedy or sampled at the request's temperature / top-p / top-k, the
chosen token's logprob from ``log_softmax(logits / T)``), and the pause
semantics between steps, as SGLang's scheduler implements them:
``in_place`` keeps requests running and resumes them on the new weights,
``retract`` moves them to the waiting queue (``num_retractions`` + 1) to
recompute later, an abort finishes them now with the tokens so far. The flush
rule is ``Scheduler.flush_cache``'s: refused unless fully idle, where a paused
engine ignores its waiting queue.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, FINISH_MATCHED_TOKEN
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.runtime_context import get_serving
from sglang.srt.utils.weight_versions import WeightVersionEvent, compute_weight_version_spans

from .messages import GenerateOutput, GenerateRequest
from .model import HFModelAdapter

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Req:
    """One request as the scheduler tracks it (hashable by identity, as SGLang's ``Req``)."""

    spec: GenerateRequest
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    weight_version_events: list[WeightVersionEvent] = dataclasses.field(default_factory=list)
    retraction_count: int = 0
    finished_reason: dict | None = None
    generator: torch.Generator | None = None

    @property
    def rid(self) -> str:
        return self.spec.rid

    def finished(self) -> bool:
        return self.finished_reason is not None


@dataclasses.dataclass(eq=False)
class RunningBatch:
    reqs: list[Req] = dataclasses.field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.reqs


class EngineScheduler:
    """Scheduler state of one TP rank; only TP rank 0 receives generate requests."""

    # SGLang's own: moves the served weight version, records events on live requests.
    record_weight_version_change = Scheduler.record_weight_version_change

    def __init__(
        self,
        model: HFModelAdapter,
        send_output: Callable[[GenerateOutput], None],
        context_len: int,
        eos_token_ids: set[int],
    ):
        self.model = model
        self.send_output = send_output
        self.context_len = context_len
        self.eos_token_ids = eos_token_ids
        self.running_batch = RunningBatch()
        self.waiting_queue: list[Req] = []
        self.chunked_req = None
        self.hisparse_coordinator = None
        self._engine_paused = False
        self.num_flushes = 0
        self.disaggregation_mode = DisaggregationMode.NULL  # read by the memory release

    # -- what SGLang's scheduler methods read ------------------------------------------
    def collect_inflight_reqs(self) -> set[Req]:
        return set(self.running_batch.reqs)

    def is_fully_idle(self, for_health_check: bool = False, ignore_waiting: bool = False) -> bool:
        idle = self.running_batch.is_empty()
        if not ignore_waiting:
            idle &= len(self.waiting_queue) == 0
        return idle

    def flush_cache(self, empty_cache: bool = True) -> bool:
        """``Scheduler.flush_cache``'s rule; there is no KV or prefix cache to drop here."""
        if self.is_fully_idle(ignore_waiting=self._engine_paused):
            self.num_flushes += 1
            return True
        logger.warning(
            "Cache not flushed because there are pending requests. #queue-req: %d, "
            "#running-req: %d",
            len(self.waiting_queue),
            len(self.running_batch.reqs),
        )
        return False

    # -- control --------------------------------------------------------------------------
    def pause_generation(self, mode: str) -> None:
        assert mode in ("in_place", "retract")
        self._engine_paused = True
        if mode == "retract":
            retracted = [r for r in self.running_batch.reqs if not r.finished()]
            self.running_batch.reqs = []
            for req in retracted:
                req.retraction_count += 1
                self.waiting_queue.append(req)

    def continue_generation(self) -> None:
        self._engine_paused = False

    def abort_request(self, rid: str, abort_all: bool) -> None:
        """Finish matching waiting and running requests now, with the tokens so far."""
        for queue in (self.waiting_queue, self.running_batch.reqs):
            for req in list(queue):
                if abort_all or (rid and req.rid.startswith(rid)):
                    queue.remove(req)
                    req.finished_reason = FINISH_ABORT().to_json()
                    self._emit(req)

    def add_request(self, spec: GenerateRequest) -> None:
        req = Req(spec=spec)
        if spec.sampling_seed is not None:
            req.generator = torch.Generator().manual_seed(spec.sampling_seed)
        self.waiting_queue.append(req)

    # -- generation -------------------------------------------------------------------------
    def has_work(self) -> bool:
        return not self._engine_paused and bool(self.running_batch.reqs or self.waiting_queue)

    def step(self) -> None:
        """Admit the waiting requests and decode one token for each running request."""
        if self._engine_paused:
            return
        self.running_batch.reqs.extend(self.waiting_queue)
        self.waiting_queue = []
        for req in list(self.running_batch.reqs):
            self._decode_one(req)
            if req.finished():
                self.running_batch.reqs.remove(req)
            if req.finished() or req.spec.stream:
                self._emit(req)

    def _decode_one(self, req: Req) -> None:
        spec = req.spec
        logits = self.model.next_token_logits(spec.input_ids + req.output_ids, spec.lora_id)
        logprobs = torch.log_softmax(logits / spec.temperature, dim=-1)
        if spec.top_k == 1:
            token = int(torch.argmax(logprobs))
        else:
            token = _sample(logprobs, spec.top_p, spec.top_k, req.generator)
        req.output_ids.append(token)
        req.output_logprobs.append(float(logprobs[token]))
        if not spec.ignore_eos and (token in self.eos_token_ids or token in spec.stop_token_ids):
            req.finished_reason = FINISH_MATCHED_TOKEN(matched=token).to_json()
        elif len(req.output_ids) >= spec.max_new_tokens or (
            len(spec.input_ids) + len(req.output_ids) >= self.context_len
        ):
            req.finished_reason = FINISH_LENGTH(length=len(req.output_ids)).to_json()

    def _emit(self, req: Req) -> None:
        spans = None
        if req.finished():
            spans = compute_weight_version_spans(
                req.weight_version_events,
                current_version=get_serving().weight_version,
                num_output_tokens=len(req.output_ids),
            )
        self.send_output(
            GenerateOutput(
                rid=req.rid,
                output_ids=list(req.output_ids),
                output_logprobs=list(req.output_logprobs),
                finished_reason=req.finished_reason,
                prompt_tokens=len(req.spec.input_ids),
                num_retractions=req.retraction_count,
                weight_versions=spans,
            )
        )


def _sample(
    logprobs: torch.Tensor, top_p: float, top_k: int, generator: torch.Generator | None
) -> int:
    probs = logprobs.exp()
    sorted_probs, order = torch.sort(probs, descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if top_k < sorted_probs.numel():
        keep[top_k:] = False
    if top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        keep &= (torch.cumsum(sorted_probs, 0) - sorted_probs) < top_p
    sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
    return int(order[choice])
