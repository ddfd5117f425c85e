"""Typed, validated configuration machinery shared by every component.

Each component owns a ``msgspec.Struct`` config next to the code that uses it,
with a ``Meta(description=...)`` per field; ``launcher.config.RunConfig``
composes them. This module turns YAML plus dotted command-line overrides into
those structs, and turns every validation failure into one line that names the
dotted path, the value given and what is accepted (``ConfigError``) so the CLI
can exit with status 2 and no traceback.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

T = TypeVar("T")

_PATH_RE = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_UNKNOWN_RE = re.compile(r"^Object contains unknown field `(?P<key>[^`]+)`")
_MISSING_RE = re.compile(r"^Object missing required field `(?P<key>[^`]+)`")


class ConfigError(ValueError):
    """A configuration problem, rendered as one line naming the dotted path."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"config error at {path or '<root>'}: {message}")


class ConfigErrors(ConfigError):
    """Several configuration problems found at once: the CLI prints ``lines``, one each.

    ``config`` is the validated struct when the problems are rules across keys (the
    fields themselves converted): preflight then checks it too, and reports everything at
    once.
    """

    def __init__(self, errors: list[ConfigError], config: Any = None) -> None:
        self.errors = list(errors)
        self.lines = [str(e) for e in self.errors]
        self.config = config
        self.path = self.errors[0].path
        self.message = self.errors[0].message
        ValueError.__init__(self, "; ".join(self.lines))


def raise_all(errors: list[ConfigError], config: Any = None) -> None:
    """Raise nothing, the one error, or ``ConfigErrors`` of them all."""
    if len(errors) == 1 and config is None:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors, config)


def _dotted(msgspec_path: str) -> str:
    return msgspec_path.lstrip(".").replace("].", "]").replace("[", ".[") if msgspec_path else ""


def _lookup(raw: Any, dotted: str) -> Any:
    node = raw
    for part in filter(None, re.split(r"\.|\[|\]", dotted)):
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _type_at(cls: type, dotted: str) -> Any:
    """The msgspec type info reached by following ``dotted`` from ``cls`` (None if not a field)."""
    node: Any = msgspec.inspect.type_info(cls)
    for part in filter(None, dotted.split(".")):
        while isinstance(node, msgspec.inspect.Metadata):
            node = node.type
        if not isinstance(node, msgspec.inspect.StructType):
            return None
        fields = {f.name: f for f in node.fields}
        if part not in fields:
            return None
        node = fields[part].type
    while isinstance(node, msgspec.inspect.Metadata):
        node = node.type
    return node


def _struct_at(cls: type, dotted: str) -> type | None:
    info = _type_at(cls, dotted)
    return info.cls if isinstance(info, msgspec.inspect.StructType) else None


def struct_keys(cls: type) -> list[str]:
    return [f.name for f in msgspec.structs.fields(cls)]


_SWITCH_WORDS = {"on": True, "off": False, "yes": True, "no": False, "true": True, "false": False}


def _unwrap(info: Any) -> Any:
    while isinstance(info, msgspec.inspect.Metadata):
        info = info.type
    return info


def normalise_switches(cls: type, raw: Any) -> Any:
    """On/off values as YAML writes them, accepted where the field expects them.

    YAML 1.1 reads an unquoted ``off`` as ``False``: a ``Literal["auto", "on", "off"]``
    field gets ``"off"`` back for it, and a bool field accepts the words
    on/off/yes/no/true/false (any case) when they arrive quoted.
    """
    info = _unwrap(msgspec.inspect.type_info(cls))
    if not isinstance(info, msgspec.inspect.StructType) or not isinstance(raw, dict):
        return raw
    fields = {f.name: _unwrap(f.type) for f in info.fields}
    out = dict(raw)
    for key, value in raw.items():
        field = fields.get(key)
        if isinstance(field, msgspec.inspect.StructType):
            out[key] = normalise_switches(field.cls, value)
        elif isinstance(field, msgspec.inspect.BoolType) and isinstance(value, str):
            out[key] = _SWITCH_WORDS.get(value.strip().lower(), value)
        elif (
            isinstance(field, msgspec.inspect.LiteralType)
            and isinstance(value, bool)
            and {"on", "off"} <= set(field.values)
        ):
            out[key] = "on" if value else "off"
    return out


def suggest(cls: type, where: str, key: str) -> str | None:
    """The dotted key a misspelt ``key`` under ``where`` most likely meant: a close name in
    the same section, else the same name in another section (``trainer.n`` -> ``rollout.n``)."""
    struct = _struct_at(cls, where) if where else cls
    if struct is not None:
        close = difflib.get_close_matches(key, struct_keys(struct), n=1, cutoff=0.6)
        if close:
            return ".".join(p for p in (where, close[0]) if p)
    elsewhere = [k for k, *_ in field_docs(cls) if k.rsplit(".", 1)[-1] == key]
    return elsewhere[0] if len(elsewhere) == 1 else None


def unknown_key_error(cls: type, where: str, key: str, prefix: str = "") -> ConfigError:
    """``unknown key; did you mean X?`` (or the keys accepted there, when nothing is close)."""
    join = lambda *p: ".".join(x for x in p if x)  # noqa: E731
    guess = suggest(cls, where, key)
    if guess is not None:
        return ConfigError(
            join(prefix, where, key),
            f"unknown key; did you mean {join(prefix, guess)}? (every key: docs/configuration.md)",
        )
    struct = _struct_at(cls, where) if where else cls
    accepted = ", ".join(struct_keys(struct)) if struct else "see docs/configuration.md"
    return ConfigError(join(prefix, where, key), f"unknown key; accepted keys: {accepted}")


def unknown_keys(cls: type, raw: Any, where: str = "") -> list[tuple[str, str]]:
    """Every (section, key) of ``raw`` that ``cls`` does not have, at any depth."""
    info = _unwrap(msgspec.inspect.type_info(cls))
    if not isinstance(info, msgspec.inspect.StructType) or not isinstance(raw, dict):
        return []
    fields = {f.name: _unwrap(f.type) for f in info.fields}
    out = []
    for key, value in raw.items():
        if key not in fields:
            out.append((where, str(key)))
        elif isinstance(fields[key], msgspec.inspect.StructType):
            out += unknown_keys(fields[key].cls, value, f"{where}.{key}" if where else key)
    return out


def convert(cls: type[T], raw: dict[str, Any], prefix: str = "") -> T:
    """Validate ``raw`` into ``cls``; raise ``ConfigError`` naming the dotted path (every
    unknown key at once, each with the key it most likely meant)."""
    raw = normalise_switches(cls, raw)
    raise_all([unknown_key_error(cls, where, key, prefix) for where, key in unknown_keys(cls, raw)])
    try:
        return msgspec.convert(raw, cls, strict=True)
    except msgspec.ValidationError as err:
        raise _explain(cls, raw, str(err), prefix) from None


def _explain(cls: type, raw: Any, text: str, prefix: str) -> ConfigError:
    match = _PATH_RE.search(text)
    where = _dotted(match.group("path")) if match else ""
    body = text[: match.start()] if match else text
    join = lambda *p: ".".join(x for x in p if x)  # noqa: E731
    if m := _UNKNOWN_RE.match(body):
        return unknown_key_error(cls, where, m.group("key"), prefix)
    if m := _MISSING_RE.match(body):
        return ConfigError(join(prefix, where, m.group("key")), "required key is missing")
    if not body.startswith(("Expected ", "Invalid ")):  # a struct's own check said why
        return ConfigError(join(prefix, where), body.strip())
    given = _lookup(raw, where)
    expected = body.removeprefix("Expected ").split(", got ")[0].replace("`", "")
    info = _type_at(cls, where)
    if isinstance(info, msgspec.inspect.LiteralType):
        expected = "one of " + ", ".join(repr(v) for v in info.values)
    return ConfigError(
        join(prefix, where), f"got {given!r} ({type(given).__name__}); expected {expected}"
    )


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-6`` as a string; accept the float forms users type."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a","b","c"], YAML-parsed value)."""
    if "=" not in item:
        raise ConfigError(item, "override must look like dotted.key=value")
    key, _, text = item.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(key, "override key has an empty path component")
    try:
        value = yaml.load(text, Loader=_Loader) if text.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(
            key, f"value {text!r} is not valid YAML: {err.__class__.__name__}"
        ) from None
    return parts, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``raw`` with each dotted override set (containers created on the way)."""
    out = msgspec.convert(raw, dict)  # deep copy of plain data
    for item in overrides:
        parts, value = parse_override(item)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    ".".join(parts[: i + 1]), f"is a {type(child).__name__}, not a section"
                )
            node = child
        node[parts[-1]] = value
    return out


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError("--config", f"file not found: {p.absolute()}")
    try:
        data = yaml.load(p.read_text(), Loader=_Loader) or {}
    except yaml.YAMLError as err:
        raise ConfigError("--config", f"{p} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            "--config", f"{p} must hold a mapping at top level, got {type(data).__name__}"
        )
    return data


def to_dict(struct: msgspec.Struct) -> dict[str, Any]:
    return msgspec.to_builtins(struct)


def field_docs(
    cls: type, prefix: str = "", defaults: Any = None
) -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default, description) for every leaf field, for docs and `config show`.

    Defaults are read from ``defaults``, an instance of ``cls`` built with its own defaults
    (made here when not given), not from each nested struct's class: a section whose default
    is built with other values (``CriticConfig.optim`` is ``OptimConfig(lr=1e-5)``) documents
    the values the run really gets.
    """
    rows: list[tuple[str, str, Any, str]] = []
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    if defaults is None:
        defaults = _default_instance(cls)
    for f in info.fields:
        key = f"{prefix}{f.name}"
        typ = f.type
        desc = ""
        constraints = ""
        if isinstance(typ, msgspec.inspect.Metadata):
            desc = (typ.extra_json_schema or {}).get("description", "")
            constraints = _constraints(typ)
            typ = typ.type
        default = getattr(defaults, f.name) if defaults is not None else _field_default(f)
        if isinstance(typ, msgspec.inspect.StructType):
            nested = default if isinstance(default, msgspec.Struct) else None
            rows.extend(field_docs(typ.cls, key + ".", nested))
            continue
        rows.append((key, _type_name(typ) + constraints, default, desc))
    return rows


def _field_default(f: msgspec.inspect.Field) -> Any:
    if f.default is not msgspec.NODEFAULT:
        return f.default
    if f.default_factory is not msgspec.NODEFAULT:
        return f.default_factory()
    return "(required)"


def _default_instance(cls: type) -> Any:
    """``cls()`` when every field has a default, else None (then each field's own default)."""
    try:
        return cls()
    except TypeError:
        return None


def _constraints(meta: msgspec.inspect.Metadata) -> str:
    info = meta.type
    bits = []
    for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        val = getattr(info, attr, None)
        if val is not None:
            bits.append(f"{sym}{val}")
    return f" ({', '.join(bits)})" if bits else ""


def _type_name(info: Any) -> str:
    if isinstance(info, msgspec.inspect.LiteralType):
        return " | ".join(repr(v) for v in info.values)
    if isinstance(info, msgspec.inspect.UnionType):
        return " | ".join(_type_name(t) for t in info.types)
    if isinstance(info, msgspec.inspect.Metadata):
        return _type_name(info.type)
    if isinstance(info, msgspec.inspect.ListType):
        return f"list[{_type_name(info.item_type)}]"
    if isinstance(info, msgspec.inspect.DictType):
        return f"dict[{_type_name(info.key_type)}, {_type_name(info.value_type)}]"
    return type(info).__name__.removesuffix("Type").lower()
