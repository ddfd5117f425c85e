"""The verl key table: one entry per verl config key (or subtree), as data with a reason.

Each ``Key`` says what fleetrl does with a verl key:

- ``map``: the value sets one fleetrl key (``to``), through ``convert`` if given;
- ``rule``: the value is read by a rule of ``launcher.verl.translate`` together with other
  keys; ``to`` names what it sets there (for the docs and ``from-verl``'s comments);
- ``note``: it has no effect here; a value other than verl's default is named once
  (stderr), and ``why`` says why.

``accept`` (a tuple of values, or a predicate) lists what fleetrl can honour; any other
value is refused (exit 2) with ``fix``, what to set instead. ``path`` is a dotted verl key,
or a subtree: ``prefix.**`` (any key below) and ``*`` (any one segment, as in
``*._target_``). The most specific entry wins: an exact key over ``*``, over ``**``.
``default`` is verl's default (``_generated_ppo_trainer.yaml``, interpolations
included, as verl's OmegaConf resolves them): tests/unit/launcher/test_verl_table.py
holds each one against verl's own file.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final, Literal

Kind = Literal["map", "rule", "note"]


class _Missing:
    def __repr__(self) -> str:
        return "(none)"


NO_DEFAULT: Final = _Missing()
MANDATORY: Final = "???"  # OmegaConf's "must be set"


@dataclass(frozen=True)
class Key:
    path: str
    kind: Kind
    default: Any = NO_DEFAULT
    to: str = ""
    why: str = ""
    accept: tuple[Any, ...] | Callable[[Any], bool] | None = None
    fix: str = ""
    convert: Callable[[Any], Any] | None = None
    legacy: bool = False  # a key of older verl releases, not in the current default file
    # a key of verl's config dataclasses that its default file leaves out (verl's users set
    # it with a leading +, e.g. +actor_rollout_ref.rollout.enable_sleep_mode=false)
    plus: bool = False

    def accepts(self, value: Any) -> bool:
        if self.accept is None:
            return True
        if callable(self.accept):
            return bool(self.accept(value))
        return value in self.accept

    @property
    def is_pattern(self) -> bool:
        return "*" in self.path


def M(path: str, default: Any, to: str, why: str = "", **kw: Any) -> Key:
    """A key that sets ``to`` (converted by ``convert`` when given)."""
    return Key(path, "map", default, to=to, why=why, **kw)


def R(path: str, default: Any, to: str, why: str, **kw: Any) -> Key:
    """A key read by a rule of ``launcher.verl.translate`` (``to``: what the rule sets)."""
    return Key(path, "rule", default, to=to, why=why, **kw)


def N(path: str, default: Any = NO_DEFAULT, why: str = "", **kw: Any) -> Key:
    """A key with no effect here (``why``); with ``accept``, other values are refused."""
    return Key(path, "note", default, why=why, **kw)


def only(*values: Any) -> tuple[Any, ...]:
    return values


def empty(value: Any) -> bool:
    """``accept=empty``: null, an empty string, list or mapping (verl's "not used")."""
    return value in (None, "", {}, [])


def _specificity(key: Key) -> tuple[int, int]:
    # exact keys first; then patterns with more literal segments; "**" after "*"
    parts = key.path.split(".")
    literal = sum(1 for p in parts if "*" not in p)
    return (2 if "**" in parts else 1 if key.is_pattern else 0, -literal)


def _regex(pattern: str) -> re.Pattern[str]:
    """``*`` = one segment, ``**`` = one or more segments."""
    parts = []
    for part in pattern.split("."):
        parts.append(
            r"[^.]+(?:\.[^.]+)*" if part == "**" else "[^.]+" if part == "*" else re.escape(part)
        )
    return re.compile(r"\.".join(parts))


class KeyTable:
    """Lookup of a dotted verl key's entry (the most specific one)."""

    def __init__(self, keys: Iterable[Key]) -> None:
        self.keys = list(keys)
        twice = [p for p, n in Counter(k.path for k in self.keys).items() if n > 1]
        if twice:
            raise ValueError(f"verl key table: {twice} listed more than once")
        self.exact = {k.path: k for k in self.keys if not k.is_pattern}
        self.patterns = [
            (k, _regex(k.path))
            for k in sorted((k for k in self.keys if k.is_pattern), key=_specificity)
        ]

    def lookup(self, path: str) -> Key | None:
        if path in self.exact:
            return self.exact[path]
        return next((k for k, regex in self.patterns if regex.fullmatch(path)), None)

    def defaults(self) -> dict[str, Any]:
        """verl's defaults as a nested tree (exact keys only): what a silent file means."""
        tree: dict[str, Any] = {}
        for key in self.keys:
            if key.is_pattern or key.legacy or key.plus or key.default is NO_DEFAULT:
                continue
            node = tree
            *parents, leaf = key.path.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = key.default
        return tree

    def sections(self) -> list[str]:
        """verl's top-level sections, in the table's order."""
        return list(dict.fromkeys(k.path.split(".")[0] for k in self.keys if k.path[0] != "*"))
