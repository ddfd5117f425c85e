"""The harness serving a reward model: SGLang's own embedding path from route to reply.

With ``is_embedding`` (``--is-embedding``, as fleetrl's launcher starts reward servers) the
HTTP process's ``/classify``, ``/encode`` and ``/health_generate`` routes call
``generate_request`` with an ``EmbeddingReqInput``, and everything from there is SGLang's
``TokenizerManager`` code bound to the backend (``EmbeddingFrontEnd``): normalising the
batch, default priority, request states, tokenising text, validating each input
(``_validate_one_request``: context length, Matryoshka dimensions), building the
``TokenizedEmbeddingReqInput`` objects, dispatching them (one, or a
``BatchTokenizedEmbeddingReqInput``), waiting, and building every reply item from a
``BatchEmbeddingOutput`` in ``_handle_batch_output`` (``meta_info``: id, finish_reason,
prompt_tokens, weight_version, num_retractions, e2e_latency, response_sent_to_client_ts).

Ours is only what SGLang's scheduler and model runner would do: TP rank 0 scores each
dispatched input with the Hugging Face classifier, the head applied to the hidden state at
the last token (SGLang's ``Pooler(LAST)`` in ``score_and_pool``), and finishes it with
SGLang's ``FINISH_LENGTH(max_new_tokens)`` (SGLang sets ``max_new_tokens=0`` for embedding
requests; the embedding path appends one dummy output token, so it finishes at once).
"""

from __future__ import annotations

from typing import Any

from sglang.srt.managers import io_struct as io
from sglang.srt.managers.tokenizer_manager import TokenizerManager as TM

from . import messages as m


class EmbeddingFrontEnd:
    """SGLang's TokenizerManager methods of the embedding path (mixed into the backend)."""

    generate_embedding_request = TM.generate_request
    _set_default_priority = TM._set_default_priority
    _init_req_state = TM._init_req_state
    _release_req_states_on_failure = TM._release_req_states_on_failure
    _tokenize_one_request = TM._tokenize_one_request
    _tokenize_texts = TM._tokenize_texts
    _prepare_tokenizer_input = TM._prepare_tokenizer_input
    _extract_tokenizer_results = TM._extract_tokenizer_results
    _detect_input_format = TM._detect_input_format
    _validate_one_request = TM._validate_one_request
    _validate_joint_schema_request = TM._validate_joint_schema_request
    _validate_for_matryoshka_dim = TM._validate_for_matryoshka_dim
    _create_tokenized_object = TM._create_tokenized_object
    _send_one_request = TM._send_one_request
    _send_batch_request = TM._send_batch_request
    _mark_state_dispatched = TM._mark_state_dispatched
    _wait_one_response = TM._wait_one_response
    _stream_one_response = TM._stream_one_response
    _handle_abort_finish_reason = TM._handle_abort_finish_reason
    _handle_batch_request = TM._handle_batch_request
    _should_use_batch_tokenization = TM._should_use_batch_tokenization
    _batch_has_text = TM._batch_has_text
    _batch_tokenize_and_process = TM._batch_tokenize_and_process
    _validate_batch_tokenization_constraints = TM._validate_batch_tokenization_constraints
    _collect_batch_responses = TM._collect_batch_responses
    _handle_batch_output = TM._handle_batch_output
    _get_scheduler_first_token_time = staticmethod(TM._get_scheduler_first_token_time)
    init_request_logging_and_dumping = TM.init_request_logging_and_dumping
    init_positional_embeds_transport = TM.init_positional_embeds_transport

    def init_embedding_front_end(self, server_args: Any) -> None:
        """The attributes SGLang's ``TokenizerManager.__init__`` gives the methods above."""
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.tokenizer_manager import (
            CudaVmmFeatureTransport,
            compute_num_reserved_tokens,
        )
        from sglang.srt.runtime_context import (
            get_disagg,
            get_observability,
            get_schedule,
            get_serving,
        )
        from sglang.srt.sampling.sampling_params import SamplingParams

        self.enable_priority_scheduling = get_schedule().enable_priority_scheduling
        self.default_priority_value = get_schedule().default_priority_value
        self.num_reserved_tokens = compute_num_reserved_tokens()
        self.validate_total_tokens = True
        self.enable_trace = get_observability().enable_trace
        self.crash_dump_folder = get_observability().crash_dump_folder
        self.allow_auto_truncate = get_serving().allow_auto_truncate
        self.skip_tokenizer_init = get_serving().skip_tokenizer_init
        self.preferred_sampling_params = get_serving().preferred_sampling_params
        self.disaggregation_mode = DisaggregationMode(get_disagg().disaggregation_mode)
        self.sampling_params_class = SamplingParams
        self.encoder_dispatch_ready = {}
        self.async_dynamic_batch_tokenizer = None  # SGLang's default (no dynamic batching)
        self.init_request_logging_and_dumping()
        self.init_positional_embeds_transport()
        self.cuda_vmm_feature_transport = CudaVmmFeatureTransport(server_args, None)


def score_request(obj: Any) -> m.ScoreRequest | None:
    """What TP rank 0 must score for a dispatched embedding request (None: not one)."""
    if isinstance(obj, io.TokenizedEmbeddingReqInput):
        items = [obj]
    elif isinstance(obj, io.BatchTokenizedEmbeddingReqInput):
        items = list(obj.batch)
    else:
        return None
    return m.ScoreRequest(
        rids=[item.rid for item in items],
        input_ids=[list(item.input_ids) for item in items],
        max_new_tokens=[int(item.sampling_params.max_new_tokens) for item in items],
    )


def batch_output(out: m.ScoreOutput) -> io.BatchEmbeddingOutput:
    """The ``BatchEmbeddingOutput`` SGLang's scheduler would send for the scored inputs."""
    n = len(out.rids)
    return io.BatchEmbeddingOutput(
        rids=list(out.rids),
        http_worker_ipcs=[None] * n,
        time_stats=None,
        finished_reasons=list(out.finished_reasons),
        embeddings=list(out.embeddings),
        prompt_tokens=list(out.prompt_tokens),
        cached_tokens=[0] * n,
        cached_tokens_details=[None] * n,
        placeholder_tokens_idx=None,
        placeholder_tokens_val=None,
        retraction_counts=[0] * n,
        pooled_hidden_states=None,
    )


def score(model: Any, request: m.ScoreRequest) -> m.ScoreOutput:
    """TP rank 0's scoring: the classifier head at each input's last token, SGLang's finish."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    embeddings = [model.last_token_head(ids) for ids in request.input_ids]
    return m.ScoreOutput(
        rids=list(request.rids),
        embeddings=embeddings,
        prompt_tokens=[len(ids) for ids in request.input_ids],
        finished_reasons=[FINISH_LENGTH(length=n).to_json() for n in request.max_new_tokens],
    )
