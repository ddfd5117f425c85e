"""`fleetrl config show` and `fleetrl config docs`: the resolved config and its reference."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from fleetrl.config import field_docs, to_dict
from launcher.config import RunConfig, load_run_config


def show(args: argparse.Namespace) -> int:
    """The resolved config as YAML; ``trainer.total_epochs`` counted into steps when the data
    is here to count (else a comment says the run counts them when it starts)."""
    from launcher.prepare import resolve_total_steps

    config = load_run_config(args.config, args.overrides)
    note = ""
    if config.trainer.total_epochs > 0:
        try:
            config = resolve_total_steps(config)
        except (OSError, ValueError) as err:  # data or tokenizer not on this machine
            note = (
                "# trainer.total_steps is counted from data.train_files when the run starts "
                f"(trainer.total_epochs={config.trainer.total_epochs}); not here: {err}\n"
            )
    sys.stdout.write(yaml.safe_dump(to_dict(config), sort_keys=False) + note)
    return 0


def _tables(struct: type, only: set[str] | None = None) -> list[str]:
    """One Markdown table per top-level section of ``struct`` (``only``: those sections)."""
    lines: list[str] = []
    section = None
    for key, typ, default, doc in field_docs(struct):
        top = key.split(".")[0]
        if only is not None and top not in only:
            continue
        if top != section:
            section = top
            lines += [
                "",
                f"## `{section}`",
                "",
                "| key | type | default | meaning |",
                "| --- | --- | --- | --- |",
            ]
        cell = typ.replace("|", "\\|")
        lines.append(f"| `{key}` | {cell} | `{default!r}` | {doc} |")
    return lines


def render_docs() -> str:
    from launcher.rm_config import RM_KEYS, RmRunConfig

    lines = [
        "# Configuration reference",
        "",
        "Generated from the typed config structs by `fleetrl config docs` (do not edit by hand).",
        "Every key can be set in a YAML file (`--config`) or as a dotted override on the command line,",
        "e.g. `fleetrl train --config configs/demo_cpu.yaml learner.optim.lr=1e-6 rollout.n=8`.",
        "A bad key or value exits with status 2 and one line naming the dotted path.",
        "",
    ]
    lines += _tables(RunConfig)
    lines += [
        "",
        "# Reward-model runs (`fleetrl rm train`)",
        "",
        "A reward-model config has its own `data` and `rm` sections (below) and reuses",
        "`model`, `learner`, `trainer`, `logging` and `ray` from the RL run's reference above,",
        "accepting only these of their keys (any other is refused with one line):",
        "",
        "| section | accepted keys |",
        "| --- | --- |",
    ]
    lines += [f"| `{section}` | {', '.join(f'`{k}`' for k in sorted(keys))} |" for section, keys in RM_KEYS.items()]  # fmt: skip
    lines += ["| `logging`, `ray` | all |"]
    lines += _tables(RmRunConfig, only={"data", "rm"})
    return "\n".join(lines) + "\n"


def docs(args: argparse.Namespace) -> int:
    if getattr(args, "verl", False):
        from launcher.verl.docs import render_verl_docs

        text = render_verl_docs()
    else:
        text = render_docs()
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0
