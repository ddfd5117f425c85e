"""Every message between the HTTP process and the TP-rank processes.

Control requests and their replies are SGLang's own ``io_struct`` types (the
structs its TokenizerManager and Scheduler exchange over ZMQ); the few messages
SGLang has no struct for (a tokenized generate request for our token loop, its
output, embedding inputs to score and their scores, the test-side weight read-out,
shutdown) are defined here. Each one
travels inside an :class:`Envelope` as msgpack, named by its type, over a
``multiprocessing`` pipe: no pickle.
"""

from __future__ import annotations

from typing import Any

import msgspec
from sglang.srt.managers import io_struct
from sglang.srt.utils.weight_versions import WeightVersionSpan


class GenerateRequest(msgspec.Struct, kw_only=True):
    """A tokenized ``/generate`` request, resolved by SGLang's ``SamplingParams``."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    sampling_seed: int | None = None
    return_logprob: bool = False
    stream: bool = False
    lora_id: str | None = None  # the adapter SGLang's LoRA registry resolved lora_path to


class GenerateOutput(msgspec.Struct, kw_only=True):
    """One step's output for a request (every token when streaming, else only the last).

    ``output_ids`` / ``output_logprobs`` hold the whole output so far; ``weight_versions``
    is set at finish (SGLang's scheduler computes the spans only for finished requests).
    """

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    finished_reason: dict[str, Any] | None
    prompt_tokens: int
    cached_tokens: int = 0
    num_retractions: int = 0
    weight_versions: list[WeightVersionSpan] | None = None


class ScoreRequest(msgspec.Struct, kw_only=True):
    """Dispatched embedding requests (``TokenizedEmbeddingReqInput``s) for TP rank 0 to score."""

    rids: list[str]
    input_ids: list[list[int]]
    max_new_tokens: list[int]


class ScoreOutput(msgspec.Struct, kw_only=True):
    """Their scores: the fields of the ``BatchEmbeddingOutput`` SGLang's scheduler sends."""

    rids: list[str]
    embeddings: list[list[float]]
    prompt_tokens: list[int]
    finished_reasons: list[dict[str, Any]]


class RankWeightsRequest(msgspec.Struct):
    """Test side: read this TP rank's current weights."""


class TensorBytes(msgspec.Struct, array_like=True):
    name: str
    dtype: str
    shape: list[int]
    data: bytes


class RankWeightsReply(msgspec.Struct):
    tensors: list[TensorBytes]
    weight_version: str


class RankMemoryRequest(msgspec.Struct):
    """Test side: the rank's memory state (SGLang's offload tags, the saver's calls)."""


class RankMemoryReply(msgspec.Struct):
    offload_tags: list[str]
    calls: list[str]  # "pause:<tag>" / "resume:<tag>", in order
    errors: list[str]  # exceptions of control requests (SGLang's scheduler would die of them)
    weight_bytes: int
    running: int  # requests in the running batch (TP rank 0 generates)


class Ready(msgspec.Struct):
    """A TP rank has loaded its model and joined the TP group."""


class Shutdown(msgspec.Struct):
    """Ask a TP-rank process to leave its loop and exit."""


_LOCAL_TYPES = {
    cls.__name__: cls
    for cls in (
        GenerateRequest,
        GenerateOutput,
        ScoreRequest,
        ScoreOutput,
        RankWeightsRequest,
        RankWeightsReply,
        RankMemoryRequest,
        RankMemoryReply,
        Ready,
        Shutdown,
    )
}


class Envelope(msgspec.Struct, array_like=True):
    """``seq`` pairs a reply with its request (0: no reply expected / unsolicited)."""

    seq: int
    type_name: str
    body: msgspec.Raw


def _type_of(name: str) -> type:
    cls = _LOCAL_TYPES.get(name) or getattr(io_struct, name, None)
    if cls is None:
        raise ValueError(f"unknown message type {name!r}")
    return cls


def output_type(request: Any) -> type | None:
    """SGLang's ``*ReqOutput`` for a ``*ReqInput`` (None if it has none)."""
    return getattr(io_struct, type(request).__name__.replace("ReqInput", "ReqOutput"), None)


def failed_output(out_type: type, message: str) -> Any:
    """A failed reply of ``out_type`` (success False, no parameter), so no caller waits forever."""
    fields = getattr(out_type, "__struct_fields__", ())
    kwargs: dict[str, Any] = {}
    if "success" in fields:
        kwargs["success"] = False
        kwargs["error_message" if "error_message" in fields else "message"] = message
    if "parameter" in fields:
        kwargs["parameter"] = None
    return out_type(**kwargs)


def encode(obj: Any, seq: int = 0) -> bytes:
    body = msgspec.msgpack.encode(obj)
    return msgspec.msgpack.encode(Envelope(seq, type(obj).__name__, msgspec.Raw(body)))


def decode(data: bytes) -> tuple[int, Any]:
    env = msgspec.msgpack.decode(data, type=Envelope)
    return env.seq, msgspec.msgpack.decode(env.body, type=_type_of(env.type_name))
