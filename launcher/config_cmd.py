"""`fleetrl config show` and `fleetrl config docs`: the resolved config and its reference."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from fleetrl.config import field_docs, to_dict
from launcher.config import RunConfig, load_run_config


def show(args: argparse.Namespace) -> int:
    config = load_run_config(args.config, args.overrides)
    sys.stdout.write(yaml.safe_dump(to_dict(config), sort_keys=False))
    return 0


def render_docs() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from the typed config structs by `fleetrl config docs` (do not edit by hand).",
        "Every key can be set in a YAML file (`--config`) or as a dotted override on the command line,",
        "e.g. `fleetrl train --config configs/demo_cpu.yaml learner.optim.lr=1e-6 rollout.n=8`.",
        "A bad key or value exits with status 2 and one line naming the dotted path.",
        "",
    ]
    section = None
    for key, typ, default, doc in field_docs(RunConfig):
        top = key.split(".")[0]
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
    return "\n".join(lines) + "\n"


def docs(args: argparse.Namespace) -> int:
    text = render_docs()
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0
