"""configs/cluster/aws.yaml installs this project: each node type's setup commands, as
`ray up` runs them on a fresh node, run here verbatim and in order.

For a node type the cluster launcher runs ``setup_commands`` then ``head_setup_commands``
on the head, and a worker type's own ``worker_setup_commands`` in place of the global lists.
Here each type gets a fresh home folder standing for the node's (``$HOME``, with the
``file_mounts`` sources copied where the launcher puts them: the wheel ``make wheel`` built
from this checkout, and configs/), then its commands in a fresh shell each, then
``fleetrl check`` from the virtualenv they made, as a user logged into that node runs it.

One step does not run here: the first, uv's installer, downloads uv from outside the package
registries; uv is placed where that installer puts it ($HOME/.local/bin/uv), taken from the
`uv` package on PyPI (the same binary), so the command's own test skips the download.
uv caches what it downloads in one folder for all node types, as repeated nodes of one
image would not, so the second type installs from it.

The rollout and reward types install the `sglang` extra (SGLang with its CUDA kernels,
about ten gigabytes); they run under ``make test-deploy`` (marker ``deploy``), the head and
learner types under ``make test``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
AWS_YAML = REPO / "configs" / "cluster" / "aws.yaml"

pytestmark = pytest.mark.slow


def _setup_commands(config: dict, node_type: str) -> list[str]:
    """What the cluster launcher runs on a node of this type, in order."""
    if node_type == config["head_node_type"]:
        return [*config.get("setup_commands", []), *config.get("head_setup_commands", [])]
    node = config["available_node_types"][node_type]
    if "worker_setup_commands" in node:
        return list(node["worker_setup_commands"])
    return [*config.get("setup_commands", []), *config.get("worker_setup_commands", [])]


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory) -> Path:
    """dist/ as `make wheel` writes it: this checkout's wheel, alone."""
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(dist), str(REPO)],
        check=True, timeout=600,
    )  # fmt: skip
    assert [p.name for p in dist.iterdir()] == [f"fleetrl-{_version()}-py3-none-any.whl"]
    return dist


@pytest.fixture(scope="module")
def uv_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("uv-cache")
    yield cache
    shutil.rmtree(cache, ignore_errors=True)  # gigabytes: not kept for pytest's later runs


def _version() -> str:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def _uv_binary() -> str:
    from uv import find_uv_bin

    return find_uv_bin()


def _node_env(home: Path, uv_cache: Path) -> dict[str, str]:
    """A login's environment on a fresh node: its own home, the system's PATH (no virtualenv
    of this test run), uv's cache; the machine's CA bundle where pip here is told of one."""
    env = {
        "HOME": str(home),
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "UV_CACHE_DIR": str(uv_cache),
        "LANG": "C.UTF-8",
    }
    ca = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
    if not ca:
        ca = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.cert"],
            capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
    if ca and Path(ca).is_file():
        env["SSL_CERT_FILE"] = ca
    return env


def _place_file_mounts(config: dict, home: Path, wheel_dir: Path) -> None:
    remote_home = Path("/home") / config["auth"]["ssh_user"]
    for remote, local in config["file_mounts"].items():
        target = home / Path(remote).relative_to(remote_home)
        source = wheel_dir if Path(local) == Path("dist") else REPO / local
        shutil.copytree(source, target)


def _run_setup(node_type: str, scratch: Path, wheel_dir: Path, uv_cache: Path) -> None:
    config = yaml.safe_load(AWS_YAML.read_text())
    home = scratch / "home"
    (home / ".local" / "bin").mkdir(parents=True)
    shutil.copy(_uv_binary(), home / ".local" / "bin" / "uv")
    _place_file_mounts(config, home, wheel_dir)
    env = _node_env(home, uv_cache)
    for command in _setup_commands(config, node_type):
        done = subprocess.run(
            ["bash", "-c", command], cwd=home, env=env, capture_output=True, text=True,
            timeout=1500,
        )  # fmt: skip
        assert done.returncode == 0, (
            f"{node_type}: `{command}` exited {done.returncode}:\n{done.stderr[-3000:]}"
        )
    # a login on the node: .bashrc activates the environment the setup made
    check = subprocess.run(
        ["bash", "-c", "source ~/.bashrc && command -v fleetrl && "
         "fleetrl check --config ~/fleetrl/configs/demo_cpu.yaml"],
        cwd=home, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert check.returncode == 0, (
        f"{node_type}: fleetrl check:\n{check.stdout}\n{check.stderr[-3000:]}"
    )
    assert check.stdout.splitlines()[0] == str(home / "fleetrl-env" / "bin" / "fleetrl")
    assert "ready to run" in check.stdout
    installed = subprocess.run(
        [str(home / "fleetrl-env" / "bin" / "python"), "-c",
         "import importlib.metadata as m, launcher, ray; "
         "print(m.version('fleetrl'), ray.__version__, launcher.__file__)"],
        cwd=home, env=env, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    # the wheel's code, not this checkout's: an installed package in the node's environment
    assert installed[0] == _version() and "/fleetrl-env/lib/" in installed[2], installed


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("node_type", ["head", "learner_gpu"])
def test_node_setup_installs_the_wheel_and_fleetrl_check_runs(
    node_type, scratch, wheel_dir, uv_cache
):
    _run_setup(node_type, scratch, wheel_dir, uv_cache)


@pytest.mark.deploy
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("node_type", ["rollout_gpu", "reward_gpu"])
def test_sglang_node_setup_installs_the_wheel_with_sglang(node_type, scratch, wheel_dir, uv_cache):
    _run_setup(node_type, scratch, wheel_dir, uv_cache)
    python = scratch / "home" / "fleetrl-env" / "bin" / "python"
    version = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert version.startswith("0.5.23"), version
