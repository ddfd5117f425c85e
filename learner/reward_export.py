"""The reward-model folder ``fleetrl rm train`` writes: what transformers loads and SGLang serves.

``<trainer.output_dir>/reward_model/``::

    config.json              the base model's config as ``<Arch>ForSequenceClassification``
                             with one label (and a pad token id, which transformers' pooling
                             needs), plus the score statistics under ``fleetrl_reward``
                             (``fleetrl.models.reward_folder``)
    model.safetensors        the backbone (``model.*``; ``transformer.*`` for GPT-2, as the
                             family's files name it) and the head ``score.weight`` [1, hidden],
                             in the base config's dtype (LoRA: adapters merged); no ``lm_head``
    score_bias.safetensors   ``score.bias`` = [0.0], alone
    tokenizer files          copied from the base model folder

Why the bias file: transformers' ``*ForSequenceClassification`` head has no bias, and
neither has the head this learner trains, but SGLang 0.5.23's
``Qwen2ForSequenceClassification`` builds ``score`` as ``nn.Linear(hidden, 1)`` WITH a
bias; a checkpoint without ``score.bias`` leaves that bias at its random init, shifting
every score SGLang serves by a constant (its ``load_weights`` skips what the files do not
hold). transformers reads ``model.safetensors`` alone (a folder without an index file),
so it loads the folder without an unexpected key; SGLang reads every ``*.safetensors`` of
a folder without an index, so it loads the zero bias and scores exactly what
transformers scores. SGLang's ``LlamaForSequenceClassification`` head has no bias, and
its loader skips a bias its model lacks. ``tests/conformance/test_reward_model_folder.py``
proves both through SGLang's own model classes and loader.

Collective: every learner rank iterates the tensor stream (the gather is collective);
rank 0 writes, atomically (``reward_model.tmp``, then renamed over the old folder).
Left out: sharded weight files (one file, as ``learner.snapshot``: an index file would
make SGLang ignore the bias file).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from fleetrl.log import get_logger
from fleetrl.models.reward_folder import STATS_KEY, RewardStats, write_reward_stats
from learner.checkpoint import TOKENIZER_FILES
from learner.snapshot import WEIGHTS_FILE, config_dtype
from weight_sync.errors import drain_stream

log = get_logger(__name__)

REWARD_MODEL_DIR = "reward_model"
SCORE_BIAS_FILE = "score_bias.safetensors"


def sequence_classification_config(base_path: str | Path) -> dict:
    """config.json of the reward model made from the base folder (a causal LM or a reward model)."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    config = AutoConfig.from_pretrained(str(base_path), local_files_only=True)
    arch = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(config.model_type)
    if arch is None:
        raise ValueError(
            f"model.path {base_path}: transformers has no sequence classifier for model_type "
            f"{config.model_type!r}"
        )
    config.architectures = [arch]
    config.num_labels = 1
    if getattr(config, "pad_token_id", None) is None:
        tokenizer = AutoTokenizer.from_pretrained(str(base_path), local_files_only=True)
        config.pad_token_id = tokenizer.pad_token_id
    out = config.to_diff_dict()
    out.pop(STATS_KEY, None)  # a base reward model's statistics are not this one's
    for key in ("token_classification_bias", "classifier_dropout"):
        out.pop(key, None)
    return out


def write_reward_model(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    base_path: str | Path,
    out_dir: str | Path,
    rank: int,
    stats: RewardStats | None,
) -> Path:
    """Write the reward-model folder ``out_dir`` from the trained model's full tensors.

    Consumed on every rank; rank 0 writes. Returns ``out_dir`` on every rank.
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from fleetrl.models.family import backbone_prefix

    base_path, final = Path(base_path), Path(out_dir)
    if rank != 0:
        drain_stream(named_tensors)
        return final
    dtype = config_dtype(base_path)
    # a sequence classifier's tensors: the backbone's and the score head's; an lm_head never
    config = AutoConfig.from_pretrained(str(base_path), local_files_only=True)
    kept = (backbone_prefix(config) + ".", "score.")
    tensors = {}
    for name, tensor in named_tensors:
        if not name.startswith(kept) or name == "score.bias":
            continue  # an lm_head never leaks in; the bias is written alone below
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensors[name] = tensor.detach().cpu().contiguous()
    if "score.weight" not in tensors or tensors["score.weight"].shape[0] != 1:
        raise ValueError("the reward model's stream holds no one-label score.weight")
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    bias = torch.zeros(1, dtype=tensors["score.weight"].dtype)
    save_file({"score.bias": bias}, str(tmp / SCORE_BIAS_FILE), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(sequence_classification_config(base_path), indent=2) + "\n")  # fmt: skip
    for name in TOKENIZER_FILES:
        if (base_path / name).is_file():
            shutil.copy2(base_path / name, tmp / name)
    if stats is not None:
        write_reward_stats(tmp, stats)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    log.info("reward model written to %s (%d tensors)", final, len(tensors))
    return final
