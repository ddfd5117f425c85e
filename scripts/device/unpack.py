"""Unpack the device bundle on the GPU machine: a site folder to put on PYTHONPATH.

    site=$(python3 scripts/device/unpack.py .device-bundle --to /tmp/fleetrl-site)
    export PYTHONPATH="$site:$PWD"

Standard library only (the machine has no package registry and nothing of fleetrl's is
installed yet). It checks the interpreter is the one the bundle was built for (Python 3.12),
checks the tarball against the manifest's sha256, extracts it with tarfile's ``data``
filter (no absolute paths, links or device files), compiles it to byte-code with every core
(the check starts many Python processes that would otherwise each compile Ray), checks
that every bundled top-level module can be found, and says which requirements of the
bundled packages the machine must meet itself and whether it has them (a version check
where ``packaging``, which the machine has, can be imported). Progress goes to stderr; the
site path is the one line on stdout. Exit status 2: wrong interpreter, a corrupt or
missing bundle, a bundled module not found.

Left out: installing anything into the machine's own environment (the site is a folder;
nothing outside it changes).
"""

from __future__ import annotations

import argparse
import compileall
import hashlib
import importlib.metadata
import importlib.util
import json
import sys
import tarfile
import time
from pathlib import Path

MANIFEST = "manifest.json"


class BundleError(Exception):
    """The bundle cannot be used here (one line saying why)."""


def _say(line: str) -> None:
    print(f"device-unpack: {line}", file=sys.stderr, flush=True)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(bundle: Path) -> dict:
    path = bundle / MANIFEST
    if not path.is_file():
        raise BundleError(f"{path} not found: build the bundle with `make device-bundle`")
    return json.loads(path.read_text())


def check_interpreter(manifest: dict) -> None:
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if here != manifest["python"]:
        raise BundleError(
            f"the bundle is built for Python {manifest['python']}, this is Python {here} "
            f"({sys.executable})"
        )


def extract(bundle: Path, manifest: dict, site: Path) -> int:
    """Check and extract the tarball into ``site``; the number of files."""
    tarball = bundle / manifest["tarball"]
    if not tarball.is_file():
        raise BundleError(f"{tarball} not found (carry the whole .device-bundle folder)")
    if sha256(tarball) != manifest["tarball_sha256"]:
        raise BundleError(f"{tarball} does not match its manifest's sha256: rebuild it")
    site.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball, "r:xz") as tar:
        members = tar.getmembers()
        if hasattr(tarfile, "data_filter"):
            tar.extractall(site, filter="data")
        else:  # before 3.12 (tests here): the same names, checked by hand
            for member in members:
                if member.name.startswith("/") or ".." in Path(member.name).parts:
                    raise BundleError(f"{tarball}: unsafe member {member.name!r}")
            tar.extractall(site)
    return len(members)


def missing_modules(manifest: dict, site: Path) -> list[str]:
    """Bundled top-level modules that the site (first on the path) does not provide."""
    sys.path.insert(0, str(site))
    try:
        missing = []
        for package in manifest["packages"]:
            for module in package["modules"]:
                spec = importlib.util.find_spec(module)
                places = [] if spec is None else [spec.origin or ""]
                places += list(spec.submodule_search_locations or []) if spec else []
                if not any(place.startswith(str(site)) for place in places):
                    missing.append(f"{module} ({package['name']})")
        return missing
    finally:
        sys.path.remove(str(site))


def machine_requirements(manifest: dict) -> list[str]:
    """One line per requirement the machine must meet: what it has, or that it lacks it."""
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:
        SpecifierSet = None  # noqa: N806 (the name packaging gives it)
    lines = []
    for req in manifest["on_machine"]:
        wanted = f"{req['name']}{req['specifier']} (needed by {req['needed_by']})"
        try:
            version = importlib.metadata.version(req["name"])
        except importlib.metadata.PackageNotFoundError:
            lines.append(f"MISSING {wanted}")
            continue
        ok = SpecifierSet is None or SpecifierSet(req["specifier"]).contains(
            version, prereleases=True
        )
        lines.append(f"{'ok' if ok else 'WRONG VERSION'} {req['name']} {version}: {wanted}")
    return lines


def unpack(bundle: Path, site: Path, *, compile_site: bool = True) -> Path:
    started = time.monotonic()
    manifest = read_manifest(bundle)
    check_interpreter(manifest)
    files = extract(bundle, manifest, site)
    _say(f"{files} files from {bundle / manifest['tarball']} into {site}")
    if compile_site:
        compileall.compile_dir(str(site), quiet=2, workers=0)
        _say(f"compiled to byte-code ({time.monotonic() - started:.1f} s so far)")
    missing = missing_modules(manifest, site)
    if missing:
        raise BundleError(f"bundled modules not found in {site}: {', '.join(missing)}")
    for line in machine_requirements(manifest):
        _say(f"machine: {line}")
    packages = ", ".join(f"{p['name']} {p['version']}" for p in manifest["packages"])
    _say(f"ready in {time.monotonic() - started:.1f} s: {packages}")
    return site


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("bundle", nargs="?", default=".device-bundle")
    parser.add_argument("--to", default="/tmp/fleetrl-site", help="the site folder to create")
    parser.add_argument("--no-compile", action="store_true", help="skip byte-compiling")
    args = parser.parse_args(argv)
    try:
        site = unpack(Path(args.bundle), Path(args.to), compile_site=not args.no_compile)
    except BundleError as err:
        _say(str(err))
        return 2
    print(site.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
