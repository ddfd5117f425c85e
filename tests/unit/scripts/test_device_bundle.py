"""The device bundle's logic without the registry (scripts/device/bundle.py, unpack.py and
bench.gpu.machine_packages): what must travel, what the machine must have, stripping,
packing, and the unpack step's checks on a small made-up site."""

from __future__ import annotations

import importlib.util
import json
import sys
import tarfile
from pathlib import Path

import pytest

from bench.gpu.machine_packages import read_machine_packages, requirements_of, resolve

DEVICE = Path(__file__).resolve().parents[3] / "scripts" / "device"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"device_{name}", DEVICE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bundle():
    return load("bundle")


@pytest.fixture(scope="module")
def unpack():
    return load("unpack")


def test_the_machine_list_has_torch_and_lacks_what_the_bundle_carries():
    machine = read_machine_packages()
    assert {"torch", "transformers", "safetensors", "pyarrow", "aiohttp", "pyyaml"} <= machine
    assert not {"ray", "pyzmq", "msgspec", "wandb", "fastapi", "pydantic", "sglang"} & machine


def test_resolution_carries_the_roots_and_every_dependency_the_machine_lacks():
    machine = read_machine_packages()
    resolution = resolve()
    bundled = resolution.bundled
    assert {"ray", "pyzmq", "msgspec", "jsonschema"} <= bundled
    assert not bundled & machine
    for pin in resolution.pins:  # closed: every requirement is carried or on the machine
        for dep, _ in requirements_of(pin.name):
            assert dep in bundled or dep in machine, f"{pin.name} needs {dep}"
    assert {r["name"] for r in resolution.on_machine} >= {"click", "msgpack", "protobuf"}
    ray = next(p for p in resolution.pins if p.name == "ray")
    assert ray.needed_by == "fleetrl" and ray.version == __import__("ray").__version__


def test_strip_removes_the_listed_paths_and_reports_their_bytes(bundle, tmp_path):
    (tmp_path / "ray" / "jars").mkdir(parents=True)
    (tmp_path / "ray" / "jars" / "ray_dist.jar").write_bytes(b"x" * 100)
    (tmp_path / "ray" / "_raylet.so").write_bytes(b"y" * 10)
    removed = bundle.strip(tmp_path, {"ray/jars": "java", "ray/serve": "absent"})
    assert removed == [{"path": "ray/jars", "bytes": 100, "why": "java"}]
    assert not (tmp_path / "ray" / "jars").exists() and (tmp_path / "ray" / "_raylet.so").exists()


def fake_site(root: Path) -> Path:
    site = root / "site"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "__init__.py").write_text("VALUE = 42\n")
    (site / "single.py").write_text("X = 1\n")
    info = site / "fake_pkg-1.0.dist-info"
    info.mkdir()
    (info / "RECORD").write_text(
        "../../bin/tool,sha256=x,10\npkg/__init__.py,sha256=y,11\nsingle.py,sha256=z,6\n"
        "fake_pkg-1.0.dist-info/RECORD,,\n"
    )
    return site


def test_top_level_modules_come_from_each_record_without_scripts_or_metadata(bundle, tmp_path):
    assert bundle.top_level_modules(fake_site(tmp_path)) == {"fake-pkg": ["pkg", "single"]}


def write_bundle(bundle, tmp_path: Path, modules: list[str], python: str | None = None) -> Path:
    out = tmp_path / "bundle"
    bundle.pack(fake_site(tmp_path), out / bundle.SITE_TARBALL)
    manifest = {
        "python": python or f"{sys.version_info.major}.{sys.version_info.minor}",
        "tarball": bundle.SITE_TARBALL,
        "tarball_sha256": bundle.sha256(out / bundle.SITE_TARBALL),
        "packages": [{"name": "fake-pkg", "version": "1.0", "modules": modules}],
        "on_machine": [{"name": "pytest", "specifier": ">=1", "needed_by": "fake-pkg"},
                       {"name": "not-a-real-dist", "specifier": "", "needed_by": "fake-pkg"}],
    }  # fmt: skip
    (out / bundle.MANIFEST).write_text(json.dumps(manifest))
    return out


def test_pack_is_deterministic_and_unpack_restores_the_site(bundle, unpack, tmp_path, capsys):
    out = write_bundle(bundle, tmp_path, ["pkg", "single"])
    first = bundle.sha256(out / bundle.SITE_TARBALL)
    bundle.pack(fake_site(tmp_path / "again"), tmp_path / "again.tar.xz")
    assert bundle.sha256(tmp_path / "again.tar.xz") == first  # same files, same bytes
    with tarfile.open(out / bundle.SITE_TARBALL) as tar:
        assert {m.uid for m in tar.getmembers()} == {0} and {m.mtime for m in tar.getmembers()} == {
            0
        }
    site = unpack.unpack(out, tmp_path / "unpacked", compile_site=True)
    assert (site / "pkg" / "__init__.py").read_text() == "VALUE = 42\n"
    assert list((site / "pkg").glob("__pycache__/*.pyc"))
    err = capsys.readouterr().err
    assert "machine: ok pytest" in err and "machine: MISSING not-a-real-dist" in err


def test_unpack_refuses_a_corrupt_tarball_a_missing_module_or_another_python(
    bundle, unpack, tmp_path
):
    out = write_bundle(bundle, tmp_path, ["pkg", "absent_module"])
    with pytest.raises(unpack.BundleError, match=r"bundled modules not found .*absent_module"):
        unpack.unpack(out, tmp_path / "a", compile_site=False)
    other = write_bundle(bundle, tmp_path / "other", ["pkg"], python="2.7")
    with pytest.raises(unpack.BundleError, match="built for Python 2.7"):
        unpack.unpack(other, tmp_path / "b")
    good = write_bundle(bundle, tmp_path / "good", ["pkg"])
    with open(good / bundle.SITE_TARBALL, "r+b") as f:
        f.seek(40)
        f.write(b"corrupt")
    with pytest.raises(unpack.BundleError, match="does not match its manifest's sha256"):
        unpack.unpack(good, tmp_path / "c")


def test_unpack_without_a_bundle_exits_2_with_one_line(unpack, tmp_path, capsys):
    assert unpack.main([str(tmp_path / "nothing"), "--to", str(tmp_path / "site")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "make device-bundle" in lines[0]


def test_the_size_report_sums_tree_and_bundle_against_the_limit(bundle):
    manifest = {"tarball_bytes": 28 * bundle.MIB, "stripped": [{"bytes": 10 * bundle.MIB}],
                "packages": [{"name": "ray", "version": "2.60.0"}]}  # fmt: skip
    lines, fits = bundle.size_report(manifest, 3 * bundle.MIB)
    assert fits and "28.0 MiB (ray 2.60.0); 10.0 MiB of ray stripped" in lines[0]
    assert lines[1].endswith("= 31.0 MiB of 60 MiB: fits")
    _, over = bundle.size_report({**manifest, "tarball_bytes": 58 * bundle.MIB}, 3 * bundle.MIB)
    assert over is False


def test_the_working_tree_that_travels_is_small(bundle):
    assert 0 < bundle.working_tree_bytes() < 10 * bundle.MIB
