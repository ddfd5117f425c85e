"""The reward-model folder: what `fleetrl rm train` writes and what reward servers and the
scorer read.

A reward model is a Hugging Face ``AutoModelForSequenceClassification`` folder with one
label (``config.json``, safetensors weights, the tokenizer): transformers loads it, SGLang
0.5.23 serves it as a reward model (``/classify``: the score head at the last token). Beside
the architecture's own keys, ``config.json`` holds the score's statistics on held-out pairs
under ``STATS_KEY``, so the scorer can standardise scores as OpenRLHF does; OpenRLHF's own
folders keep a bare ``mean`` / ``std`` in the config, which are read too.

    write_reward_stats(folder, RewardStats(mean=0.3, std=1.2, pairs=400, accuracy=0.91))
    read_reward_stats(folder)  # RewardStats(...) or None when the folder has none
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec

STATS_KEY = "fleetrl_reward"
SEQUENCE_CLASSIFICATION_SUFFIX = "ForSequenceClassification"


class RewardStats(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """Score statistics over the chosen and rejected responses of the held-out pairs."""

    mean: float
    std: float
    pairs: int = 0  # held-out pairs the statistics come from
    accuracy: float | None = None  # held-out pairwise accuracy at export


class RewardFolderError(ValueError):
    """A folder that is not a usable one-label reward model, naming the folder and why."""


def _config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise RewardFolderError(f"reward model {folder}: no config.json")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise RewardFolderError(f"reward model {folder}: config.json is not JSON ({err})") from None
    if not isinstance(data, dict):
        raise RewardFolderError(f"reward model {folder}: config.json is not an object")
    return data


def check_reward_folder(folder: str | Path) -> dict:
    """The folder's config, or ``RewardFolderError`` unless it is a one-label classifier."""
    config = _config(folder)
    archs = config.get("architectures") or []
    if not is_sequence_classifier(folder):
        raise RewardFolderError(
            f"reward model {folder}: architectures {archs} hold no *{SEQUENCE_CLASSIFICATION_SUFFIX}"
            " (train one with `fleetrl rm train`)"
        )
    labels = config.get("num_labels", len(config.get("id2label") or {}) or 1)
    if labels != 1:
        raise RewardFolderError(f"reward model {folder}: {labels} labels, a reward model has 1")
    return config


def read_reward_stats(folder: str | Path) -> RewardStats | None:
    """The folder's score statistics (ours, else OpenRLHF's mean/std), or None."""
    config = _config(folder)
    raw = config.get(STATS_KEY)
    if raw is None and isinstance(config.get("mean"), (int, float)):
        raw = {"mean": config["mean"], "std": config.get("std", 1.0)}
    if raw is None:
        return None
    try:
        stats = msgspec.convert(raw, RewardStats)
    except msgspec.ValidationError as err:
        raise RewardFolderError(
            f"reward model {folder}: {STATS_KEY} in config.json: {err}"
        ) from None
    if not (math.isfinite(stats.mean) and math.isfinite(stats.std) and stats.std > 0):
        raise RewardFolderError(
            f"reward model {folder}: score statistics mean={stats.mean} std={stats.std} unusable"
        )
    return stats


def write_reward_stats(folder: str | Path, stats: RewardStats) -> None:
    """Store ``stats`` in the folder's config.json (the rest of the config kept as it is)."""
    path = Path(folder) / "config.json"
    config = _config(folder)
    config[STATS_KEY] = msgspec.to_builtins(stats)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def is_sequence_classifier(folder: str | Path) -> bool:
    """Whether the folder's config names a ``*ForSequenceClassification`` architecture (any
    number of labels): what the embedded engine serves on ``/classify`` instead of ``/generate``."""
    archs = _config(folder).get("architectures") or []
    return any(str(a).endswith(SEQUENCE_CLASSIFICATION_SUFFIX) for a in archs)
