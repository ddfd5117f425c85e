"""A run folder belongs to its run: what ``fleetrl train`` may do with a folder that holds one.

``trainer.output_dir`` with ``trainer.resume=auto`` continues the run already there. That is
right for the same run and wrong for another one: a changed config would train the other
run's policy on new data or settings and rewrite its ``config.yaml``. So, before Ray starts:

- the folder's ``config.yaml`` is compared with the new config, key by key; a key that
  changes what is trained (model, data, rollout, reward, buffer, learner, weight sync, seed)
  and differs refuses the run, naming the keys (``folder_findings``). Keys that do not
  change the run do not count: how long it runs (``trainer.total_steps``, raised to go on),
  where and how it logs, validates, profiles and saves, and which Ray it runs on
  (``UNCOUNTED``). ``fleetrl train --resume-with-changes`` continues with the changed keys
  on purpose;
- ``trainer.resume=disable`` into a folder with checkpoints refuses too: starting afresh
  there would write new checkpoints over that run's;
- a run already at its last step says so and exits 0 without starting Ray
  (``finished_line``);
- ``config.yaml`` is never replaced silently: a different earlier one is kept beside it
  as ``config.<time>.yaml`` (``write_config``).

A folder holds a run once it has a checkpoint or a ``metrics.jsonl`` with a line: a folder
where a run wrote its config and failed before its first step is taken over as it is.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import yaml

from fleetrl.config import to_dict
from fleetrl.log import get_logger
from launcher.config import RunConfig
from launcher.preflight_findings import Finding, shown

log = get_logger(__name__)

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
# keys (or sections, ending in ".") that do not change what a run trains
UNCOUNTED = (
    "logging.",
    "ray.",
    "trainer.total_steps",
    "trainer.total_epochs",
    "trainer.output_dir",
    "trainer.test_freq",
    "trainer.val_before_train",
    "trainer.save_freq",
    "trainer.keep_checkpoints",
    "trainer.save_hf_freq",
    "trainer.log_val_generations",
    "trainer.profile_steps",
    "trainer.max_bad_steps",
    "trainer.resume",
    "trainer.resume_from_path",
    "data.val_files",
    "data.val_max_samples",
    "reward.max_failed_groups",
)
SHOWN_KEYS = 6  # differing keys named in the refusal; the rest counted


@dataclass(frozen=True)
class RunFolder:
    """What ``trainer.output_dir`` holds: the earlier config and how far its run got."""

    path: Path
    config: dict[str, Any] | None  # its config.yaml, None when there is none (or unreadable)
    step: int | None  # the newest complete checkpoint's step
    has_run: bool  # a checkpoint or a metrics line: a run trained here


def read_folder(cfg: RunConfig) -> RunFolder:
    """Look at ``trainer.output_dir`` (nothing is written)."""
    path = Path(cfg.trainer.output_dir)
    config = None
    try:
        loaded = yaml.safe_load((path / CONFIG_FILE).read_text())
        config = loaded if isinstance(loaded, dict) else None
    except (OSError, yaml.YAMLError):
        pass
    step = _newest_checkpoint_step(path / "checkpoints")
    metrics = path / METRICS_FILE
    has_run = step is not None or (metrics.is_file() and metrics.stat().st_size > 0)
    return RunFolder(path, config, step, has_run)


def _newest_checkpoint_step(root: Path) -> int | None:
    if not root.is_dir():
        return None
    from learner.checkpoint import latest_complete_checkpoint

    newest = latest_complete_checkpoint(root)
    return int(newest.name.removeprefix("step_")) if newest is not None else None


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _plain(cfg: RunConfig) -> dict[str, Any]:
    """``cfg`` as its config.yaml reads back (tuples as lists)."""
    return json.loads(msgspec.json.encode(cfg))


def _counts(key: str) -> bool:
    return not any(key.startswith(u) if u.endswith(".") else key == u for u in UNCOUNTED)


def differing_keys(old: dict[str, Any], cfg: RunConfig) -> list[str]:
    """Keys that change the run whose value in ``old`` differs from ``cfg``'s. A key the old
    config lacks (written by an earlier fleetrl) counts only when set away from its default."""
    new, default = _flat(_plain(cfg)), _flat(_plain(RunConfig()))
    before = _flat(old)
    out = []
    for key, value in new.items():
        if not _counts(key):
            continue
        was = before.get(key, default.get(key))
        if was != value:
            out.append(key)
    return sorted(out)


def _described(keys: list[str], old: dict[str, Any], cfg: RunConfig) -> str:
    before, new = _flat(old), _flat(_plain(cfg))
    shown_keys = [f"{k} ({before.get(k)!r:.40} -> {new.get(k)!r:.40})" for k in keys[:SHOWN_KEYS]]
    more = f" and {len(keys) - SHOWN_KEYS} more" if len(keys) > SHOWN_KEYS else ""
    return ", ".join(shown_keys) + more


def folder_findings(cfg: RunConfig, folder: RunFolder, resume_with_changes: bool) -> list[Finding]:
    """Refusals: another run's folder (keys that differ), or a fresh start over checkpoints."""
    if not folder.has_run:
        return []
    where = shown(folder.path)
    if cfg.trainer.resume == "disable" and folder.step is not None and not cfg.trainer.resume_from_path:  # fmt: skip
        return [Finding(key="trainer.resume", problem=f"disable, and {where} holds the checkpoints of a run (up to step {folder.step}): starting afresh there would write over them", fix="choose another trainer.output_dir, or trainer.resume=auto to continue that run")]  # fmt: skip
    if folder.config is None or resume_with_changes:
        return []
    keys = differing_keys(folder.config, cfg)
    if not keys:
        return []
    return [Finding(key="trainer.output_dir", problem=f"{where} holds another run: its {CONFIG_FILE} differs in {_described(keys, folder.config, cfg)}", fix=f"choose another trainer.output_dir for this run, or rerun with --resume-with-changes to continue that run with these keys changed (its {CONFIG_FILE} is kept beside the new one)")]  # fmt: skip


def target_steps(cfg: RunConfig, folder: RunFolder) -> int:
    """The step the run ends at: ``trainer.total_steps``, or with ``trainer.total_epochs`` the
    steps the earlier run resolved from the same data (its config.yaml)."""
    old_trainer = (folder.config or {}).get("trainer") or {}
    epochs = cfg.trainer.total_epochs
    if epochs > 0 and old_trainer.get("total_epochs") == epochs:
        return int(old_trainer.get("total_steps", cfg.trainer.total_steps))
    return cfg.trainer.total_steps


def finished_line(cfg: RunConfig, folder: RunFolder) -> str | None:
    """ "already at step N of N" when the folder's run (this config's) has nothing left to do."""
    if folder.step is None or cfg.trainer.resume != "auto" or cfg.trainer.resume_from_path:
        return None
    if folder.config is None or differing_keys(folder.config, cfg):
        return None  # another run's folder: preflight refuses it
    if cfg.trainer.total_epochs > 0 and folder.config.get("trainer", {}).get("total_epochs") != cfg.trainer.total_epochs:  # fmt: skip
        return None  # the steps follow from the data: prepare resolves them
    last = target_steps(cfg, folder)
    if folder.step < last:
        return None
    return (
        f"{shown(folder.path)} is already at step {folder.step} of {last}: nothing to train "
        "(raise trainer.total_steps to go on, or choose another trainer.output_dir)"
    )


def write_config(run_dir: Path, cfg: RunConfig) -> Path:
    """Write ``config.yaml``; a different earlier one is kept beside it, never lost."""
    path = run_dir / CONFIG_FILE
    text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    if path.is_file() and path.read_text() != text:
        kept = path.with_name(f"config.{time.strftime('%Y%m%d-%H%M%S')}.yaml")
        path.replace(kept)
        log.info("the earlier %s of %s is kept as %s", CONFIG_FILE, run_dir, kept.name)
    path.write_text(text)
    return path


def check_run_folder(cfg: RunConfig, resume_with_changes: bool = False) -> list[Finding]:
    """Preflight's view of ``trainer.output_dir``: the refusals of ``folder_findings``."""
    return folder_findings(cfg, read_folder(cfg), resume_with_changes)
