"""docker/build_image.py without a builder: the deps stage's requirements, its cache tag,
the Dockerfile it reads, and the one-line refusals. make test-deploy builds for real
(tests/cluster/test_image.py)."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def build_image():
    spec = importlib.util.spec_from_file_location("build_image", REPO / "docker" / "build_image.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_requirements_put_the_pins_first_then_pyproject_and_the_extras(build_image):
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    text = build_image.requirements_text(["sglang"], ["torch==2.14.1", "ray[default]==2.60.0"])
    lines = text.splitlines()
    assert lines[:2] == ["torch==2.14.1", "ray[default]==2.60.0"]
    assert lines[2:] == project["dependencies"] + project["optional-dependencies"]["sglang"]
    assert not any(line.startswith("fleetrl") for line in lines)  # the wheel comes after
    assert "sglang" not in build_image.requirements_text([], ["torch==2.14.1"])


def test_an_unknown_extra_is_refused(build_image):
    with pytest.raises(
        build_image.BuildError, match="--extras gpu: pyproject.toml has no such extra"
    ):
        build_image.requirements_text(["gpu"], [])


def test_the_deps_tag_changes_with_requirements_and_base_not_with_fleetrls_code(
    build_image, monkeypatch
):
    class NoBuilder:
        name = "buildah"

    monkeypatch.setattr(build_image, "_image_id", lambda builder, ref: f"sha256:{ref}")
    tag = build_image.deps_tag("localhost/base", NoBuilder(), "torch==2.14.1\n")
    assert tag.startswith("localhost/fleetrl-deps:")
    assert tag == build_image.deps_tag("localhost/base", NoBuilder(), "torch==2.14.1\n")
    assert tag != build_image.deps_tag("localhost/base", NoBuilder(), "torch==2.14.0\n")
    assert tag != build_image.deps_tag("localhost/other", NoBuilder(), "torch==2.14.1\n")
    # the final stage (the wheel, the user) is not part of what the deps image is made from
    assert "FROM ${DEPS}" not in build_image.deps_stage_text()
    assert "pip install" in build_image.deps_stage_text()


def test_the_dockerfile_runs_as_a_user_and_its_base_is_debian_with_python_311(build_image):
    text = (REPO / "docker" / "Dockerfile").read_text()
    assert build_image.dockerfile_arg("BASE") == "docker.io/library/debian:bookworm-slim"
    assert "\nUSER fleetrl\n" in text and "useradd --create-home --uid 1000" in text
    assert "/dev/shm" in text  # its needs stated where the image is described
    assert build_image.DEBIAN_SUITE == "bookworm"  # Debian 12: python3 is 3.11


def test_no_builder_is_one_line_and_exit_2(build_image, monkeypatch, capsys):
    monkeypatch.setattr(build_image.shutil, "which", lambda name: None)
    assert build_image.main(["--builder", "auto"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("image: no OCI builder found") and err.count("\n") == 1
