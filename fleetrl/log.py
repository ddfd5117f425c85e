"""The one logger factory of fleetrl.

Library code calls ``get_logger(__name__)`` and never prints. Entry points (the
CLI, Ray actors, spawned processes) call ``setup_logging`` once so every role
writes the same line format, tagged with the role name.
"""

from __future__ import annotations

import logging
import os
import sys

ROOT = "fleetrl"
_FORMAT = "%(asctime)s %(levelname).1s [%(role)s] %(name)s: %(message)s"


class _RoleFilter(logging.Filter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def filter(self, record: logging.LogRecord) -> bool:
        record.role = self.role
        return True


def get_logger(name: str) -> logging.Logger:
    """A logger under the ``fleetrl`` hierarchy (module names are prefixed)."""
    if name == ROOT or name.startswith(ROOT + "."):
        return logging.getLogger(name)
    return logging.getLogger(f"{ROOT}.{name}")


def setup_logging(role: str = "main", level: str | None = None) -> None:
    """Configure the fleetrl hierarchy once per process (idempotent)."""
    root = logging.getLogger(ROOT)
    level_name = (level or os.environ.get("FLEETRL_LOG_LEVEL", "INFO")).upper()
    root.setLevel(level_name)
    for handler in list(root.handlers):
        if getattr(handler, "_fleetrl", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._fleetrl = True  # type: ignore[attr-defined]
    handler.addFilter(_RoleFilter(role))
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.propagate = False
