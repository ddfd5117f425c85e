"""Whether a family's attention keeps packed sequences apart, tried on a tiny twin of it.

The learner packs a micro-batch's sequences into rows whose ``position_ids``
restart at 0 for every sequence, with no attention mask (``learner.packing``);
transformers turns the restarts into a block-diagonal mask only where the
family's model passes ``position_ids`` to its mask builder (Llama, Qwen2, GPT-2,
GPT-NeoX, Phi, Gemma do; OPT builds its mask without them and ALiBi families
such as BLOOM take no positions at all), and elsewhere every token of a row
would attend to the sequences before it, silently. Reading the modelling code
cannot settle that; running it can:

``packs_sequences(config)`` builds a one-layer random twin of the config (the
same class and options, every width shrunk through ``config_sizes``' names) on
the CPU in float32, runs two sequences packed in one row and the second alone,
and compares the second's logits. It answers in about 50 ms, once per family and
attention implementation in a process. The learner pads instead of packing where
it says no (``learner.worker``); ``fleetrl check`` says so in one line.

Left out: flash attention's varlen path (a GPU kernel; the twin runs sdpa), so a
family that packs only there is padded.
"""

from __future__ import annotations

import copy
from typing import Any

from fleetrl.log import get_logger
from fleetrl.models.config_sizes import HEAD_DIM, HIDDEN, INTERMEDIATE, KV_HEADS, text_config

log = get_logger(__name__)

TWIN_HEADS = 2
TWIN_HEAD_DIM = 8
TWIN_VOCAB = 64
FIRST, SECOND = 5, 7  # lengths of the two sequences the twin is run on
TOLERANCE = 1e-4  # float32 logits: the same maths differs by ~1e-6; a leak by far more


def _set(config: Any, names: tuple[str, ...], value: int) -> None:
    """Set every name of ``names`` the config holds (attribute_map aliases included)."""
    for name in names:
        if getattr(config, name, None) is not None:
            try:
                setattr(config, name, value)
            except AttributeError:  # a derived size (a property without a setter)
                continue


def twin_config(config: Any) -> Any:
    """``config`` with one layer and tiny widths (the options that shape attention kept)."""
    twin = copy.deepcopy(text_config(config))
    kv = getattr(twin, "num_key_value_heads", None)
    heads = getattr(twin, "num_attention_heads", TWIN_HEADS)
    twin.num_hidden_layers = 1
    if isinstance(getattr(twin, "layer_types", None), list):
        twin.layer_types = twin.layer_types[:1]
    twin.num_attention_heads = TWIN_HEADS
    _set(twin, KV_HEADS, 1 if kv is not None and kv < heads else TWIN_HEADS)
    _set(twin, (*HEAD_DIM, "rotary_dim"), TWIN_HEAD_DIM)
    _set(twin, HIDDEN, TWIN_HEADS * TWIN_HEAD_DIM)
    _set(twin, INTERMEDIATE, 2 * TWIN_HEADS * TWIN_HEAD_DIM)
    _set(twin, ("word_embed_proj_dim",), TWIN_HEADS * TWIN_HEAD_DIM)
    twin.vocab_size = TWIN_VOCAB
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if getattr(twin, name, None) is not None:
            setattr(twin, name, None)
    # eager stays eager; sdpa, flash (no CPU kernels) and installed ones (Ulysses) run as the
    # family's default, sdpa where it has it
    attn = getattr(config, "_attn_implementation", None)
    twin._attn_implementation = "eager" if attn == "eager" else None
    return twin


def _leaks(config: Any) -> bool:
    import torch
    from transformers import AutoModelForCausalLM

    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(twin_config(config), dtype=torch.float32).eval()
    first = torch.randint(0, TWIN_VOCAB, (1, FIRST), generator=generator)
    second = torch.randint(0, TWIN_VOCAB, (1, SECOND), generator=generator)
    positions = torch.cat([torch.arange(FIRST), torch.arange(SECOND)])[None]
    with torch.no_grad():
        packed = model(
            input_ids=torch.cat([first, second], 1), position_ids=positions, use_cache=False
        ).logits
        alone = model(
            input_ids=second, position_ids=torch.arange(SECOND)[None], use_cache=False
        ).logits
    return not torch.allclose(packed[:, FIRST:], alone, atol=TOLERANCE, rtol=0)


_ANSWERS: dict[str, bool] = {}  # the twin's config JSON -> answer


def packs_sequences(config: Any) -> bool:
    """Whether the family of ``config`` (a transformers config) keeps packed sequences apart;
    a twin that cannot be built or run answers no (the learner then pads: always correct)."""
    key = twin_config(config).to_json_string(use_diff=False)
    if key not in _ANSWERS:
        try:
            _ANSWERS[key] = not _leaks(config)
        except (ValueError, TypeError, RuntimeError, AttributeError, IndexError) as err:
            log.warning(
                "packing probe of %s could not run (%s): sequences are padded",
                config.model_type, err,
            )  # fmt: skip
            _ANSWERS[key] = False
    return _ANSWERS[key]
