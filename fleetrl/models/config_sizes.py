"""A causal LM's sizes, read through one normalisation of its config's names.

Families name the same size differently: Llama and Qwen2 ``hidden_size`` /
``num_attention_heads`` / ``num_hidden_layers`` / ``intermediate_size``, GPT-2
``n_embd`` / ``n_head`` / ``n_layer`` / ``n_inner`` (None: 4 × hidden), OPT
``ffn_dim``, Falcon ``num_kv_heads`` or ``multi_query``, T5-style ``d_model`` /
``d_ff``. ``model_sizes`` reads a ``config.json`` dict (or a transformers config
object) once and gives ``ModelSizes`` under one set of names, for the memory plan
(``learner.memory``), the preflight checks and the packing probe.

A dict whose ``model_type`` transformers knows is first made into that family's
config class, so what config.json leaves out takes the class's default (a GPT-2
config.json without ``tie_word_embeddings`` ties, as ``GPT2Config`` does) and the
class's ``attribute_map`` applies; a multimodal config gives its text decoder's
sizes. An unknown ``model_type`` is read as the dict it is.

    sizes = model_sizes(json.loads(Path("gpt2/config.json").read_text()))
    sizes.hidden, sizes.heads, sizes.layers, sizes.intermediate, sizes.tied

Left out: per-layer sizes of models whose blocks differ (the first block's are
given); mixture-of-experts widths (``learner.memory`` counts those parameters on
the model itself).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# the names each size goes by, in the order they are tried
HIDDEN = ("hidden_size", "n_embd", "d_model", "dim", "model_dim", "embed_dim")
LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
INTERMEDIATE = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "d_ff")
POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")
HEAD_DIM = ("head_dim", "kv_channels")
VOCAB = ("vocab_size", "padded_vocab_size")
# intermediate size of a family that names none (GPT-2's n_inner=None means this × hidden)
DEFAULT_MLP_RATIO = 4


class ConfigSizeError(ValueError):
    """A config without one of the sizes every causal LM has (names what is missing)."""


@dataclass(frozen=True)
class ModelSizes:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool  # the LM head shares the input embedding
    model_type: str = ""
    max_positions: int | None = None  # None: no fixed context (ALiBi, relative positions)


def as_config(config: Mapping[str, Any] | Any) -> Any:
    """A transformers config object for a config.json dict whose ``model_type`` transformers
    knows (its class's defaults and attribute_map apply); anything else is returned as is."""
    if not isinstance(config, Mapping):
        return config
    from transformers import CONFIG_MAPPING

    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        return config
    return CONFIG_MAPPING[model_type].from_dict(dict(config))


def text_config(config: Any) -> Any:
    """The decoder's config of a multimodal config (the config itself otherwise)."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def _read(config: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value is not None:
            return value
    return None


def _required(config: Any, names: tuple[str, ...], what: str, model_type: str) -> int:
    value = _read(config, names)
    if value is None:
        raise ConfigSizeError(
            f"model_type {model_type!r}: the config names no {what} (looked for {', '.join(names)})"
        )
    return int(value)


def model_sizes(config: Mapping[str, Any] | Any) -> ModelSizes:
    """``ModelSizes`` of a config.json dict or a transformers config (see the module docstring)."""
    config = text_config(as_config(config))
    model_type = str(_read(config, ("model_type",)) or "")
    hidden = _required(config, HIDDEN, "hidden size", model_type)
    heads = _required(config, HEADS, "attention head count", model_type)
    kv_heads = _read(config, KV_HEADS)
    if kv_heads is None:
        kv_heads = 1 if _read(config, ("multi_query",)) else heads
    intermediate = _read(config, INTERMEDIATE)
    tied = _read(config, ("tie_word_embeddings",))
    positions = _read(config, POSITIONS)
    return ModelSizes(
        model_type=model_type,
        vocab=_required(config, VOCAB, "vocabulary size", model_type),
        hidden=hidden,
        layers=_required(config, LAYERS, "layer count", model_type),
        heads=heads,
        kv_heads=int(kv_heads),
        head_dim=int(_read(config, HEAD_DIM) or hidden // heads),
        intermediate=int(intermediate) if intermediate else DEFAULT_MLP_RATIO * hidden,
        tied=True if tied is None else bool(tied),  # transformers' own default
        max_positions=int(positions) if positions else None,
    )
