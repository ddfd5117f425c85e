"""From a ``/generate`` body to scheduler ``Sequence``s, and from a finished ``Sequence``
back to SGLang's response object.

``expand_generate`` validates everything the types cannot (one of ``text`` /
``input_ids``, batch shapes, vocabulary range, context length) and raises
``RequestError`` naming the field; it yields one ``Sequence`` per sample,
prompt-major then sample-minor (the order SGLang returns for batch x n).

Request ids: a single prompt with n = 1 keeps ``rid`` (a random hex id if none);
batch item ``i`` of a string ``rid`` gets ``f"{rid}-{i}"`` (SGLang's prefix rule);
sample ``j`` of ``n > 1`` gets ``f"{item_rid}-{j}"``. ``/abort_request`` with the
parent rid aborts all of its samples.

``response_object`` builds the SGLang response (see ``rollout_fleet.protocol``)
from the first ``n_tokens`` outputs, so streaming chunks and the final answer
share one code path.

Top logprobs: with ``return_logprob`` and ``top_logprobs_num`` k > 0 the reply's
``meta_info.output_top_logprobs`` holds, per output token, the k largest
``[logprob, token_id, text|null]`` of the distribution the token was sampled from,
highest first (SGLang's ``TokenizerManager.detokenize_top_logprobs_tokens``);
without ``return_logprob`` SGLang reports no logprobs at all, and neither does this.

Left out: prompt logprobs (``logprob_start_len >= 0``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rollout_fleet.engine.sampling import RowSampling
from rollout_fleet.engine.scheduler import Sequence
from rollout_fleet.protocol import FINISH_STOP, GenerateRequest, SamplingParams


class RequestError(ValueError):
    """A request body that is well-formed JSON but invalid; answered with HTTP 400."""


@dataclass
class ResponseOptions:
    """How one sample's response is rendered."""

    return_logprob: bool
    return_text_in_logprobs: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    no_stop_trim: bool
    index: int
    top_logprobs_num: int = 0


@dataclass
class ModelLimits:
    vocab_size: int
    max_context: int
    eos_token_ids: frozenset[int]
    device: torch.device


def _per_item(value: Any, batch: int, name: str, default: Any) -> list[Any]:
    if value is None:
        return [default] * batch
    if isinstance(value, list):
        if len(value) != batch:
            raise RequestError(f"{name} has {len(value)} entries for a batch of {batch} prompts")
        return value
    return [value] * batch


def _prompts(
    req: GenerateRequest, tokenizer: Any, limits: ModelLimits
) -> tuple[list[list[int]], bool]:
    """The prompts as token lists, and whether the input was a batch."""
    if (req.text is None) == (req.input_ids is None):
        raise RequestError("exactly one of text or input_ids must be given")
    if req.text is not None:
        texts = req.text if isinstance(req.text, list) else [req.text]
        prompts = [list(tokenizer.encode(t)) for t in texts]
        batched = isinstance(req.text, list)
    else:
        ids = req.input_ids or []
        if all(isinstance(x, int) for x in ids):
            prompts, batched = [list(ids)], False  # type: ignore[arg-type]
        elif all(isinstance(x, list) for x in ids):
            prompts, batched = ids, True  # type: ignore[assignment]
        else:
            raise RequestError(
                "input_ids must be a list of ints or a list of lists of ints, not a mix"
            )
    if not prompts:
        raise RequestError("the batch is empty")
    for i, prompt in enumerate(prompts):
        where = f"input_ids[{i}]" if batched else "input_ids"
        if not prompt:
            raise RequestError(f"{where} is empty")
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= limits.vocab_size:
            bad = low if low < 0 else high
            raise RequestError(
                f"{where} contains token id {bad}, outside the vocabulary [0, {limits.vocab_size})"
            )
    return prompts, batched


def expand_generate(
    req: GenerateRequest,
    tokenizer: Any,
    limits: ModelLimits,
    on_event: Callable[[Sequence, bool], None],
) -> tuple[list[tuple[Sequence, ResponseOptions]], bool]:
    """Validate ``req``; returns one ``(Sequence, ResponseOptions)`` per sample and
    whether the input was a batch (then the response is a list)."""
    prompts, batched = _prompts(req, tokenizer, limits)
    batch = len(prompts)
    params_list: list[SamplingParams] = _per_item(
        req.sampling_params, batch, "sampling_params", SamplingParams()
    )
    logprob_flags = _per_item(req.return_logprob, batch, "return_logprob", False)
    start_lens = _per_item(req.logprob_start_len, batch, "logprob_start_len", -1)
    top_nums = _per_item(req.top_logprobs_num, batch, "top_logprobs_num", 0)
    if isinstance(req.rid, list):
        rids = _per_item(req.rid, batch, "rid", None)
    else:
        base = req.rid or uuid.uuid4().hex
        rids = [f"{base}-{i}" for i in range(batch)] if batched else [base]
    now = time.monotonic()
    out: list[tuple[Sequence, ResponseOptions]] = []
    for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
        where = (
            f"sampling_params[{i}]" if isinstance(req.sampling_params, list) else "sampling_params"
        )
        try:
            params.check(where)
        except ValueError as err:
            raise RequestError(str(err)) from err
        if start_lens[i] not in (None, -1):
            raise RequestError(
                "logprob_start_len >= 0 (prompt logprobs) is not supported by the embedded engine"
            )
        top_num = top_nums[i] or 0
        if not 0 <= top_num <= limits.vocab_size:
            where_top = (
                f"top_logprobs_num[{i}]"
                if isinstance(req.top_logprobs_num, list)
                else "top_logprobs_num"
            )
            raise RequestError(f"{where_top} must be in [0, {limits.vocab_size}], got {top_num}")
        if not logprob_flags[i]:
            top_num = 0  # SGLang reports top logprobs only with return_logprob
        if len(prompt) + params.max_new_tokens > limits.max_context:
            raise RequestError(
                f"prompt {i} has {len(prompt)} tokens and asks for max_new_tokens={params.max_new_tokens}:"
                f" {len(prompt) + params.max_new_tokens} exceeds the model's context length {limits.max_context}"
            )
        stop_ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids |= limits.eos_token_ids
        for j in range(params.n):
            generator = None
            if params.sampling_seed is not None:
                generator = torch.Generator(device=limits.device)
                generator.manual_seed(params.sampling_seed + j)
            seq = Sequence(
                rid=rids[i] if params.n == 1 else f"{rids[i]}-{j}",
                parent_rid=rids[i],
                prompt_ids=prompt,
                max_new_tokens=params.max_new_tokens,
                sampling=RowSampling(
                    temperature=params.temperature,
                    top_p=params.top_p,
                    top_k=params.top_k,
                    min_p=params.min_p,
                    generator=generator,
                    top_logprobs=top_num,
                ),
                stop_token_ids=frozenset(stop_ids),
                stop_strings=params.stop_strings,
                on_event=on_event,
                stream=req.stream,
                submitted_at=now,
            )
            options = ResponseOptions(
                return_logprob=bool(logprob_flags[i]),
                return_text_in_logprobs=req.return_text_in_logprobs,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                no_stop_trim=params.no_stop_trim,
                index=len(out),
                top_logprobs_num=top_num,
            )
            out.append((seq, options))
    return out, batched


def _decode(tokenizer: Any, ids: list[int], skip_special_tokens: bool) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def response_object(
    seq: Sequence,
    options: ResponseOptions,
    tokenizer: Any,
    *,
    n_tokens: int,
    finish_reason: dict[str, Any] | None,
    weight_version: str,
) -> dict[str, Any]:
    """SGLang's response object for ``seq`` using its first ``n_tokens`` outputs."""
    output_ids = seq.output_ids[:n_tokens]
    text_ids = output_ids
    text = None
    if (
        finish_reason is not None
        and finish_reason.get("type") == FINISH_STOP
        and not options.no_stop_trim
    ):
        matched = finish_reason.get("matched")
        if isinstance(matched, int) and output_ids and output_ids[-1] == matched:
            text_ids = output_ids[:-1]
        elif isinstance(matched, str):
            full = _decode(tokenizer, output_ids, options.skip_special_tokens)
            cut = full.find(matched)
            text = full[:cut] if cut >= 0 else full
    if text is None:
        text = _decode(tokenizer, text_ids, options.skip_special_tokens)
    meta: dict[str, Any] = {
        "id": seq.rid,
        "finish_reason": finish_reason,
        "prompt_tokens": len(seq.prompt_ids),
        "completion_tokens": len(output_ids),
        "cached_tokens": seq.cached_tokens,
        "weight_version": weight_version,
        "e2e_latency": time.monotonic() - seq.submitted_at,
    }
    if options.return_logprob:
        texts: list[str | None]
        if options.return_text_in_logprobs:
            texts = [tokenizer.decode([t]) for t in output_ids]
        else:
            texts = [None] * len(output_ids)
        meta["output_token_logprobs"] = [
            [lp, tid, tx]
            for lp, tid, tx in zip(seq.logprobs[:n_tokens], output_ids, texts, strict=True)
        ]
        if options.top_logprobs_num:
            meta["output_top_logprobs"] = _top_logprobs(
                seq.top_logprobs[:n_tokens], tokenizer, options.return_text_in_logprobs
            )
    spans = weight_version_spans(seq.versions[:n_tokens])
    if spans:
        meta["weight_versions"] = spans
        meta["weight_version"] = spans[-1]["version"]
    return {"text": text, "output_ids": output_ids, "meta_info": meta}


def _top_logprobs(
    rows: list[tuple[list[float], list[int]]], tokenizer: Any, with_text: bool
) -> list[list[list[Any]]]:
    """SGLang's ``output_top_logprobs``: per token, ``[logprob, token_id, text|None]`` rows."""
    return [
        [
            [lp, tid, tokenizer.decode([tid]) if with_text else None]
            for lp, tid in zip(*row, strict=True)
        ]
        for row in rows
    ]


def weight_version_spans(versions: list[int]) -> list[dict[str, Any]]:
    """Per-token versions as SGLang 0.5.23 reports them: ``meta_info.weight_versions`` =
    ``[{"version": str, "start": int, "end": int}, ...]``, one span per run of equal
    versions over the output tokens (``sglang.srt.utils.weight_versions``)."""
    spans: list[dict[str, Any]] = []
    for index, version in enumerate(versions):
        if spans and spans[-1]["version"] == str(version):
            spans[-1]["end"] = index + 1
        else:
            spans.append({"version": str(version), "start": index, "end": index + 1})
    return spans
