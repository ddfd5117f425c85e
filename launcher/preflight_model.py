"""Preflight on the model's family: what cannot train or serve is refused before Ray starts.

Every decoder-only causal LM transformers ships trains (``fleetrl.models.family``:
blocks from ``_no_split_modules``, sizes through one normalisation of the
config's names, a value head on any backbone). What cannot is said here in one
line each, from the model's config.json and the model built on the meta device
(no weights read, well under a second for any size):

- ``model.path``: an encoder-decoder, a ``model_type`` transformers has no causal
  LM for (no remote code runs), a folder whose weights are a classifier, a model
  whose decoder blocks cannot be found or whose forward cannot keep only the
  response positions' logits, a checkpoint whose tensors transformers converts on
  load (stacked MoE experts) (``learner.critic.model_path`` the same);
- ``model.gradient_checkpointing`` / ``learner.grad_checkpointing`` on a model
  transformers cannot checkpoint;
- ``learner.lora.target_modules`` naming no linear layer of the family (its own
  names and peft's default are given);
- ``rollout.backend=embedded`` with sliding-window attention narrower than the
  run's longest sequence (the embedded engine attends to the whole context);
- ``learner.packing`` on a family whose attention does not keep packed sequences
  apart (``fleetrl.models.packing_probe``): a warning, the learner pads; refused
  under ``learner.sequence_parallel`` > 1, which needs packing.

A tiny model not built yet (``model.create_tiny``) is checked from its settings.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from launcher.config import RunConfig
from launcher.preflight_findings import Finding

_REFUSED = "fleetrl trains decoder-only causal LMs (Llama, Qwen2, GPT-2, GPT-NeoX, OPT, Phi, Gemma, ...)"  # fmt: skip


class _Unreadable(ValueError):
    """A config.json transformers cannot read (an unknown model_type, a broken file)."""


def _folder_config(path: str) -> Any | None:
    import json

    from transformers import AutoConfig

    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        return None
    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (ValueError, OSError, KeyError) as err:
        try:
            model_type = json.loads((folder / "config.json").read_text()).get("model_type")
        except (ValueError, AttributeError):
            raise _Unreadable(f"its config.json is not a JSON object ({err})") from None
        raise _Unreadable(
            f"transformers has no model_type {model_type!r} (fleetrl runs no remote code)"
        ) from None


def policy_config(cfg: RunConfig) -> Any | None:
    """The policy's transformers config: its folder's, or the tiny model's settings (None
    when neither exists: ``check_model`` says so)."""
    config = _folder_config(cfg.model.path)
    if config is not None or not cfg.model.create_tiny:
        return config
    from fleetrl.models.tiny import build_any_tokenizer, tiny_config

    t = cfg.model.tiny
    return tiny_config(
        t.arch, build_any_tokenizer(t.arch), layers=t.layers, hidden=t.hidden, heads=t.heads,
        kv_heads=None, intermediate=None, max_positions=t.max_positions, vocab_size=None,
        tie_embeddings=None,
    )  # fmt: skip


def _meta_model(config: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _structure_problem(config: Any) -> tuple[str | None, Any]:
    """(why ``config`` cannot be a learner model, or None; its meta model when built)."""
    from fleetrl.models.checkpoint_names import CheckpointNames
    from fleetrl.models.family import architecture_problem, decoder_blocks

    problem = architecture_problem(config)
    if problem is not None:
        return problem, None
    model = _meta_model(config)
    try:
        decoder_blocks(model)
    except ValueError as err:
        return str(err), model
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return f"{type(model).__name__}.forward takes no logits_to_keep", model
    converted = CheckpointNames(config).converted
    if converted:
        return (
            f"transformers converts its checkpoint's tensors on load ({converted[0]}, ...), "
            "and the learner reads the files' tensors one to one"
        ), model
    return None, model


def _family_problem(load: Any) -> tuple[str | None, Any, Any]:
    """(why the config ``load()`` gives cannot be a learner model or None, config, meta model);
    a folder without config.json gives (None, None, None): ``check_model`` reports it."""
    try:
        config = load()
    except _Unreadable as err:
        return str(err), None, None
    if config is None:
        return None, None, None
    problem, model = _structure_problem(config)
    return problem, config, model


def check_model_family(cfg: RunConfig) -> list[Finding]:
    """Every finding about the policy's (and the critic's) family; see the module docstring."""
    out = []
    problem, config, model = _family_problem(lambda: policy_config(cfg))
    if problem is not None:
        out.append(Finding(key="model.path", problem=f"{cfg.model.path}: {problem}", fix=_REFUSED))
    critic_path = cfg.learner.critic.model_path
    if critic_path:
        critic_problem, _, _ = _family_problem(lambda: _folder_config(critic_path))
        if critic_problem is not None:
            problem_line = f"{critic_path}: {critic_problem}"
            out.append(Finding(key="learner.critic.model_path", problem=problem_line, fix=_REFUSED))  # fmt: skip
    if model is None or problem is not None:
        return out
    return out + _training_findings(cfg, config, model) + _serving_findings(cfg, config)


def _training_findings(cfg: RunConfig, config: Any, model: Any) -> list[Finding]:
    from fleetrl.models.family import lora_target_problem
    from fleetrl.models.packing_probe import packs_sequences

    lc, out = cfg.learner, []
    checkpointing = lc.grad_checkpointing or cfg.model.gradient_checkpointing
    if checkpointing and not getattr(model, "supports_gradient_checkpointing", False):
        key = "learner.grad_checkpointing" if lc.grad_checkpointing else "model.gradient_checkpointing"  # fmt: skip
        problem = f"{type(model).__name__} does not support gradient checkpointing"
        out.append(Finding(key=key, problem=problem, fix="set it to false"))
    lora_problem = (
        lora_target_problem(model, list(lc.lora.target_modules)) if lc.lora.rank > 0 else None
    )
    if lora_problem is not None:
        fix = "name the family's own linear layers"
        out.append(Finding(key="learner.lora.target_modules", problem=lora_problem, fix=fix))
    if lc.packing and not packs_sequences(config):
        why = (
            f"{config.model_type}'s attention does not keep packed sequences apart "
            "(tried on a tiny twin of it)"
        )
        if lc.sequence_parallel > 1:
            problem, fix = f"needs packing, and {why}", "set learner.sequence_parallel=1"
            out.append(Finding(key="learner.sequence_parallel", problem=problem, fix=fix))
        else:
            fix = "the learner pads each sequence instead; learner.packing=false says so"
            out.append(Finding(key="learner.packing", problem=why, fix=fix, fatal=False))
    return out


def sliding_window(config: Any) -> int | None:
    """The narrowest attention window of a model whose layers use one (None: full attention)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    return int(window) if getattr(config, "use_sliding_window", True) else None


def _serving_findings(cfg: RunConfig, config: Any) -> list[Finding]:
    from fleetrl.models.config_sizes import text_config
    from rollout_fleet.engine_kinds import engine_kind

    if engine_kind(cfg.rollout.backend).gpu_server:  # SGLang and vLLM serve sliding windows
        return []
    window = sliding_window(text_config(config))
    longest = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    if window is None or window >= longest:
        return []
    return [
        Finding(
            key="rollout.backend",
            problem=f"the embedded engine attends to the whole context, and {config.model_type} "
            f"uses sliding-window attention of {window} tokens, narrower than the "
            f"{longest} tokens of data.max_prompt_length + rollout.max_new_tokens",
            fix=f"keep prompt + response within {window} tokens, or rollout.backend=sglang (or vllm)",
        )
    ]
