"""The one logger factory of fleetrl.

Library code calls ``get_logger(__name__)`` and never prints. Entry points (the
CLI, Ray actors, spawned processes) call ``setup_logging`` once so every role
writes the same line format, tagged with the role name.

The console stays quiet: a process may show fewer lines on the console than it
logs (``FLEETRL_CONSOLE_LEVEL``, set for every Ray actor of a run from
``logging.role_console``), and with ``FLEETRL_LOG_DIR`` set every record at the
log level also goes to ``<dir>/<role>.log``. Below DEBUG, Hugging Face progress
bars are off (``HF_HUB_DISABLE_PROGRESS_BARS``), before transformers is imported.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

ROOT = "fleetrl"
_FORMAT = "%(asctime)s %(levelname).1s [%(role)s] %(name)s: %(message)s"
CONSOLE_LEVEL_ENV = "FLEETRL_CONSOLE_LEVEL"  # console threshold (default: the log level)
LOG_DIR_ENV = "FLEETRL_LOG_DIR"  # every record at the log level also goes to <dir>/<role>.log


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


def role_env(console_level: str, log_dir: str | Path) -> dict[str, str]:
    """Environment for a run's role processes: console threshold and per-role log files."""
    return {CONSOLE_LEVEL_ENV: console_level.upper(), LOG_DIR_ENV: str(log_dir)}


def setup_logging(role: str = "main", level: str | None = None) -> None:
    """Configure the fleetrl hierarchy once per process (idempotent)."""
    root = logging.getLogger(ROOT)
    level_name = (level or os.environ.get("FLEETRL_LOG_LEVEL", "INFO")).upper()
    if level_name != "DEBUG":
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    root.setLevel(level_name)
    for handler in list(root.handlers):
        if getattr(handler, "_fleetrl", False):
            root.removeHandler(handler)
            handler.close()
    formatter = logging.Formatter(_FORMAT, datefmt="%H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    handlers[0].setLevel(max(_level(os.environ.get(CONSOLE_LEVEL_ENV)), _level(level_name)))
    if log_dir := os.environ.get(LOG_DIR_ENV):
        path = Path(log_dir) / f"{re.sub(r'[^A-Za-z0-9_.-]', '-', role)}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(path))
    for handler in handlers:
        handler._fleetrl = True  # type: ignore[attr-defined]
        handler.addFilter(_RoleFilter(role))
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.propagate = False


def _level(name: str | None) -> int:
    number = logging.getLevelName(name.upper()) if name else logging.NOTSET
    return number if isinstance(number, int) else logging.NOTSET
