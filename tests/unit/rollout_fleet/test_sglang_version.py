"""The SGLang version gate: the tested range, the one-line refusal, and pyproject agreeing with it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from rollout_fleet.sglang_version import (
    TESTED_SGLANG,
    SGLangVersionError,
    check_sglang_version,
    installed_sglang_version,
)

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"


def test_the_sglang_extra_in_pyproject_pins_the_tested_range():
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    (requirement,) = extras["sglang"]
    match = re.fullmatch(r"sglang(\[[^\]]*\])?\s*(?P<spec>.+)", requirement)
    assert match, requirement
    assert match["spec"].replace(" ", "") == TESTED_SGLANG


@pytest.mark.parametrize("version", ["0.5.23", "0.5.23.post1", "0.5.23.post4"])
def test_releases_inside_the_tested_range_pass(version):
    check_sglang_version(version)


@pytest.mark.parametrize("version", ["0.5.22", "0.5.24", "0.6.0", "0.4.9.post2", "0.5.24rc1"])
def test_releases_outside_the_range_are_refused_in_one_line_with_the_fix(version):
    with pytest.raises(SGLangVersionError) as info:
        check_sglang_version(version)
    message = str(info.value)
    assert "\n" not in message
    assert f"sglang {version} is installed" in message
    assert TESTED_SGLANG in message
    assert 'pip install ".[sglang]" in fleetrl\'s checkout' in message


def test_an_unparseable_version_is_refused():
    with pytest.raises(SGLangVersionError, match="not-a-version"):
        check_sglang_version("not-a-version")


def test_not_installed_is_refused_with_the_fix():
    with pytest.raises(SGLangVersionError) as info:
        check_sglang_version(lookup=lambda: None)
    message = str(info.value)
    assert "not installed" in message and "\n" not in message
    assert 'pip install ".[sglang]" in fleetrl\'s checkout' in message


def test_the_installed_version_is_read_from_metadata_and_is_tested_here():
    # make venv installs sglang from the tested range (the conformance tier runs its code)
    version = installed_sglang_version()
    assert version is not None
    check_sglang_version()
