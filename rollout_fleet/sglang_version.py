"""The SGLang releases fleetrl is tested against, and the check that refuses others.

fleetrl talks to SGLang through its HTTP weight-update protocol
(``/begin_weight_update`` ... ``/end_weight_update``, ``/model_info``'s
``weight_version``, ``flattened_bucket`` updates) and its command line
(``--weight-version``, ``--disable-radix-cache``). Those changed between minor
releases before (``/get_weight_version`` went away; updates outside
begin..end became an error), so a release outside ``TESTED_SGLANG`` is refused
when an engine starts, with one line saying what is installed and how to fix
it, instead of failing later inside a weight update.

``TESTED_SGLANG`` is the same range as the ``sglang`` extra in pyproject.toml
(a unit test keeps them equal); the conformance tier (tests/conformance) runs
SGLang's own code from that range. The installed version is read from package
metadata: nothing here imports sglang.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Mapping

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

TESTED_SGLANG = ">=0.5.23,<0.5.24"
# this project's own build with its extra (a checkout, or `make wheel`'s wheel), never a
# package of fleetrl's name from an index
INSTALL_HINT = 'pip install ".[sglang]" in fleetrl\'s checkout'


class SGLangVersionError(RuntimeError):
    """The installed SGLang is missing or outside ``TESTED_SGLANG``."""


def installed_version(package: str) -> str | None:
    """The installed distribution's version, or None when it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_sglang_version() -> str | None:
    """The installed sglang distribution's version, or None when it is not installed."""
    return installed_version("sglang")


def tested_release_problem(package: str, version: str | None, tested: str, hint: str) -> str:
    """Why ``version`` of ``package`` is not a tested release (one line), or "" when it is.
    ``.post`` releases of a tested release are inside; prereleases are not."""
    if version is None:
        return f"{package} is not installed; fleetrl is tested with {package}{tested}: {hint}"
    try:
        inside = SpecifierSet(tested).contains(Version(version))
    except InvalidVersion:
        inside = False
    if inside:
        return ""
    return f"{package} {version} is installed but fleetrl is tested with {package}{tested}: {hint}"


def check_sglang_version(
    version: str | None = None,
    *,
    lookup: Callable[[], str | None] = installed_sglang_version,
) -> None:
    """Raise ``SGLangVersionError`` (one line) unless ``version`` is a tested release.

    Without ``version`` the installed one is checked (``lookup``; tests inject it).
    """
    version = lookup() if version is None else version
    problem = tested_release_problem("sglang", version, TESTED_SGLANG, INSTALL_HINT)
    if problem:
        raise SGLangVersionError(problem)


def preflight_problems(
    version: str | None, environ: Mapping[str, str], instead: str
) -> list[tuple[str, str]]:
    """What ``fleetrl check`` says of the installed SGLang (``rollout_fleet.engine_kinds``):
    (problem, fix) pairs; ``instead`` is what the user could run without SGLang."""
    if version is None:
        return [
            (
                "backend sglang, but SGLang is not installed",
                f'pip install ".[sglang]" in fleetrl\'s checkout on the machines that run them, or {instead}',
            )
        ]
    try:
        inside = SpecifierSet(TESTED_SGLANG).contains(Version(version))
    except InvalidVersion:
        inside = False
    if inside:
        return []
    return [
        (
            f"SGLang {version} is installed; fleetrl is tested with sglang{TESTED_SGLANG}",
            f'pip install "sglang{TESTED_SGLANG}"',
        )
    ]
