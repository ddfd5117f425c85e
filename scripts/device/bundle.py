"""`make device-bundle`: what the GPU machine lacks, packed to travel with the working tree.

    .venv/bin/python scripts/device/bundle.py [--out .device-bundle] [--cache .device-cache]

The GPU check's machine (one H200; see docs/gpu_check.md) has Python 3.12, torch 2.11,
transformers and most of what fleetrl needs, but no ray, pyzmq or msgspec and no package
registry; a run there takes the working tree plus at most 64 MiB of carried files.
This builds ``.device-bundle/`` (git-ignored, named in the remote run's ``carry``):

- ``site.tar.xz``: the installed files of ``ROOTS`` and of every dependency of theirs that
  the machine lacks (``bench.gpu.machine_packages``), for CPython 3.12 manylinux x86-64:
  wheels fetched with ``pip download --only-binary=:all: --python-version 3.12 --platform
  ...`` (the versions this virtualenv has, so the bundle is what the tests ran), installed
  with the same cross-version options into a staging ``--target``, then the parts of ray
  that fleetrl never imports removed (``RAY_STRIP``: only so far as ray still starts a local
  instance and places actors, which ``tests/integration/scripts/test_device_bundle.py``
  proves with Python 3.12);
- ``manifest.json``: each package, its version, wheel and top-level modules; the
  requirements the machine must meet itself; what was stripped; sizes and the sha256 of
  the tarball, which ``scripts/device/unpack.py`` checks there; the checkout's commit when
  the bundle was last built or found up to date (the machine gets no git history: the
  check's report names the tree from this).

It prints the bundle's size, the working tree's and their sum against ``LIMIT_MIB``, and
exits 1 when the sum is over. A bundle whose inputs (this script, the machine's list, the
pinned versions) have not changed is kept (``--force`` rebuilds it); downloaded wheels stay
in ``--cache`` for the next build.
Left out: other Python versions or platforms (the machine has one), and any package the
machine already has in another version (its own copy is the one that runs there).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _path in (REPO, HERE):  # run as a file: the repository's packages, and the unpacker
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from unpack import MANIFEST, sha256  # noqa: E402  (the manifest's reader, on the machine)

from bench.common import git_commit  # noqa: E402
from bench.gpu.machine_packages import (  # noqa: E402
    MACHINE_PACKAGES,
    PYTHON_VERSION,
    ROOTS,
    Pin,
    canonical,
    read_machine_packages,
    resolve,
)

SITE_TARBALL = "site.tar.xz"
MIB = 1024 * 1024
# The working tree and the bundle travel together: 64 MiB is the remote run's limit; 60
# leaves room for the tree to grow between builds.
LIMIT_MIB = 60.0
# The machine runs torch's manylinux_2_28 wheels, so its glibc is at least 2.28.
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
)
CROSS_OPTIONS = (
    "--only-binary=:all:",
    "--python-version",
    PYTHON_VERSION,
    "--implementation",
    "cp",
    *(arg for platform in PLATFORMS for arg in ("--platform", platform)),
)
# Removed from the installed ray: libraries over Ray core and parts a local instance never
# loads. fleetrl imports ray, ray.exceptions, ray.util.placement_group,
# ray.util.scheduling_strategies, ray.util.queue and ray._private.state only.
RAY_STRIP = {
    "ray/jars": "Java workers (34 MB): fleetrl starts Python actors only",
    "ray/rllib": "RLlib",
    "ray/tune": "Ray Tune",
    "ray/train": "Ray Train",
    "ray/data": "Ray Data",
    "ray/serve": "Ray Serve",
    "ray/llm": "Ray's LLM library",
    "ray/air": "Ray AIR, used by the libraries above",
    "ray/dashboard/client": "the dashboard's web front end (runs start Ray without it)",
    "bin": "console scripts, whose first line names the interpreter that built the bundle",
}


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def download(pins: list[Pin], wheels: Path) -> list[Path]:
    """One wheel per pin for the machine (cached in ``wheels``); their paths."""
    wheels.mkdir(parents=True, exist_ok=True)
    _pip(
        "download", "--quiet", "--no-deps", *CROSS_OPTIONS, "--dest", str(wheels),
        *(f"{p.name}=={p.version}" for p in pins),
    )  # fmt: skip
    found = []
    for pin in pins:
        prefix = pin.name.replace("-", "_").lower() + "-" + pin.version + "-"
        matches = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(prefix)]
        if len(matches) != 1:
            raise SystemExit(f"device bundle: expected one wheel of {pin.name} {pin.version} "
                             f"in {wheels}, found {[m.name for m in matches]}")  # fmt: skip
        found.append(matches[0])
    return found


def install(wheel_paths: list[Path], site: Path) -> None:
    """Install the wheels into ``site`` as pip would for Python 3.12 (no byte-code: the
    machine compiles for its own interpreter, scripts/device/unpack.py)."""
    _pip(
        "install", "--quiet", "--no-deps", "--no-index", "--no-compile", *CROSS_OPTIONS,
        "--target", str(site), *map(str, wheel_paths),
    )  # fmt: skip


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def strip(site: Path, paths: dict[str, str] = RAY_STRIP) -> list[dict[str, object]]:
    """Remove ``paths`` (relative to ``site``) that exist; what went and its bytes."""
    removed = []
    for rel, reason in paths.items():
        target = site / rel
        if not target.exists():
            continue
        size = tree_bytes(target)
        shutil.rmtree(target) if target.is_dir() else target.unlink()
        removed.append({"path": rel, "bytes": size, "why": reason})
    return removed


def top_level_modules(site: Path) -> dict[str, list[str]]:
    """Per installed distribution (normalized name), the top-level modules its RECORD holds."""
    modules: dict[str, list[str]] = {}
    for dist_info in sorted(site.glob("*.dist-info")):
        name = canonical(dist_info.name.removesuffix(".dist-info").rsplit("-", 1)[0])
        tops = set()
        for line in (dist_info / "RECORD").read_text().splitlines():
            first = line.split(",", 1)[0].split("/", 1)[0]
            if first in ("", "..", "bin") or first.endswith((".dist-info", ".data", ".libs")):
                continue
            tops.add(first.split(".", 1)[0])  # a module file: name.py, name.cpython-312-...so
        modules[name] = sorted(t for t in tops if (site / t).exists() or any(site.glob(t + ".*")))
    return modules


def _normalized(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """Owner and time fixed, so that the same files give the same tarball."""
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    return info


def pack(site: Path, tarball: Path) -> None:
    """``site`` as an xz tarball (xz's own threads when the tool is here, else Python's lzma)."""
    tarball.parent.mkdir(parents=True, exist_ok=True)
    members = sorted(p for p in site.rglob("*") if not p.is_dir())
    xz = shutil.which("xz")
    if xz is None:
        with tarfile.open(tarball, "w:xz", preset=6) as tar:
            for path in members:
                tar.add(path, arcname=str(path.relative_to(site)), filter=_normalized)
        return
    with open(tarball, "wb") as sink:
        proc = subprocess.Popen([xz, "-6", "-T0", "-c"], stdin=subprocess.PIPE, stdout=sink)
        assert proc.stdin is not None
        with tarfile.open(fileobj=proc.stdin, mode="w|") as tar:
            for path in members:
                tar.add(path, arcname=str(path.relative_to(site)), filter=_normalized)
        proc.stdin.close()
        if proc.wait() != 0:
            raise SystemExit(f"device bundle: xz exited with status {proc.returncode}")


def working_tree_bytes(repo: Path = REPO) -> int:
    """Bytes of what a remote run sends: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    files = [repo / os.fsdecode(name) for name in listed if name]
    return sum(f.stat().st_size for f in files if f.is_file() and not f.is_symlink())


def inputs_digest(pins: list[Pin], machine_list: Path) -> str:
    """What decides the bundle's content: this script, the machine's list, the pins."""
    digest = hashlib.sha256(Path(__file__).read_bytes() + machine_list.read_bytes())
    digest.update(json.dumps([asdict(p) for p in pins]).encode())
    return digest.hexdigest()


def current_manifest(out: Path, digest: str) -> dict[str, object] | None:
    """The manifest in ``out`` if it was built from the same inputs and its tarball is intact."""
    path = out / MANIFEST
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    tarball = out / SITE_TARBALL
    if manifest.get("inputs_sha256") != digest or not tarball.is_file():
        return None
    return manifest if sha256(tarball) == manifest.get("tarball_sha256") else None


def build(
    out: Path, cache: Path, machine_list: Path = MACHINE_PACKAGES, *, force: bool = False
) -> dict[str, object]:
    """Resolve, download, install, strip and pack; write the manifest; return it (an
    up-to-date bundle in ``out`` is kept unless ``force``)."""
    resolution = resolve(ROOTS, read_machine_packages(machine_list))
    digest = inputs_digest(resolution.pins, machine_list)
    if not force and (manifest := current_manifest(out, digest)) is not None:
        print(f"device bundle: {out} is up to date (--force rebuilds it)")
        manifest["tree_commit"] = git_commit()  # the report names the tree that travels
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        return manifest
    wheels = download(resolution.pins, cache / "wheels")
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # no manifest beside a half-written tarball
    with tempfile.TemporaryDirectory(prefix="site-", dir=cache) as staging:
        site = Path(staging)
        install(wheels, site)
        installed_bytes = tree_bytes(site)
        stripped = strip(site)
        modules = top_level_modules(site)
        site_bytes = tree_bytes(site)
        pack(site, out / SITE_TARBALL)
    tarball = out / SITE_TARBALL
    manifest: dict[str, object] = {
        "python": PYTHON_VERSION,
        "platforms": list(PLATFORMS),
        "tarball": SITE_TARBALL,
        "tarball_bytes": tarball.stat().st_size,
        "tarball_sha256": sha256(tarball),
        "installed_bytes": installed_bytes,
        "site_bytes": site_bytes,
        "packages": [
            {**asdict(pin), "wheel": wheel.name, "modules": modules.get(pin.name, [])}
            for pin, wheel in zip(resolution.pins, wheels, strict=True)
        ],
        "on_machine": resolution.on_machine,
        "stripped": stripped,
        "inputs_sha256": digest,
        "built_with": f"{sys.executable} (Python {sys.version.split()[0]})",
        "tree_commit": git_commit(),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def size_report(manifest: dict[str, object], tree: int) -> tuple[list[str], bool]:
    """The lines ``make device-bundle`` prints, and whether the total is within ``LIMIT_MIB``."""
    bundle = int(manifest["tarball_bytes"])  # type: ignore[arg-type]
    total = bundle + tree
    packages = ", ".join(f"{p['name']} {p['version']}" for p in manifest["packages"])  # type: ignore[union-attr]
    stripped = sum(int(s["bytes"]) for s in manifest["stripped"])  # type: ignore[union-attr]
    fits = total <= LIMIT_MIB * MIB
    return [
        f"device bundle: {bundle / MIB:.1f} MiB ({packages}); "
        f"{stripped / MIB:.1f} MiB of ray stripped",
        f"travelling: working tree {tree / MIB:.1f} MiB + bundle {bundle / MIB:.1f} MiB = "
        f"{total / MIB:.1f} MiB of {LIMIT_MIB:.0f} MiB: {'fits' if fits else 'OVER THE LIMIT'}",
    ], fits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(REPO / ".device-bundle"))
    parser.add_argument("--cache", default=str(REPO / ".device-cache"))
    parser.add_argument("--force", action="store_true", help="rebuild an up-to-date bundle")
    args = parser.parse_args(argv)
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    manifest = build(Path(args.out), cache, force=args.force)
    lines, fits = size_report(manifest, working_tree_bytes())
    print("\n".join(lines))
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
