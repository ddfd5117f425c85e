"""Make a run on this machine refuse the packages the GPU check's machine does not have.

That machine: one H200, Python 3.12, torch 2.11, no package registry (docs/gpu_check.md).

The CPU check (``scripts/gpu_check.py --device cpu``) runs every stage here, where the
virtualenv also holds wandb, fastapi, pydantic, uvicorn, SGLang and more that the GPU
machine lacks (and the bundle does not carry). With the guard, importing one of them from
fleetrl's code or from a bundled package fails as it would there, in every process the
check starts (stage processes, Ray's workers and actors, engines): a path of the check
that needs one fails here first.

``denied_modules`` lists the top-level modules of every installed distribution that is
neither on the machine (``bench.gpu.machine_packages``) nor in the bundle; ``guard_env``
gives the environment that switches the guard on in child processes: ``SITE_DIR`` (a
``sitecustomize.py`` that calls ``install``) first on PYTHONPATH, the denied names, the
machine's own top-level modules, and a log file where every refused import is written
with the place that asked (an optional import a library survives, Ray probing for
opencensus say, is refused as there and only logged).

The denied modules are hidden from site-packages' own finder (``HidingFinder``), so that
``import`` fails and ``importlib.util.find_spec`` answers None, exactly as where they are
absent (Ray's vendored yarl probes for pydantic_core that way); copies vendored inside an
allowed package (Ray's ``thirdparty_files``) are other path entries and load as they do
there. A package that is on the machine brings its own dependencies there: this
virtualenv's huggingface_hub may need a module the machine's older one does not, so what
a machine package imports (and what that imports in turn) is let through.
Left out: version differences between this machine's packages and the GPU machine's.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import os
import sys
import sysconfig
from collections.abc import Mapping
from pathlib import Path

DENY_ENV = "FLEETRL_IMPORT_GUARD_DENY"
MACHINE_ENV = "FLEETRL_IMPORT_GUARD_MACHINE"
LOG_ENV = "FLEETRL_IMPORT_GUARD_LOG"
SITE_DIR = Path(__file__).resolve().parent / "guard_site"
PROJECT = "fleetrl"  # the project's own distribution (its code travels as the working tree)


def module_owners() -> dict[str, set[str]]:
    """Top-level module -> the normalized distributions installed here that provide it."""
    from bench.gpu.machine_packages import canonical

    owners: dict[str, set[str]] = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        if module.isidentifier() and not module.startswith("__editable__"):
            owners.setdefault(module, set()).update(canonical(d) for d in dists)
    return owners


def denied_modules() -> tuple[list[str], list[str]]:
    """(modules only denied distributions provide, modules of the machine's distributions)."""
    from bench.gpu.machine_packages import read_machine_packages, resolve

    machine = read_machine_packages()
    allowed = machine | resolve(machine=machine).bundled | {PROJECT}
    owners = module_owners()
    denied = sorted(m for m, dists in owners.items() if not (dists & allowed))
    return denied, sorted(m for m, dists in owners.items() if dists & machine)


def guard_env(env: Mapping[str, str], log_path: Path) -> dict[str, str]:
    """``env`` with the guard switched on for every Python process started with it."""
    denied, machine = denied_modules()
    path = os.pathsep.join(p for p in (str(SITE_DIR), env.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": path, DENY_ENV: ",".join(denied),
            MACHINE_ENV: ",".join(machine), LOG_ENV: str(log_path)}  # fmt: skip


def _site_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(sorted({str(Path(paths[k]).resolve()) for k in ("purelib", "platlib")}))


class DeviceImportGuard:
    """What the machine lacks, hidden from site-packages: ``denied`` top-level modules are not
    found there (so ``import`` raises ModuleNotFoundError and ``importlib.util.find_spec``
    gives None, as on the machine), unless a package of the machine, or a module it let in,
    asks for them."""

    def __init__(self, denied: set[str], machine: set[str], log_path: str | None) -> None:
        self.denied = denied
        self.let_in = set(machine)  # importers whose imports pass: the machine's packages
        self.log_path = log_path
        self.site_dirs = _site_dirs()

    def hides(self, fullname: str) -> bool:
        """Whether a search of site-packages for ``fullname`` finds nothing (logged)."""
        if "." in fullname or fullname not in self.denied:
            return False
        filename, line = _caller()
        if self._site_module(filename) in self.let_in:
            self.let_in.add(fullname)  # a machine package's own dependency, and its imports
            return False
        if self.log_path:
            with open(self.log_path, "a") as log:
                log.write(f"{os.getpid()} {fullname} {filename}:{line} {' '.join(sys.argv[:2])}\n")
        return True

    def _site_module(self, filename: str) -> str | None:
        """The top-level module a file in site-packages belongs to (None: not in there)."""
        place = Path(filename).resolve()
        for site in self.site_dirs:
            if place.is_relative_to(site) and place != Path(site):
                return place.relative_to(site).parts[0].split(".", 1)[0]
        return None


class HidingFinder:
    """The path-entry finder of one site-packages folder, less what the guard hides."""

    def __init__(self, inner: importlib.abc.PathEntryFinder, guard: DeviceImportGuard) -> None:
        self.inner = inner
        self.guard = guard

    def find_spec(self, fullname: str, target: object = None):
        if self.guard.hides(fullname):
            return None
        return self.inner.find_spec(fullname, target)

    def invalidate_caches(self) -> None:
        self.inner.invalidate_caches()

    def __getattr__(self, name: str):  # e.g. FileFinder.path, used by pkgutil
        return getattr(self.inner, name)


def _caller() -> tuple[str, int]:
    """The file and line of the import statement being run (outside importlib and here);
    frames are walked, not formatted: this runs inside every hidden import."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if "importlib" not in filename and filename != __file__:
            return filename, frame.f_lineno
        frame = frame.f_back
    return "?", 0


def _path_finder(entry: str) -> importlib.abc.PathEntryFinder | None:
    """The finder the import system would make for ``entry`` (its path hooks, in order)."""
    for hook in sys.path_hooks:
        try:
            return hook(entry)
        except ImportError:
            continue
    return None


def install() -> None:
    """Wrap every site-packages folder's finder when the environment asks for the guard."""
    denied = {name for name in os.environ.get(DENY_ENV, "").split(",") if name}
    if not denied:
        return
    machine = {name for name in os.environ.get(MACHINE_ENV, "").split(",") if name}
    guard = DeviceImportGuard(denied, machine, os.environ.get(LOG_ENV))
    for entry in sys.path:
        if not entry or str(Path(entry).resolve()) not in guard.site_dirs:
            continue
        finder = sys.path_importer_cache.get(entry) or _path_finder(entry)
        if finder is not None and not isinstance(finder, HidingFinder):
            sys.path_importer_cache[entry] = HidingFinder(finder, guard)
