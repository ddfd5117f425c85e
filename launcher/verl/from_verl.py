"""`fleetrl config from-verl IN [overrides] --out OUT`: a verl config as a fleetrl YAML file.

Every key the translation sets is written with a comment naming the verl key it comes from
and, where verl's meaning needs saying, why (``launcher.verl.translate``); keys it does not
set keep fleetrl's defaults (docs/configuration.md). The verl keys that have no effect here
close the file as comments. ``fleetrl train --config OUT`` then runs what ``--config IN``
runs, and the file can be edited as any fleetrl config.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from fleetrl.config import field_docs, load_yaml
from launcher.verl.load import VerlLoad, is_verl_layout, load_verl
from launcher.verl.translate import Setting

FLEETRL = "a fleetrl key, given beside the verl ones"
HEADER = """\
# fleetrl run config written by `fleetrl config from-verl` from {source}.
# Each key names the verl key it comes from (and what verl means by it, where that needs
# saying); keys not written keep fleetrl's defaults (docs/configuration.md). docs/verl.md
# has the whole mapping."""


def _scalar(value: Any) -> str:
    """One YAML flow value (JSON-like lists and mappings, floats with their exponent)."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).splitlines()[0]


def render(loaded: VerlLoad, source: str) -> str:
    from launcher.config import RunConfig

    order = {key: i for i, (key, *_rest) in enumerate(field_docs(RunConfig))}
    settings = dict(loaded.translation.settings)
    for key in loaded.fleetrl_keys:  # given in fleetrl terms beside the verl file
        settings[key] = Setting(key, _lookup(loaded.raw, key), FLEETRL)
    lines = [HEADER.format(source=source)]
    opened: list[str] = []
    for key in sorted(settings, key=lambda k: order.get(k, len(order))):
        setting = settings[key]
        *parents, leaf = key.split(".")
        common = 0
        while common < min(len(opened), len(parents)) and opened[common] == parents[common]:
            common += 1
        for depth in range(common, len(parents)):
            lines.append(f"{'  ' * depth}{parents[depth]}:")
        opened = parents
        comment = setting.source
        if setting.why:
            comment += f": {setting.why}"
        value = _lookup(loaded.raw, key)
        lines.append(f"{'  ' * len(parents)}{leaf}: {_scalar(value)}  # {comment}")
    if loaded.notes:
        lines += ["", "# Read from the verl config, with no effect here (or how it is laid out):"]
        lines += [f"#   {note}" for note in loaded.notes]
    return "\n".join(lines) + "\n"


def _lookup(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        node = node[part]
    return node


def main(args: argparse.Namespace) -> int:
    from launcher.cli import UsageError

    raw = load_yaml(args.input)
    if not is_verl_layout(raw, args.overrides):
        raise UsageError(f"{args.input} is not in verl's layout (no actor_rollout_ref, critic, algorithm ... section)")  # fmt: skip
    loaded = load_verl(raw, args.overrides)
    loaded.run_config()  # the same checks as a run: refused here, not when OUT is used
    text = render(loaded, args.input)
    if args.out:
        Path(args.out).write_text(text)
        print(f"fleetrl config from-verl: wrote {args.out}")  # the CLI's result
    else:
        sys.stdout.write(text)
    return 0
