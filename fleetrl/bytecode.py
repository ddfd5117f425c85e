"""fleetrl's own modules compiled to byte-code, as pip compiles an installed package.

An editable install (``pip install -e .``, what ``make venv`` does) leaves the project's
modules uncompiled. Python compiles and caches each at its first import, unless
``PYTHONDONTWRITEBYTECODE`` is set (containers and CI machines often set it): then every
process of every run compiles them again, about a second of CPU per role process on two
cores. ``make venv`` and the demos compile them first (``python -m fleetrl.bytecode``), and
so does ``fleetrl bench vs-trl`` before it times whole commands, whose baseline's packages
pip compiled at install. Only files whose byte-code is missing or stale are compiled.
"""

from __future__ import annotations

import importlib.util
import py_compile
import sys
from pathlib import Path

from fleetrl.log import get_logger

log = get_logger(__name__)

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fleetrl", "launcher", "learner", "rollout_fleet", "buffer", "weight_sync")


def _stale(source: Path) -> bool:
    cached = Path(importlib.util.cache_from_source(str(source)))
    return not cached.exists() or cached.stat().st_mtime < source.stat().st_mtime


def compile_packages(root: Path = ROOT) -> bool:
    """Compile every package's modules whose byte-code is missing or stale; True when all
    compiled (each file that does not is logged with its error)."""
    ok = True
    for name in PACKAGES:
        for source in sorted((root / name).rglob("*.py")):
            if not _stale(source):
                continue
            try:
                py_compile.compile(str(source), doraise=True)
            except (py_compile.PyCompileError, OSError) as err:
                log.warning("%s did not compile to byte-code: %s", source, err)
                ok = False
    return ok


if __name__ == "__main__":
    sys.exit(0 if compile_packages() else 1)
