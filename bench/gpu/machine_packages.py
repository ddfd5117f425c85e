"""What the GPU machine has, what fleetrl's GPU check needs there, and what must travel.

The machine: one H200, Python 3.12, torch 2.11, no package registry (docs/gpu_check.md).
``h200_packages.txt`` (beside this file) lists the distributions the machine already has;
``ROOTS`` are the ones the check imports there that it lacks. ``resolve`` walks their
requirements as they apply on the machine (CPython 3.12 on x86-64 Linux, ``TARGET_MARKERS``)
and splits them into what the bundle must carry (pinned at this environment's versions:
the ones the tests ran) and what the machine's own packages must satisfy.
``scripts/device/bundle.py`` builds the bundle from that; ``bench.gpu.import_guard`` makes a
CPU run refuse every other distribution, as the machine would.

Left out: version checks against the machine's own packages (their versions are known only
there: ``scripts/device/unpack.py`` checks them on arrival).
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

MACHINE_PACKAGES = Path(__file__).resolve().parent / "h200_packages.txt"
# What fleetrl's GPU check imports there that the machine lacks: ray (placement, actors),
# pyzmq (the buffer's sockets), msgspec (every wire type and config struct).
ROOTS = ("ray", "pyzmq", "msgspec")
PYTHON_VERSION = "3.12"
# PEP 508 marker values of the machine's interpreter (a dependency's marker is read for it,
# not for the Python that builds the bundle).
TARGET_MARKERS = {
    "python_version": PYTHON_VERSION,
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}


@dataclass(frozen=True)
class Pin:
    """One bundled distribution: its name, version and who needed it."""

    name: str
    version: str
    needed_by: str


@dataclass
class Resolution:
    pins: list[Pin] = field(default_factory=list)
    # requirements the machine meets with its own packages: {name, specifier, needed_by}
    on_machine: list[dict[str, str]] = field(default_factory=list)

    @property
    def bundled(self) -> set[str]:
        return {pin.name for pin in self.pins}


def canonical(name: str) -> str:
    """PEP 503 normalized name (``packaging.utils.canonicalize_name`` without the import)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_machine_packages(path: Path = MACHINE_PACKAGES) -> set[str]:
    """Normalized distribution names, one per line (``#`` starts a comment)."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(canonical(line))
    return names


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def requirements_of(name: str) -> list[tuple[str, str]]:
    """(normalized name, specifier) of the installed distribution's requirements that apply
    on the machine (no extras)."""
    from packaging.requirements import Requirement

    reqs = []
    for text in importlib.metadata.requires(name) or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(TARGET_MARKERS):
            reqs.append((canonical(req.name), str(req.specifier)))
    return reqs


def resolve(roots: tuple[str, ...] = ROOTS, machine: set[str] | None = None) -> Resolution:
    """Walk ``roots`` and their requirements; pin (at this environment's versions) what the
    machine lacks, and record what it must provide itself."""
    machine = read_machine_packages() if machine is None else machine
    resolution = Resolution()
    queue = [(canonical(r), "fleetrl") for r in roots]
    seen: set[str] = set()
    while queue:
        name, needed_by = queue.pop(0)
        if name in seen:
            continue
        seen.add(name)
        version = installed_version(name)
        if version is None:
            raise SystemExit(
                f"device bundle: {name} (needed by {needed_by}) is not installed in this "
                f"environment ({sys.executable}); run `make venv` first"
            )
        resolution.pins.append(Pin(name, version, needed_by))
        for dep, specifier in requirements_of(name):
            if dep in machine:
                resolution.on_machine.append(
                    {"name": dep, "specifier": specifier, "needed_by": name}
                )
            elif dep not in seen:
                queue.append((dep, name))
    return resolution
