"""Run by every Python process whose PYTHONPATH starts with this folder: switches on
``bench.gpu.import_guard`` (its ``guard_env`` sets that up). Not a package: a site hook."""

import sys
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[3])
if _REPO not in sys.path:
    sys.path.append(_REPO)

from bench.gpu.import_guard import install  # noqa: E402

install()
