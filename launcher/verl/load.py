"""Reading a verl config: recognise the layout, fill in verl's defaults, apply verl's dotted
overrides, resolve interpolations with OmegaConf (verl's own config library), and judge every
leaf by the key table before ``launcher.verl.translate`` maps it.

``load_verl(raw, overrides)`` returns a ``VerlLoad``: the fleetrl config dict, the
``Translation`` (where each fleetrl key came from) and the notes: the keys set that have
no effect here (named once each, or once per subtree) and how the run is laid out. A value
fleetrl cannot honour raises ``VerlRefused``, one line per key naming what to set instead.

Beside verl's keys a file may hold a ``fleetrl:`` section, and the command line fleetrl
overrides (``learner.num_ranks=4``, ``buffer.max_staleness=2``): a key of a section only
fleetrl has (model, rollout, learner, buffer, ...), or a ``data.``/``trainer.`` key verl
lacks (``trainer.output_dir``). They apply after the translation, and win.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from fleetrl.config import ConfigError, ConfigErrors, _type_at, apply_overrides, parse_override
from fleetrl.log import get_logger
from launcher.verl import keys_model, keys_run
from launcher.verl.table import NO_DEFAULT, Key, KeyTable
from launcher.verl.translate import Translation, VerlRefused, refusal, translate

log = get_logger(__name__)

TABLE = KeyTable(keys_model.KEYS + keys_run.KEYS)
FLEETRL_SECTION = "fleetrl"
SHARED = frozenset({"data", "trainer"})  # sections both layouts have
VERL_ONLY = frozenset(TABLE.sections()) - SHARED | {"defaults", "hydra"}


def _fleetrl_only() -> frozenset[str]:
    from launcher.config import RunConfig

    return frozenset(f.name for f in msgspec.structs.fields(RunConfig)) - SHARED


def _top(item: str) -> str:
    return item.lstrip("+~").split("=", 1)[0].split(".", 1)[0].strip()


def is_verl_layout(raw: dict[str, Any], overrides: list[str]) -> bool:
    """A file (or command line) with any of verl's own sections is a verl config."""
    tops = set(raw) | {_top(item) for item in overrides}
    verl = tops & VERL_ONLY
    if not verl:
        return False
    mixed = set(raw) & _fleetrl_only()
    if mixed:
        raise ConfigError(
            "--config",
            f"mixes verl's layout ({', '.join(sorted(verl))}) with fleetrl's "
            f"({', '.join(sorted(mixed))}); put the fleetrl keys under a `fleetrl:` section",
        )
    return True


@dataclass
class VerlLoad:
    raw: dict[str, Any]  # the fleetrl config, as YAML would hold it
    translation: Translation
    notes: list[str] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)  # every verl leaf, resolved
    fleetrl_keys: set[str] = field(default_factory=set)  # set in fleetrl terms by the user

    def run_config(self, *, training: bool = False) -> Any:
        """The ``RunConfig``; a fleetrl error is reported against the verl key it came from."""
        from launcher.config import build_run_config

        for line in self.notes:
            log.info("verl config: %s", line)
        try:
            return build_run_config(self.raw, training=training)
        except ConfigError as err:
            raise self.explain(err) from None

    def name(self, fleetrl_key: str) -> str:
        """A fleetrl key as the user knows it: the verl key it came from, if any."""
        key = fleetrl_key.split(" ")[0]
        setting = self.translation.source_of(key)
        if setting is None or any(k == key or key.startswith(k + ".") for k in self.fleetrl_keys):
            return fleetrl_key
        if setting.source == key:  # the same name in both (data.train_files)
            return fleetrl_key
        return f"{setting.source} (fleetrl {fleetrl_key})"

    def explain(self, err: ConfigError) -> ConfigError:
        if isinstance(err, ConfigErrors):
            return ConfigErrors([self.explain(e) for e in err.errors], err.config)
        named = self.name(err.path)
        if named == err.path:
            return err
        return ConfigError(named, str(err).split(": ", 1)[-1])


def load_verl(raw: dict[str, Any], overrides: list[str]) -> VerlLoad:
    user = msgspec.convert(raw, dict)
    extra = user.pop(FLEETRL_SECTION, None) or {}
    if not isinstance(extra, dict):
        raise ConfigError(FLEETRL_SECTION, f"must be a mapping of fleetrl keys, got {extra!r}")
    notes = _meta_sections(user)
    verl_items, fleetrl_items = _split_overrides(overrides)
    user = apply_overrides(user, verl_items)
    values, written = _resolve(user)
    refused = _refusals(values, set(written))
    if refused:
        raise VerlRefused(refused)
    notes += _notes(values, written)
    fleetrl = apply_overrides(extra, fleetrl_items)
    translation = translate(TABLE, values, fleetrl)
    out = _deep_merge(translation.as_dict(), fleetrl)
    return VerlLoad(
        raw=out,
        translation=translation,
        notes=notes + translation.lines,
        values=values,
        fleetrl_keys=set(_leaf_keys(fleetrl)),
    )


def _meta_sections(user: dict[str, Any]) -> list[str]:
    """Hydra's ``defaults`` list and ``hydra`` section: only the FSDP groups are honoured."""
    notes = []
    defaults = user.pop("defaults", None) or []
    for entry in defaults if isinstance(defaults, list) else [defaults]:
        text = str(entry)
        if "megatron" in text:
            raise VerlRefused([refusal("defaults", entry, "the FSDP config groups (Megatron is not supported)")])  # fmt: skip
    if defaults:
        notes.append("defaults: verl's config groups are read as ppo_trainer's (its FSDP defaults)")
    if user.pop("hydra", None) is not None:
        notes.append("hydra: has no effect here (no Hydra job runs)")
    return notes


def _split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(verl overrides, fleetrl overrides); Hydra's ``+``/``++`` prefixes are accepted."""
    from launcher.config import RunConfig

    verl, fleetrl = [], []
    fleetrl_only = _fleetrl_only()
    for item in overrides:
        if item.startswith("~"):
            raise ConfigError(item, "deleting a key (~key) is not supported; set its value instead")
        item = item.lstrip("+")
        parts, _ = parse_override(item)
        dotted = ".".join(parts)
        if _is_verl_key(dotted):
            verl.append(item)
        elif parts[0] in fleetrl_only or _type_at(RunConfig, dotted) is not None:
            fleetrl.append(item)
        else:
            raise ConfigError(dotted, "neither a verl key (docs/verl.md) nor a fleetrl one (docs/configuration.md)")  # fmt: skip
    return verl, fleetrl


def _is_verl_key(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[0] in VERL_ONLY:
        return True
    prefixes = (".".join(parts[:end]) for end in range(len(parts), 0, -1))
    return TABLE.lookup(dotted) is not None or any(p in TABLE.exact for p in prefixes)


def _resolve(user: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """verl's defaults under the user's keys, interpolations resolved: (every leaf, the
    leaves the user wrote, as written)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        merged = OmegaConf.merge(OmegaConf.create(TABLE.defaults()), OmegaConf.create(user))
        resolved = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as err:
        where = getattr(err, "full_key", "") or "--config"
        raise ConfigError(where, str(err).splitlines()[0]) from None
    return dict(flatten(resolved)), dict(flatten(user))


def flatten(tree: dict[str, Any], prefix: str = ""):
    """(dotted key, value) of every leaf; a table key whose value is a mapping is one leaf."""
    for name, value in tree.items():
        path = f"{prefix}{name}"
        if isinstance(value, dict) and value and path not in TABLE.exact:
            yield from flatten(value, path + ".")
        else:
            yield path, value


def _leaf_keys(tree: dict[str, Any]) -> list[str]:
    return [key for key, _ in flatten(tree)]


def _refusals(values: dict[str, Any], user_keys: set[str]) -> list[str]:
    lines = []
    for path, value in values.items():
        key = TABLE.lookup(path)
        if key is None:
            if path in user_keys:
                lines.append(f"verl key {path}: not a key of verl's ppo_trainer config (nor of older releases fleetrl knows); remove it or check its spelling (docs/verl.md lists every key)")  # fmt: skip
            continue
        if not key.accepts(value):
            lines.append(refusal(path, value, key.fix))
    return lines


def _notes(values: dict[str, Any], written: dict[str, Any]) -> list[str]:
    """The keys set that have no effect: each exact one that differs from verl's default,
    each subtree once, and a count of those left at verl's default (``written``: the
    user's leaves as written, interpolations unresolved)."""
    exact: list[str] = []
    grouped: dict[str, tuple[Key, int]] = {}
    at_default = 0
    for path in sorted(set(written) & set(values)):
        key = TABLE.lookup(path)
        if key is None or key.kind != "note":
            continue
        if key.is_pattern:
            grouped[key.path] = (key, grouped.get(key.path, (key, 0))[1] + 1)
        elif key.default is not NO_DEFAULT and _same(written[path], values[path], key.default):
            at_default += 1
        else:
            exact.append(f"{path}={values[path]!r} has no effect here: {key.why}")
    lines = exact + [
        f"{key.path} ({count} key{'s' * (count > 1)} set) has no effect here: {key.why}"
        for key, count in grouped.values()
    ]
    if at_default:
        lines.append(f"{at_default} more key(s) set to verl's default have no effect here (docs/verl.md)")  # fmt: skip
    return lines


def _same(written: Any, value: Any, default: Any) -> bool:
    """The user wrote verl's default: the same interpolation, or the same value."""
    return written == default or value == default


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for name, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(name), dict):
            out[name] = _deep_merge(out[name], value)
        else:
            out[name] = value
    return out
