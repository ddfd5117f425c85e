"""docker/Dockerfile, built by `make image` with a real OCI builder, runs `make demo`'s
training inside to a risen held-out score (``make test-deploy``, marker ``deploy``).

The image is built as users get it except for the `sglang` extra (IMAGE_EXTRAS empty):
SGLang's GPU closure is about ten gigabytes more and its engines need a GPU anyway; the
CUDA build of torch stays, so the image is the one a GPU node runs, minus SGLang. Where no
base image can be pulled, the build starts from a Debian root filesystem made with
mmdebstrap (docker/build_image.py).

With buildah (no container daemon), the demo runs in a working container with chroot
isolation (``buildah from`` + ``buildah run``); docker or podman run it as a user would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TAG = "localhost/fleetrl:test-nosglang"

pytestmark = [pytest.mark.deploy, pytest.mark.slow]


def _builder() -> str:
    for name in ("docker", "podman", "buildah"):
        if shutil.which(name) is None:
            continue
        if name == "docker" and subprocess.run(["docker", "info"], capture_output=True).returncode:
            continue
        return name
    pytest.skip("image test: no OCI builder (docker with its daemon, podman or buildah)")


@pytest.fixture(scope="module")
def image():
    builder = _builder()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    build = subprocess.run(
        ["make", "-s", "image", "IMAGE_EXTRAS=", f"IMAGE_TAG={TAG}"], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-5000:]
    assert f"image: built {TAG}" in build.stdout
    yield builder, TAG
    # this build's image goes (the next build's would leave it untagged, gigabytes each run);
    # the dependency layers' image stays, as the cache `make image` builds on
    subprocess.run([builder, "rmi", TAG], capture_output=True)


def _run_in_image(builder: str, tag: str, out: Path, *cmd: str) -> subprocess.CompletedProcess:
    """``cmd`` in a container of the image as its own user, ``out`` mounted at
    /home/fleetrl/runs; the container is removed after."""
    out.chmod(0o777)  # the image's user (uid 1000) writes there
    volume = f"{out}:/home/fleetrl/runs"
    if builder != "buildah":
        return subprocess.run(
            [builder, "run", "--rm", "--shm-size=2g", "-v", volume, tag, *cmd],
            capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
    name = f"fleetrl-test-{os.getpid()}"
    subprocess.run(["buildah", "from", "--name", name, tag], check=True, capture_output=True)
    try:
        return subprocess.run(
            ["buildah", "run", "--isolation", "chroot", "-v", volume, name, "--", *cmd],
            capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
    finally:
        subprocess.run(["buildah", "rm", name], capture_output=True)


@pytest.mark.timeout(5400)
def test_image_runs_the_demo_as_its_own_user_to_a_risen_score(image, tmp_path: Path):
    builder, tag = image
    result = _run_in_image(
        builder, tag, tmp_path,
        "bash", "-c", "id -u && fleetrl train --config configs/demo_cpu.yaml "
        "trainer.output_dir=runs/demo/run",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert result.stdout.splitlines()[0] == "1000"  # the image's user, not root
    summary = json.loads((tmp_path / "demo" / "run" / "summary.json").read_text())
    assert summary["final_val_score"] > summary["initial_val_score"] + 0.3, summary
    assert "held-out score" in result.stdout
