"""The real device bundle (``make device-bundle``): it fits beside the working tree, pip
installs its wheels for Python 3.12 with the cross-version options, every module fleetrl
imports on the GPU machine is there (bundled, or one of the machine's own packages), and
with a Python 3.12 here the unpack step runs for real and the unpacked site imports
msgspec, pyzmq and the stripped ray, and starts a local Ray that places actors.

Marked ``device_check`` (``make device-check``, not ``make test``): the bundle is built
first when it is missing or stale, which needs the package registry and minutes.
"""

from __future__ import annotations

import ast
import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu.import_guard import module_owners
from bench.gpu.machine_packages import (
    Pin,
    installed_version,
    read_machine_packages,
    requirements_of,
)

pytestmark = pytest.mark.device_check

REPO = Path(__file__).resolve().parents[3]
DEVICE = REPO / "scripts" / "device"
# The project's packages the check imports on the machine, and its entry point.
RUNTIME_PACKAGES = ("fleetrl", "learner", "rollout_fleet", "buffer", "weight_sync", "launcher",
                    "bench")  # fmt: skip
# Imported only when a feature the check never switches on is on (the import guard refuses
# them in the CPU check, so a path of the check that needed one would fail there).
OPTIONAL_THERE = {"wandb": "launcher/tracking.py, only with logging.wandb=true"}


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"device_{name}", DEVICE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def built():
    bundle = load("bundle")
    manifest = bundle.build(REPO / ".device-bundle", REPO / ".device-cache")  # kept if current
    return bundle, manifest


def third_party_imports() -> dict[str, str]:
    """Top-level third-party modules the runtime packages import: module -> a file that does."""
    local = set(RUNTIME_PACKAGES) | {"tests", "scripts"}
    found: dict[str, str] = {}
    files = [p for pkg in RUNTIME_PACKAGES for p in (REPO / pkg).rglob("*.py")]
    for path in [*files, REPO / "scripts" / "gpu_check.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names}:
                if top not in sys.stdlib_module_names and top not in local and top != "__future__":
                    found.setdefault(top, str(path.relative_to(REPO)))
    return found


def test_the_bundle_and_the_working_tree_fit_the_device_tools_limit(built):
    bundle, manifest = built
    lines, fits = bundle.size_report(manifest, bundle.working_tree_bytes())
    print("\n".join(lines))
    assert fits, lines[1]
    assert {p["name"] for p in manifest["packages"]} >= {"ray", "pyzmq", "msgspec"}


def test_pip_installs_it_for_python_312_with_every_module_fleetrl_imports_there(built, tmp_path):
    bundle, manifest = built
    wheels = [REPO / ".device-cache" / "wheels" / p["wheel"] for p in manifest["packages"]]
    bundle.install(wheels, tmp_path / "site")  # pip --python-version 3.12 --only-binary --target
    bundled = {m for mods in bundle.top_level_modules(tmp_path / "site").values() for m in mods}
    machine = read_machine_packages()
    on_machine = {m for m, dists in module_owners().items() if dists & machine}
    needed = third_party_imports()
    missing = {m: f for m, f in needed.items()
               if m not in bundled | on_machine and m not in OPTIONAL_THERE}  # fmt: skip
    assert not missing, f"imported by fleetrl, on neither the machine nor in the bundle: {missing}"
    assert {"ray", "zmq", "msgspec"} <= bundled
    assert sorted(bundled) == sorted(m for p in manifest["packages"] for m in p["modules"])


def test_the_stripped_ray_keeps_every_module_fleetrl_imports(built):
    import tarfile

    _, manifest = built
    with tarfile.open(REPO / ".device-bundle" / manifest["tarball"]) as tar:
        names = set(tar.getnames())
    for module in ("ray/__init__.py", "ray/exceptions.py", "ray/util/placement_group.py",
                   "ray/util/scheduling_strategies.py", "ray/util/queue.py",
                   "ray/_private/state.py"):  # fmt: skip
        assert module in names, module
    for stripped in manifest["stripped"]:
        assert not any(n == stripped["path"] or n.startswith(stripped["path"] + "/") for n in names)


def python312() -> str | None:
    """A Python 3.12 interpreter that runs (pyenv's shim may exist for an inactive version)."""
    candidates = [*sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12"))),
                  shutil.which("python3.12")]  # fmt: skip
    for candidate in filter(None, candidates):
        probe = subprocess.run([candidate, "--version"], capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.startswith("Python 3.12"):
            return candidate
    return None


def machine_stand_in(bundle, manifest: dict, target: Path) -> Path:
    """The machine's own packages the bundle needs (click, msgpack, protobuf, ...), installed
    for Python 3.12 at this environment's versions: what the machine provides, stood in."""
    machine = read_machine_packages()
    queue, names = [r["name"] for r in manifest["on_machine"]], set()
    while queue:
        name = queue.pop()
        if name in names or name not in machine or installed_version(name) is None:
            continue
        names.add(name)
        queue += [dep for dep, _ in requirements_of(name)]
    pins = [Pin(n, installed_version(n) or "", "stand-in") for n in sorted(names)]
    bundle.install(bundle.download(pins, REPO / ".device-cache" / "standin-wheels"), target)
    return target


RAY_PROBE = r"""
import json, os, sys
import msgspec, zmq, ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from ray._private.state import available_resources_per_node

class Probe(msgspec.Struct, array_like=True):
    version: int
    ids: bytes

probe = Probe(3, b"ab")
assert msgspec.msgpack.decode(msgspec.msgpack.encode(probe), type=Probe) == probe
ctx = zmq.Context()
pull = ctx.socket(zmq.PULL)
port = pull.bind_to_random_port("tcp://127.0.0.1")
push = ctx.socket(zmq.PUSH)
push.connect(f"tcp://127.0.0.1:{port}")
push.send(b"trajectory")
assert pull.recv() == b"trajectory"
ctx.destroy(linger=0)

ray.init(address="local", num_cpus=2, resources={"rollout": 10, "learner": 10},
         include_dashboard=False, logging_level="WARNING",
         runtime_env={"env_vars": {"FLEETRL_PROBE": "placed"}})
try:
    pg = placement_group([{"CPU": 0.5, "learner": 1}] * 2, strategy="PACK")
    ray.get(pg.ready(), timeout=180)

    @ray.remote
    class Rank:
        def where(self):
            return list(sys.version_info[:2]), os.environ.get("FLEETRL_PROBE")

    ranks = [Rank.options(num_cpus=0.5, resources={"learner": 1}, scheduling_strategy=
             PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
             ).remote() for i in range(2)]
    answers = ray.get([r.where.remote() for r in ranks], timeout=180)
    nodes = len(available_resources_per_node())
    remove_placement_group(pg)
finally:
    ray.shutdown()
print(json.dumps({"answers": answers, "nodes": nodes, "ray": ray.__version__}))
"""


def test_with_python_312_the_unpacked_bundle_imports_and_ray_places_actors(built, tmp_path):
    bundle, manifest = built
    python = python312()
    if python is None:
        pytest.skip("no Python 3.12 here (python3.12, ~/.pyenv/versions/3.12*): the bundle's "
                    "imports and Ray's start are proven where there is one")  # fmt: skip
    unpacked = subprocess.run(
        [python, str(DEVICE / "unpack.py"), str(REPO / ".device-bundle"), "--to",
         str(tmp_path / "site")], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert unpacked.returncode == 0, unpacked.stderr
    site = unpacked.stdout.strip()
    assert site == str((tmp_path / "site").resolve())
    standin = machine_stand_in(bundle, manifest, tmp_path / "machine")
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"),
           "PYTHONPATH": os.pathsep.join([site, str(standin)]),
           "RAY_USAGE_STATS_ENABLED": "0"}  # fmt: skip
    probe = subprocess.run([python, "-c", RAY_PROBE], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=900)  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-3000:]
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    assert result["answers"] == [[[3, 12], "placed"], [[3, 12], "placed"]]
    assert result["nodes"] == 1
    assert result["ray"] == next(p["version"] for p in manifest["packages"] if p["name"] == "ray")
