"""From a ``/classify`` (or ``/encode``) body to token lists, and from scores to SGLang's reply.

``expand_embedding`` validates what the types cannot, in SGLang 0.5.23's order and with its
messages where it has one (``EmbeddingReqInput.normalize_batch_and_arguments``,
``TokenizerManager._validate_one_request`` and its neighbours): exactly one of ``text`` /
``input_ids``; a batch's ``rid`` is a list of unique ids, one per input (SGLang asserts
"The rid should be a list."); inputs are non-empty, inside the vocabulary and shorter
than the context; ``lora_path``, ``dimensions``, ``decision_layout`` refused as SGLang
refuses them here. Text is tokenized with the model's tokenizer as SGLang does
(``tokenizer(texts)``: the tokenizer's own special tokens, no chat template).

``embedding_reply`` builds one item of SGLang's reply (``_handle_batch_output`` for a
``BatchEmbeddingOutput``, then ``_stream_one_response``'s ``response_sent_to_client_ts``).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from rollout_fleet.engine.requests import RequestError
from rollout_fleet.protocol import EmbeddingRequest

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass(frozen=True)
class EmbeddingItems:
    """The inputs of one request, their ids, and whether the reply is a list."""

    prompts: list[list[int]]
    rids: list[str]
    batched: bool
    received_at: float


def _inputs(req: EmbeddingRequest, tokenizer: Any) -> tuple[list[list[int]], bool]:
    if req.text is None and req.input_ids is None:
        raise RequestError(
            "At least one of text, input_ids, image, video, or audio should be provided"
        )
    if req.text is not None and req.input_ids is not None:
        raise RequestError("text and input_ids cannot be provided at the same time")
    if req.text is not None:
        batched = isinstance(req.text, list)
        texts = req.text if batched else [req.text]
        return [list(ids) for ids in tokenizer(texts)["input_ids"]] if texts else [], batched
    ids = req.input_ids or []
    if ids and all(isinstance(x, int) for x in ids):
        return [list(ids)], False  # type: ignore[arg-type]
    if all(isinstance(x, list) for x in ids):
        return [list(x) for x in ids], True  # type: ignore[union-attr]
    raise RequestError("input_ids must be a list of ints or a list of lists of ints, not a mix")


def _rids(req: EmbeddingRequest, count: int, batched: bool) -> list[str]:
    if not batched:
        if isinstance(req.rid, list):
            raise RequestError("rid must be a string for a single input")
        return [req.rid or uuid.uuid4().hex]
    if req.rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if not isinstance(req.rid, list):
        raise RequestError("The rid should be a list.")
    if len(req.rid) != count:
        raise RequestError(f"rid has {len(req.rid)} entries for a batch of {count} inputs")
    if len(set(req.rid)) != len(req.rid):
        duplicates = sorted({r for r in req.rid if req.rid.count(r) > 1})
        raise RequestError(f"Duplicate request IDs detected within the request: {duplicates}")
    return list(req.rid)


def _check_options(req: EmbeddingRequest, model_path: str) -> None:
    if req.decision_layout is not None:
        raise RequestError("decision_layout is set only by /v1/systemone")
    if req.priority is not None and not INT64_MIN <= req.priority <= INT64_MAX:
        raise RequestError(
            f"priority must be a signed 64-bit integer between {INT64_MIN} and {INT64_MAX}"
        )
    if req.lora_path:
        first = (
            req.lora_path
            if isinstance(req.lora_path, str)
            else next((a for a in req.lora_path if a), None)
        )
        raise RequestError(
            f"LoRA adapter '{first}' was requested, but LoRA is not enabled. Please launch the"
            " server with --enable-lora flag and preload adapters using --lora-paths or"
            " /load_lora_adapter endpoint."
        )
    if req.dimensions is not None:
        raise RequestError(
            f"Model '{model_path}' does not support matryoshka representation, changing"
            " output dimensions will lead to poor results."
        )


def expand_embedding(
    req: EmbeddingRequest,
    tokenizer: Any,
    *,
    vocab_size: int,
    context_len: int,
    model_path: str,
) -> EmbeddingItems:
    """Validate ``req``; its token lists and ids (``RequestError`` naming what is wrong)."""
    received_at = time.perf_counter()
    prompts, batched = _inputs(req, tokenizer)
    if not prompts:
        raise RequestError("the batch is empty")
    rids = _rids(req, len(prompts), batched)
    _check_options(req, model_path)
    for i, prompt in enumerate(prompts):
        where = f"input {i}" if batched else "the input"
        if not prompt:
            raise RequestError(f"{where} is empty (no tokens to score)")
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise RequestError(
                f"{where} contains token id {bad}, outside the vocabulary [0, {vocab_size})"
            )
        if len(prompt) >= context_len:
            raise RequestError(
                f"The input ({len(prompt)} tokens) is longer than the model's context length"
                f" ({context_len} tokens)."
            )
    return EmbeddingItems(prompts=prompts, rids=rids, batched=batched, received_at=received_at)


def embedding_reply(
    rid: str, embedding: list[float], prompt_tokens: int, weight_version: str, received_at: float
) -> dict[str, Any]:
    """One item of SGLang's ``/classify`` reply (its keys and their order)."""
    return {
        "embedding": embedding,
        "meta_info": {
            "id": rid,
            "finish_reason": {"type": "length", "length": 0},
            "prompt_tokens": prompt_tokens,
            "weight_version": weight_version,
            "num_retractions": 0,
            "e2e_latency": time.perf_counter() - received_at,
            "response_sent_to_client_ts": time.time(),
        },
    }
