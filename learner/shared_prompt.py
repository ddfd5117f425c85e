"""Micro-batches whose sequences share prompts: each distinct prompt runs through the model once.

A GRPO group is n responses to one prompt, and the learner's forward over
prompt + response computes that prompt n times. Here the distinct prompts of a
micro-batch run once (pass 1, ``use_cache``), their keys and values are indexed
out to every sequence that has the prompt (``Cache.batch_select_indices``), and
the responses run against them (pass 2). Gradients flow through the indexed cache
into pass 1, so the loss, its gradient and every logprob are those of the
sequence-by-sequence forward, computed over G·P + n·R tokens instead of
n·(P + R) (``shared_cost``; the CPU demo's 16 prompts × 8 samples of 23 + 4
tokens: 3.5× less time for the forward and backward). SGLang's radix cache and
the embedded engine's ``PrefillCache`` do the same for generation.

Layout: the distinct prompts right-padded ``[G, P]`` with a mask; the responses
without their last token (nothing after it is predicted) right-padded ``[n, W]``,
at positions ``P_j + t``, with a ``[n, P + W]`` mask over the prompt's columns and
their own. Response token 0 is predicted by the prompt's last position, token t > 0
by response column t − 1: ``logits`` returns ``[n, 1 + W, vocab]`` in that order.

Where it applies (``learner.share_prompts``, ``prompts_shareable``): a family
whose cache-continued forward equals its whole forward, tried on a tiny twin
(``fleetrl.models.packing_probe.twin_config``) through this module's own
functions; full attention only (a sliding-window cache keeps only its window);
no sequence parallelism (it splits one packed row), no gradient checkpointing
(transformers turns the cache off when it recomputes), and not with flash attention
(varlen kernels: the twin runs on the CPU, so nothing would have tried their masking). Per micro-batch the
learner takes it where it computes less than the layout it would use otherwise; on
more than one rank always, and an empty micro-batch runs a dummy of both passes:
FSDP2 gathers parameters on every call of the model, so every rank must call it as
often.

Left out: the critic's forward (its value head reads every position; it keeps the
packed or padded layout), and planning micro-batches around groups (a group split
over ranks shares its prompt within each rank's part).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from fleetrl.log import get_logger
from learner.batching import GlobalBatch

log = get_logger(__name__)

# The probe twin's weight scale: at transformers' usual 0.02 a tiny twin's attention is nearly
# uniform, and a response shifted by one position moved its logits by 1e-4 only; at 0.2 by 0.7.
PROBE_INIT = 0.2


@dataclass
class SharedPrompts:
    """Model inputs of one micro-batch laid out with its distinct prompts once."""

    prompt_ids: torch.Tensor  # [G, P] the distinct prompts, right-padded
    prompt_mask: torch.Tensor  # [G, P]
    last: torch.Tensor  # [G] the column of each prompt's last token
    owner: torch.Tensor  # [n] the prompt row of each sequence
    response_ids: torch.Tensor  # [n, W] each response but its last token, right-padded
    response_positions: torch.Tensor  # [n, W] P_j + t
    attention_mask: torch.Tensor  # [n, P + W] pass 2: the prompt's columns, then its own


def distinct_prompts(
    batch: GlobalBatch, indices: np.ndarray
) -> tuple[list[np.ndarray], np.ndarray]:
    """The distinct prompts of ``indices`` (in order of first appearance) and each
    sequence's row among them."""
    rows: dict[bytes, int] = {}
    prompts: list[np.ndarray] = []
    owner = np.zeros(len(indices), dtype=np.int64)
    for j, i in enumerate(indices):
        prompt = batch.prompt(int(i))
        key = prompt.tobytes()
        if key not in rows:
            rows[key] = len(prompts)
            prompts.append(prompt)
        owner[j] = rows[key]
    return prompts, owner


def shared_cost(prompt_lens: np.ndarray, response_lens: np.ndarray, hidden: int) -> float:
    """The shared layout's cost in token-equivalents (as ``packing.layout_cost`` counts):
    pass 1's padded prompts, pass 2's padded responses, and both passes' score matrices."""
    longest = int(np.max(prompt_lens, initial=0))
    width = max(int(np.max(response_lens, initial=0)) - 1, 1)
    first = len(prompt_lens) * (longest + longest * longest / (6 * hidden))
    second = len(response_lens) * (width + width * (longest + width) / (6 * hidden))
    return first + second


def build_shared(
    batch: GlobalBatch,
    indices: np.ndarray,
    device: torch.device,
    distinct: tuple[list[np.ndarray], np.ndarray] | None = None,
) -> SharedPrompts:
    """The shared layout of ``indices``; pass 2 is at least one column wide (padding), so
    every micro-batch runs both passes. No sequences: a one-token prompt and one padding
    column that nothing reads. ``distinct``: ``distinct_prompts``' answer, where known."""
    prompts, owner = distinct if distinct is not None else distinct_prompts(batch, indices)
    if not prompts:
        prompts = [np.zeros(1, dtype=np.int64)]
    prompt_lens = np.array([len(p) for p in prompts], dtype=np.int64)
    prompt_ids = np.zeros((len(prompts), int(prompt_lens.max())), dtype=np.int64)
    prompt_mask = np.zeros_like(prompt_ids)
    for g, prompt in enumerate(prompts):
        prompt_ids[g, : len(prompt)] = prompt
        prompt_mask[g, : len(prompt)] = 1
    inputs = [batch.response(int(i))[:-1] for i in indices] or [np.zeros(0, dtype=np.int64)]
    owner = owner if len(indices) else np.zeros(1, dtype=np.int64)
    width = max(max(len(r) for r in inputs), 1)
    response_ids = np.zeros((len(inputs), width), dtype=np.int64)
    response_mask = np.zeros_like(response_ids)
    for j, r in enumerate(inputs):
        response_ids[j, : len(r)] = r
        response_mask[j, : len(r)] = 1
    positions = prompt_lens[owner][:, None] + np.arange(width)[None, :]
    mask = np.concatenate([prompt_mask[owner], response_mask], axis=1)

    def tensor(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)

    return SharedPrompts(
        prompt_ids=tensor(prompt_ids), prompt_mask=tensor(prompt_mask),
        last=tensor(prompt_lens - 1), owner=tensor(owner), response_ids=tensor(response_ids),
        response_positions=tensor(positions), attention_mask=tensor(mask),
    )  # fmt: skip


def cache_argument(model: nn.Module) -> str:
    """The forward's name for a cache: ``cache`` (transformers 5.2x) or ``past_key_values``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(type(base).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def logits(model: nn.Module, shared: SharedPrompts) -> torch.Tensor:
    """``[n, 1 + W, vocab]``: the logits that predict each response token, in order."""
    positions = torch.arange(shared.prompt_ids.shape[1], device=shared.prompt_ids.device)
    keep, inverse = torch.unique(shared.last, sorted=True, return_inverse=True)
    first = model(
        input_ids=shared.prompt_ids,
        attention_mask=shared.prompt_mask,
        position_ids=positions.expand_as(shared.prompt_ids),
        use_cache=True,
        logits_to_keep=keep,
    )
    rows = torch.arange(len(shared.last), device=keep.device)
    at_last = first.logits[rows, inverse][shared.owner][:, None]  # [n, 1, vocab]
    cache = first.get("cache")  # transformers 5.2x; past_key_values before
    cache = first.get("past_key_values") if cache is None else cache
    if cache is None:
        raise RuntimeError("learner.share_prompts: the model returned no cache from the prompts")
    cache.batch_select_indices(shared.owner)
    second = model(
        input_ids=shared.response_ids,
        attention_mask=shared.attention_mask,
        position_ids=shared.response_positions,
        use_cache=True,
        **{cache_argument(model): cache},
    )
    return torch.cat([at_last, second.logits], dim=1)


def _full_attention(config: Any) -> bool:
    """No layer whose cache keeps only a window (it would drop prompt keys pass 2 reads)."""
    from fleetrl.models.config_sizes import text_config

    text = text_config(config)
    types = getattr(text, "layer_types", None)
    if isinstance(types, list) and any(t != "full_attention" for t in types):
        return False
    return not (
        getattr(text, "use_sliding_window", False) and getattr(text, "sliding_window", None)
    )


def _agrees(config: Any) -> bool:
    """Whether the shared layout's logprobs equal the whole forward's on a tiny twin of
    ``config``: two prompts of different lengths, three responses (one of a single token)."""
    from transformers import AutoModelForCausalLM

    from fleetrl.models.packing_probe import TOLERANCE, TWIN_VOCAB, twin_config
    from learner.synthetic import synthetic_batch

    twin = twin_config(config)
    twin.initializer_range = PROBE_INIT
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(twin, dtype=torch.float32).eval()
    arrow = synthetic_batch(
        vocab_size=TWIN_VOCAB, groups=2, group_size=2, prompt_lens=[5, 3],
        response_lens=[4, 1, 2, 3], seed=0, first_token_id=0,
    )  # fmt: skip
    batch = GlobalBatch.from_arrow(arrow)
    indices = np.arange(batch.size)
    with torch.no_grad():
        shared = logits(model, build_shared(batch, indices, torch.device("cpu")))
        for j in indices:
            sequence = np.concatenate([batch.prompt(int(j)), batch.response(int(j))])
            whole = model(input_ids=torch.from_numpy(sequence)[None], use_cache=False).logits[0]
            p, r = len(batch.prompt(int(j))), len(batch.response(int(j)))
            if not torch.allclose(whole[p - 1 : p - 1 + r], shared[j, :r], atol=TOLERANCE, rtol=0):
                return False
    return True


_ANSWERS: dict[str, bool] = {}  # the twin's config JSON -> answer


def prompts_shareable(
    config: Any, requested: bool, *, sp_size: int, checkpointing: bool, rank: int = 0
) -> bool:
    """``learner.share_prompts`` for this model; where it cannot apply, why, said once."""
    if not requested:
        return False
    from fleetrl.models.packing_probe import twin_config
    from learner.packing import VARLEN_ATTENTION

    why = None
    if sp_size > 1:
        why = "sequence parallelism splits one packed row"
    elif getattr(config, "_attn_implementation", None) in VARLEN_ATTENTION:
        why = "flash attention: its cache-continued masking is not tried by the CPU twin"
    elif checkpointing:
        why = "gradient checkpointing turns the model's cache off"
    elif not _full_attention(config):
        why = f"{config.model_type} has sliding-window layers"
    else:
        key = twin_config(config).to_json_string(use_diff=False)
        if key not in _ANSWERS:
            try:
                _ANSWERS[key] = _agrees(config)
            except (ValueError, TypeError, RuntimeError, AttributeError, IndexError) as err:
                log.debug("shared-prompt probe of %s failed: %s", config.model_type, err)
                _ANSWERS[key] = False
        if not _ANSWERS[key]:
            why = f"{config.model_type}'s cache-continued forward differs from its whole forward"
    if why is not None and rank == 0:
        log.info("learner.share_prompts: off (%s); each sequence runs its own prompt", why)
    return why is None
