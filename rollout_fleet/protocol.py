"""The engine HTTP protocol: SGLang's native API field names, as typed msgspec Structs.

Field names and defaults mirror SGLang's ``python/sglang/srt/managers/io_struct.py``
(``GenerateReqInput``, ``SamplingParams``, ``PauseGenerationReqInput``, ``AbortReq``,
``InitWeightsUpdateGroupReqInput``, ``UpdateWeightsFromDistributedReqInput``,
``DestroyWeightsUpdateGroupReqInput``, ``UpdateWeightVersionReqInput``) and its
native-API docs, so the embedded engine and a real SGLang server are
interchangeable behind ``rollout_fleet.client.EngineClient``.

The embedded engine decodes request bodies into these Structs: a wrong type or
an unknown field is a 400 whose message names the field (``$.sampling_params.top_p``).
SGLang request fields the embedded engine does not implement are either absent
(unknown field -> 400) or accepted only at their neutral value (e.g.
``frequency_penalty`` must be 0); the message says so.

Generate response (one object per sample; a list for batched input or n > 1)::

    {"text": str, "output_ids": [int],
     "meta_info": {"id": str, "finish_reason": {"type": "stop"|"length"|"abort", ...},
                   "prompt_tokens": int, "completion_tokens": int, "cached_tokens": int,
                   "weight_version": str, "e2e_latency": float,
                   "output_token_logprobs": [[logprob, token_id, text|null], ...],  # if return_logprob
                   "output_top_logprobs": [[[logprob, token_id, text|null], ...], ...],  # and top_logprobs_num
                   "weight_versions": [{"version": str, "start": int, "end": int}, ...]}}

``finish_reason``: ``{"type": "stop", "matched": <token id int | stop string>}``,
``{"type": "length", "length": max_new_tokens}`` or ``{"type": "abort", "message": str}``.

``weight_versions`` (SGLang 0.5.23): the versions of the weights that produced
the output tokens, as spans over the output positions; an in-place weight update
can land mid-sequence. ``weight_version`` is the last span's.

A whole checkpoint from a folder both sides can read: ``/update_weights_from_disk``
``{model_path, weight_version, abort_all_requests, ...}`` answers
``{success, message, num_paused_requests}`` (400 when it fails; the served weights
are then unchanged). It needs no update session.

Weight updates (SGLang 0.5.23): every ``/update_weights_from_distributed`` runs
between ``/begin_weight_update`` and ``/end_weight_update`` (400 outside, with
SGLang's message); ``GET /model_info`` holds ``weight_version``;
``/get_weights_by_name`` ``{name, truncate_size}`` returns the leading rows.
There are no fleetrl-only routes: a real SGLang server has every route used.

LoRA (SGLang 0.5.23): ``/load_lora_adapter`` ``{lora_name, lora_path, pinned}``
loads a PEFT folder by path, ``/unload_lora_adapter`` ``{lora_name}`` unloads
it; both answer ``{success, error_message, loaded_adapters}``. A ``/generate``
request names its adapter in ``lora_path``.

Reward models (SGLang 0.5.23 serves them as embedding models): ``POST|PUT /classify``
and ``/encode`` take ``EmbeddingReqInput`` (``EmbeddingRequest`` here: every field of the
installed io_struct, ``text`` xor ``input_ids``, a list for a batch; no chat template is
applied) and answer one object per input, a list for a batch::

    {"embedding": [score, ...],  # the head at the last token, one value per label
     "meta_info": {"id": str, "finish_reason": {"type": "length", "length": 0},
                   "prompt_tokens": int, "weight_version": str, "num_retractions": 0,
                   "e2e_latency": float, "response_sent_to_client_ts": float}}

A non-finite score travels as ``null`` (SGLang's orjson, like msgspec, writes NaN and
inf so). ``/v1/classify`` (OpenAI style) applies a softmax: a one-label model always
reads 1.0 there, so scoring uses ``/classify``.
Co-located engines (SGLang 0.5.23): ``/release_memory_occupation`` and
``/resume_memory_occupation`` ``{tags}`` (``weights``, ``kv_cache``, ``cuda_graph``;
null = all) answer 200 with a null body; ``/update_weights_from_tensor``
``{serialized_named_tensors, load_format, flush_cache, abort_all_requests,
weight_version, ...}`` carries tensors by handle (``weight_sync.ipc_payload``) and
answers ``{success, message}``, refused outside the update session like every update.

Left out: multimodal inputs, sessions, input (prompt) logprobs.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default group_name

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"

# Default SGLang weight version is "default"; fleetrl policy versions are integers and
# version 0 is the initial weights (DESIGN section 2).
INITIAL_WEIGHT_VERSION = "0"


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``sampling_params`` of ``/generate`` (SGLang ``SamplingParams`` names and defaults)."""

    max_new_tokens: Annotated[int, Meta(ge=0)] = 128
    temperature: Annotated[float, Meta(ge=0)] = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    top_k: int = -1
    min_p: Annotated[float, Meta(ge=0, le=1)] = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: Annotated[int, Meta(ge=1, le=1024)] = 1
    sampling_seed: int | None = None
    # Accepted only at their neutral values (not implemented by the embedded engine).
    min_new_tokens: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def check(self, where: str) -> None:
        """Value checks msgspec's types cannot express; raises ``ValueError`` naming the field."""
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"{where}.top_k must be -1 (off) or >= 1, got {self.top_k}")
        neutral = {
            "min_new_tokens": (self.min_new_tokens, 0),
            "frequency_penalty": (self.frequency_penalty, 0.0),
            "presence_penalty": (self.presence_penalty, 0.0),
            "repetition_penalty": (self.repetition_penalty, 1.0),
            "json_schema": (self.json_schema, None),
            "regex": (self.regex, None),
            "ebnf": (self.ebnf, None),
        }
        for name, (value, default) in neutral.items():
            if value != default:
                raise ValueError(
                    f"{where}.{name}={value!r} is not supported by the embedded engine"
                    f" (only {default!r})"
                )

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Body of ``POST /generate`` (SGLang ``GenerateReqInput``, the fields fleetrl uses)."""

    text: str | list[str] | None = None
    # list[int] for one prompt, list[list[int]] for a batch (checked in ``prompts``).
    input_ids: list[int | list[int]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True
    # The LoRA adapter by its loaded name (SGLang: one name, or one per prompt).
    lora_path: str | list[str | None] | None = None
    # SGLang fields accepted when null (multimodal and sessions are not supported).
    image_data: None = None
    custom_logit_processor: None = None
    session_params: None = None


class PauseGenerationRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class AbortRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    rid: str = ""
    abort_all: bool = False


class InitWeightsUpdateGroupRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    master_address: str
    master_port: Annotated[int, Meta(ge=1, le=65535)]
    rank_offset: Annotated[int, Meta(ge=1)]
    world_size: Annotated[int, Meta(ge=2)]
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "nccl"


class UpdateWeightsFromDistributedRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP_NAME
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: Literal["flattened_bucket"] | None = None
    torch_empty_cache: bool = False

    def check(self) -> None:
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ValueError(
                f"names, dtypes and shapes must have equal lengths, got"
                f" {len(self.names)}, {len(self.dtypes)}, {len(self.shapes)}"
            )


class DestroyWeightsUpdateGroupRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    group_name: str = DEFAULT_GROUP_NAME


class UpdateWeightVersionRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    new_version: str
    abort_all_requests: bool = False


def finish_reason_json(
    kind: str, *, matched: int | str | None = None, length: int = 0, message: str = ""
) -> dict[str, Any]:
    """SGLang's ``finish_reason`` JSON for a finished sample."""
    if kind == FINISH_STOP:
        return {"type": FINISH_STOP, "matched": matched}
    if kind == FINISH_LENGTH:
        return {"type": FINISH_LENGTH, "length": length}
    return {"type": FINISH_ABORT, "message": message}


def policy_version_of(weight_version: str) -> int:
    """The integer policy version a ``weight_version`` string denotes (-1 if not an integer)."""
    try:
        return int(weight_version)
    except (TypeError, ValueError):
        return -1


class LoadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Body of ``POST /load_lora_adapter`` (SGLang ``LoadLoRAAdapterReqInput``)."""

    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


class UnloadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Body of ``POST /unload_lora_adapter`` (SGLang ``UnloadLoRAAdapterReqInput``)."""

    lora_name: str
    lora_id: str | None = None


class GetWeightsByNameRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``/get_weights_by_name`` (SGLang ``GetWeightsByNameReqInput``)."""

    name: str
    truncate_size: Annotated[int, Meta(ge=1)] = 100


class WeightUpdateSessionRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``/begin_weight_update`` and ``/end_weight_update`` bodies (SGLang's take a ``selector``)."""

    selector: Literal["target", "draft", "all"] = "all"


# load_format values the embedded engine reads from disk (SGLang's loader has more)
DISK_LOAD_FORMATS = (None, "auto", "safetensors")


class UpdateWeightsFromDiskRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Body of ``POST /update_weights_from_disk`` (SGLang ``UpdateWeightFromDiskReqInput``).

    The embedded engine reads the folder's ``*.safetensors`` (``load_format`` None,
    "auto" or "safetensors"); ``flush_cache``, ``keep_pause``, ``token_step``,
    ``torch_empty_cache`` and ``recapture_cuda_graph`` are accepted for SGLang's
    clients and have nothing to act on here (the prefix cache is always cleared, a
    paused engine stays paused, there is no CUDA graph); ``is_async`` and ``manifest``
    (SGLang's streamed loads) only at their defaults.
    """

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: dict[str, Any] | None = None

    def check(self) -> None:
        if not self.model_path:
            raise ValueError("model_path is empty")
        if self.load_format not in DISK_LOAD_FORMATS:
            raise ValueError(
                f"load_format {self.load_format!r} is not read by the embedded engine"
                f" (one of {list(DISK_LOAD_FORMATS)})"
            )
        if self.is_async or self.manifest is not None:
            raise ValueError("is_async and manifest (streamed loads) are not supported")


class EmbeddingRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Body of ``POST|PUT /classify`` and ``/encode`` (SGLang ``EmbeddingReqInput``).

    Every field of the installed io_struct (a test compares the names and defaults), so a
    field SGLang lacks is a 400 naming it. Served: ``text`` xor ``input_ids`` (one input,
    or a list for a batch), ``rid`` (a list for a batch), ``priority`` (checked, then
    ignored: no priority scheduling). Accepted and ignored as SGLang ignores them for
    scoring: ``sampling_params`` (SGLang forces ``max_new_tokens=0``), ``log_metrics``,
    ``routing_key``, ``background``, ``return_prompt_token_ids``,
    ``external_trace_header``, ``received_time``. Refused with SGLang's own message when
    set: ``lora_path`` (no adapters), ``dimensions`` (not a Matryoshka model),
    ``decision_layout``; refused unless null or false: multimodal inputs, input
    embeddings and their overrides, cross-encoder pairs, pooled hidden states, multi-item
    and multi-position pooling, and SGLang's internal ``lora_id`` and ``http_worker_ipc``.
    """

    rid: str | list[str] | None = None
    text: str | list[str] | None = None
    # list[int] for one input, list[list[int]] for a batch (checked by the engine)
    input_ids: list[int | list[int]] | None = None
    input_embeds: None = None
    image_data: None = None
    video_data: None = None
    audio_data: None = None
    embed_override_token_id: None = None
    embed_overrides: None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    log_metrics: bool = True
    modalities: None = None
    is_cross_encoder_request: Literal[False] = False
    lora_path: str | list[str | None] | None = None
    lora_id: None = None
    positional_embed_overrides: None = None
    routing_key: str | None = None
    http_worker_ipc: None = None
    background: bool = False
    priority: int | None = None
    dimensions: int | None = None
    return_pooled_hidden_states: Literal[False] = False
    return_prompt_token_ids: bool = False
    external_trace_header: dict[str, Any] | None = None
    received_time: float | None = None
    multi_item_delimiter_indices: None = None
    token_indices_to_pool: None = None
    decision_layout: list[int | list[int]] | None = None


class ProfileRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Body of ``POST /start_profile`` (SGLang ``ProfileReq``, all optional; ``/stop_profile``
    has none). The embedded engine records one torch.profiler span from start to stop and
    writes it to ``<output_dir>/<profile_prefix><engine id>.json`` (output_dir default:
    ``SGLANG_TORCH_PROFILER_DIR``, else /tmp, as SGLang); ``activities`` ["CPU"] or with
    "GPU"; the step and stage options (``start_step``, ``num_steps``, ``profile_by_stage``,
    ``profile_stages``) and the detail switches are SGLang's and have nothing to act on here.
    """

    output_dir: str | None = None
    start_step: int | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    profile_by_stage: bool = False
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_id: str | None = None
    merge_profiles: bool = False
    profile_prefix: str | None = None
    profile_stages: list[str] | None = None
    detailed_annotations: bool = False


class MemoryOccupationRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``/release_memory_occupation`` and ``/resume_memory_occupation`` (SGLang
    ``ReleaseMemoryOccupationReqInput`` / ``ResumeMemoryOccupationReqInput``): None = all tags."""

    tags: list[str] | None = None


class UpdateWeightsFromTensorRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Body of ``POST /update_weights_from_tensor`` (SGLang ``UpdateWeightsFromTensorReqInput``):
    one base64 payload per engine TP rank (``weight_sync.ipc_payload``)."""

    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False
