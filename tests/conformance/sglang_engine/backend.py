"""What stands in ``http_server._global_state.tokenizer_manager``: our engine's front end.

SGLang's route handlers call the methods below. Most are SGLang's own
``TokenizerManager`` code, bound to this object: the weight-update calls
(``init_weights_update_group``, ``begin_weight_update``, ``end_weight_update``,
``update_weights_from_distributed`` and ``update_weights_from_tensor`` with their
pause/lock handling and
``_update_weight_version_if_provided``, ``destroy_weights_update_group``,
``update_weight_version``, ``get_weights_by_name``, ``flush_cache``,
``release_memory_occupation``, ``resume_memory_occupation``),
``pause_generation`` / ``continue_generation`` (abort mode: abort everything
and wait until no request holds the model-update lock), ``abort_request``,
``config_value``, the detokenisation of logprobs, and LoRA: ``init_lora`` (the
``LoRARegistry``), ``load_lora_adapter`` / ``unload_lora_adapter`` (registry,
LRU eviction over ``--max-loaded-loras``, waiting for a request's adapter to be
released before unloading it) and ``_validate_and_resolve_lora`` (a request's
``lora_path`` -> ``lora_id``, SGLang's errors for an adapter that is not loaded). They talk to the
schedulers through SGLang's ``FanOutCommunicator`` objects over
``_dispatch_to_scheduler``, which here is :class:`SchedulerLink`.

For a reward model (``--is-embedding``) ``generate_request`` hands an
``EmbeddingReqInput`` to SGLang's own ``TokenizerManager.generate_request`` and its
helpers (``embedding.EmbeddingFrontEnd``), up to ``_handle_batch_output`` building the
reply from TP rank 0's scores.

Ours: ``generate_request`` for generation (tokenise, SGLang's ``SamplingParams`` to resolve
sampling, send to TP rank 0, build each output as ``_handle_batch_output``
does, with SGLang's ``add_weight_versions_to_meta_info``), and the link, which
sends each control request to every TP rank and hands the communicator one
combined reply per request: the rank-0 reply when every rank succeeded,
otherwise the first failing rank's (success only if all succeed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any

from sglang.srt.managers import io_struct as io
from sglang.srt.managers.tokenizer_control_mixin import TokenizerControlMixin
from sglang.srt.managers.tokenizer_manager import ServerStatus, TokenizerManager
from sglang.srt.runtime_context import get_lora
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.utils.aio_rwlock import RWLock
from sglang.srt.utils.weight_versions import add_weight_versions_to_meta_info
from sglang.utils import TypeBasedDispatcher

from . import messages as m
from .embedding import EmbeddingFrontEnd, batch_output, score_request

logger = logging.getLogger(__name__)

# Requests the scheduler answers (SGLang's scheduler returns an output for each).
_ANSWERED = (
    io.InitWeightsUpdateGroupReqInput,
    io.DestroyWeightsUpdateGroupReqInput,
    io.BeginWeightUpdateReqInput,
    io.EndWeightUpdateReqInput,
    io.UpdateWeightsFromDistributedReqInput,
    io.GetWeightsByNameReqInput,
    io.UpdateWeightVersionReqInput,
    io.FlushCacheReqInput,
    io.LoadLoRAAdapterReqInput,
    io.UnloadLoRAAdapterReqInput,
    io.UpdateWeightsFromTensorReqInput,
    io.ReleaseMemoryOccupationReqInput,
    io.ResumeMemoryOccupationReqInput,
)


def combine_replies(replies: list[Any]) -> Any:
    """One reply for the communicator: rank 0's if all ranks succeeded, else the first failure."""
    for reply in replies:
        if getattr(reply, "success", True) is False:
            return reply
    return replies[0]


class SchedulerLink:
    """The HTTP process's end of the pipes to the TP-rank processes."""

    def __init__(self, conns: list[Connection]):
        self.conns = conns
        self._seq = itertools.count(1)
        self._pending: dict[int, tuple[type, dict[int, Any]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.on_reply = None
        self.on_output = None
        self.on_scores = None
        self.on_rank_lost = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        for rank, conn in enumerate(self.conns):
            threading.Thread(
                target=self._read, args=(rank, conn), name=f"tp{rank}-reader", daemon=True
            ).start()

    def _read(self, rank: int, conn: Connection) -> None:
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                self._loop.call_soon_threadsafe(self._lost, rank)
                return
            self._loop.call_soon_threadsafe(self._received, rank, data)

    def send(self, obj: Any) -> None:
        if isinstance(obj, m.GenerateRequest):
            self.conns[0].send_bytes(m.encode(obj))
            return
        to_score = score_request(obj)
        if to_score is not None:  # SGLang's tokenized embedding request(s): rank 0 scores
            self.conns[0].send_bytes(m.encode(to_score))
            return
        seq = 0
        if isinstance(obj, _ANSWERED):
            seq = next(self._seq)
            self._pending[seq] = (m.output_type(obj), {})
        data = m.encode(obj, seq)
        for conn in self.conns:
            conn.send_bytes(data)

    def _received(self, rank: int, data: bytes) -> None:
        seq, obj = m.decode(data)
        if isinstance(obj, m.GenerateOutput):
            self.on_output(obj)
            return
        if isinstance(obj, m.ScoreOutput):
            self.on_scores(obj)
            return
        entry = self._pending.get(seq)
        if entry is None:
            logger.warning("reply %s from tp%d matches no request", type(obj).__name__, rank)
            return
        replies = entry[1]
        replies[rank] = obj
        if len(replies) == len(self.conns):
            del self._pending[seq]
            self.on_reply(combine_replies([replies[r] for r in sorted(replies)]))

    def _lost(self, rank: int) -> None:
        logger.error("TP rank %d closed its pipe", rank)
        pending, self._pending = self._pending, {}
        for out_type, _ in pending.values():
            self.on_reply(m.failed_output(out_type, f"TP rank {rank} exited"))
        self.on_rank_lost(rank)


@dataclasses.dataclass(eq=False)
class ReqState:
    """A request in flight, as the fields SGLang's ``abort_request`` reads."""

    obj: io.GenerateReqInput
    outputs: asyncio.Queue
    abort_sent: bool = False
    lora_released: bool = False
    created: float = dataclasses.field(default_factory=time.perf_counter)


_GENERATE_DISCONNECT_POLL_S = 4.0


class EngineBackend(EmbeddingFrontEnd):
    """The tokenizer-manager interface SGLang's HTTP app uses, over our TP-rank processes
    (a reward model's embedding path is SGLang's own, see ``embedding``)."""

    # -- SGLang's own TokenizerManager code ------------------------------------------------
    abort_request = TokenizerManager.abort_request
    pause_generation = TokenizerManager.pause_generation
    continue_generation = TokenizerManager.continue_generation
    create_abort_task = TokenizerManager.create_abort_task
    record_config_updates = TokenizerManager.record_config_updates
    config_value = TokenizerManager.config_value
    detokenize_logprob_tokens = TokenizerManager.detokenize_logprob_tokens
    is_healthy = TokenizerManager.is_healthy
    is_ready = TokenizerManager.is_ready
    init_communicators = TokenizerControlMixin.init_communicators
    flush_cache = TokenizerControlMixin.flush_cache
    init_weights_update_group = TokenizerControlMixin.init_weights_update_group
    destroy_weights_update_group = TokenizerControlMixin.destroy_weights_update_group
    _weight_update_session_call = TokenizerControlMixin._weight_update_session_call
    begin_weight_update = TokenizerControlMixin.begin_weight_update
    end_weight_update = TokenizerControlMixin.end_weight_update
    update_weights_from_distributed = TokenizerControlMixin.update_weights_from_distributed
    update_weights_from_tensor = TokenizerControlMixin.update_weights_from_tensor
    release_memory_occupation = TokenizerControlMixin.release_memory_occupation
    resume_memory_occupation = TokenizerControlMixin.resume_memory_occupation
    get_weights_by_name = TokenizerControlMixin.get_weights_by_name
    update_weight_version = TokenizerControlMixin.update_weight_version
    _update_weight_version_if_provided = TokenizerControlMixin._update_weight_version_if_provided
    # LoRA: the registry, the load / unload calls, a request's lora_path -> lora_id
    init_lora = TokenizerManager.init_lora
    load_lora_adapter = TokenizerControlMixin.load_lora_adapter
    unload_lora_adapter = TokenizerControlMixin.unload_lora_adapter
    _unload_lora_adapter_locked = TokenizerControlMixin._unload_lora_adapter_locked
    _validate_and_resolve_lora = TokenizerManager._validate_and_resolve_lora
    _resolve_lora_path = TokenizerManager._resolve_lora_path
    _release_lora_once = TokenizerManager._release_lora_once

    def __init__(self, server_args, conns: list[Connection]):
        from sglang.srt.configs.model_config import ModelConfig
        from transformers import AutoTokenizer

        self.server_args = server_args
        self.model_config = ModelConfig.from_server_args(server_args)
        self.model_path = server_args.model_path
        self.served_model_name = server_args.served_model_name or server_args.model_path
        self.is_generation = self.model_config.is_generation  # False for --is-embedding
        self.tokenizer = AutoTokenizer.from_pretrained(server_args.model_path)
        self.context_len = self.model_config.context_len
        self.max_req_input_len = self.context_len - 1
        self.startup_time = time.time()
        self.initial_weights_loaded = True
        self.enable_metrics = False
        self.mm_processor = None
        self.incremental_streaming_output = False
        # state the HTTP handlers and SGLang's methods read
        self.rid_to_state: dict[str, ReqState] = {}
        self.server_status = ServerStatus.Up
        self.gracefully_exit = False
        self.last_receive_tstamp = time.time()
        self.is_pause = False
        self.is_pause_cond = asyncio.Condition()
        self.model_update_lock = RWLock()
        self.link = SchedulerLink(conns)
        self.link.on_output = self._handle_output
        self.link.on_scores = self._handle_scores
        self.link.on_rank_lost = self._rank_lost
        self._result_dispatcher = TypeBasedDispatcher([])
        self.init_communicators()
        self.link.on_reply = self._on_reply
        self.vocab_size = self.model_config.vocab_size
        self.enable_lora = get_lora().enable_lora
        self._lora_release_tasks: set[asyncio.Task] = set()
        self.init_lora()
        self.init_embedding_front_end(server_args)
        self._output_tasks: set[asyncio.Task] = set()

    # -- plumbing ---------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.link.start(loop)

    def auto_create_handle_loop(self) -> None:
        """The reader threads start with the HTTP app (see ``http_process``)."""

    def _dispatch_to_scheduler(self, obj: Any) -> None:
        self.link.send(obj)

    async def _async_dispatch_to_scheduler(self, obj: Any) -> None:
        self.link.send(obj)

    def _on_reply(self, obj: Any) -> None:
        self.last_receive_tstamp = time.time()
        self._result_dispatcher(obj)

    def _rank_lost(self, rank: int) -> None:
        self.server_status = ServerStatus.UnHealthy
        for state in list(self.rid_to_state.values()):
            state.outputs.put_nowait(RuntimeError(f"TP rank {rank} exited"))

    def _handle_scores(self, out: m.ScoreOutput) -> None:
        """Rank 0's scores, handed to SGLang's ``_handle_batch_output`` as its scheduler's
        ``BatchEmbeddingOutput`` (the handle loop awaits it the same way)."""
        self.last_receive_tstamp = time.time()
        task = asyncio.ensure_future(self._handle_batch_output(batch_output(out)))
        self._output_tasks.add(task)
        task.add_done_callback(self._output_tasks.discard)

    def _handle_output(self, out: m.GenerateOutput) -> None:
        self.last_receive_tstamp = time.time()
        state = self.rid_to_state.get(out.rid)
        if state is not None:
            state.outputs.put_nowait(out)

    # -- generate ---------------------------------------------------------------------------
    async def generate_request(self, obj: io.GenerateReqInput, request=None):
        if isinstance(obj, io.EmbeddingReqInput):  # /classify, /encode, the embedding probe
            async for out in self.generate_embedding_request(obj, request):
                yield out
            return
        obj.normalize_batch_and_arguments()
        if obj.is_single:
            async for out in self._generate_one(obj, request):
                yield out
            return
        if obj.stream:
            raise ValueError("this engine does not stream batched requests")

        async def first(sub):
            async for out in self._generate_one(sub, request):
                return out

        yield list(await asyncio.gather(*(first(obj[i]) for i in range(obj.batch_size))))

    async def _generate_one(self, obj: io.GenerateReqInput, request):
        if obj.rid is None:
            obj.rid = uuid.uuid4().hex
        state = ReqState(obj=obj, outputs=asyncio.Queue())
        self.rid_to_state[obj.rid] = state
        try:
            async with self.is_pause_cond:
                await self.is_pause_cond.wait_for(lambda: not self.is_pause)
            async with self.model_update_lock.reader_lock:
                await self._validate_and_resolve_lora(obj)
                self._dispatch_to_scheduler(self._tokenize(obj))
                while True:
                    out = await self._next_output(state, obj, request)
                    if isinstance(out, Exception):
                        raise ValueError(str(out))
                    finished = out.finished_reason is not None
                    if finished or obj.stream:
                        yield self._build_output(obj, out)
                    if finished:
                        return
        finally:
            self._release_lora_once(state)
            if self.rid_to_state.get(obj.rid) is state:
                del self.rid_to_state[obj.rid]

    async def _next_output(self, state: ReqState, obj, request):
        while True:
            try:
                return await asyncio.wait_for(
                    state.outputs.get(), timeout=_GENERATE_DISCONNECT_POLL_S
                )
            except TimeoutError:
                if request is not None and await request.is_disconnected():
                    self.abort_request(obj.rid)
                    raise ValueError(
                        f"Request is disconnected from the client side. Abort request {obj.rid=}"
                    ) from None

    def _tokenize(self, obj: io.GenerateReqInput) -> m.GenerateRequest:
        if obj.input_ids is not None:
            input_ids = list(obj.input_ids)
        elif obj.text is not None:
            input_ids = self.tokenizer.encode(obj.text)
        else:
            raise ValueError("this engine takes text or input_ids")
        if len(input_ids) >= self.context_len:
            raise ValueError(
                f"The input ({len(input_ids)} tokens) is longer than the model's context "
                f"length ({self.context_len} tokens)."
            )
        params = SamplingParams(**(obj.sampling_params or {}))
        params.normalize(self.tokenizer)
        params.verify(self.vocab_size)
        max_new = params.max_new_tokens
        if max_new is None:
            max_new = self.context_len - len(input_ids)
        return m.GenerateRequest(
            rid=obj.rid,
            input_ids=input_ids,
            max_new_tokens=max_new,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=min(params.top_k, self.vocab_size),
            stop_token_ids=sorted(params.stop_token_ids or ()),
            ignore_eos=params.ignore_eos,
            sampling_seed=params.sampling_seed,
            return_logprob=bool(obj.return_logprob),
            stream=bool(obj.stream),
            lora_id=obj.lora_id,
        )

    def _build_output(self, obj: io.GenerateReqInput, out: m.GenerateOutput) -> dict:
        """The output dict SGLang's ``_handle_batch_output`` builds (non-incremental)."""
        n_out = len(out.output_ids)
        meta_info: dict[str, Any] = {
            "id": out.rid,
            "finish_reason": out.finished_reason,
            "prompt_tokens": out.prompt_tokens,
            "weight_version": self.config_value("weight_version"),
            "num_retractions": out.num_retractions,
        }
        if obj.return_logprob:
            meta_info["input_token_logprobs"] = []
            meta_info["output_token_logprobs"] = self.detokenize_logprob_tokens(
                out.output_logprobs, out.output_ids, obj.return_text_in_logprobs
            )
            meta_info["output_token_logprobs_length"] = n_out
        meta_info.update(
            {"reasoning_tokens": 0, "completion_tokens": n_out, "cached_tokens": out.cached_tokens}
        )
        if out.weight_versions is not None:
            add_weight_versions_to_meta_info(meta_info, out.weight_versions, n_out)
        if out.finished_reason is not None:
            state = self.rid_to_state.get(out.rid)
            if state is not None:
                meta_info["e2e_latency"] = time.perf_counter() - state.created
        skip_special = (obj.sampling_params or {}).get("skip_special_tokens", True)
        text = self.tokenizer.decode(out.output_ids, skip_special_tokens=skip_special)
        return {"text": text, "output_ids": list(out.output_ids), "meta_info": meta_info}

    # -- what other handlers read -------------------------------------------------------------
    async def get_internal_state(self) -> list[dict]:
        return [{}]
