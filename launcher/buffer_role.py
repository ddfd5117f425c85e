"""The buffer role: the Ray actor around ``buffer.service.BufferService`` (launcher/roles.py)."""

from __future__ import annotations

import os
from typing import Any

from fleetrl.log import setup_logging
from launcher.roles import node_ip, role_config


class BufferRole:
    """The buffer service. A restart passes the first start's addresses so clients reconnect."""

    def __init__(
        self,
        raw: dict[str, Any],
        bank_dir: str,
        local: bool,
        curve: Any = None,
        addresses: tuple[str, str] | None = None,
    ):
        from buffer.service import BufferService

        cfg = role_config(raw)
        setup_logging("buffer", cfg.logging.level)
        host = node_ip(local)
        ingest, control = addresses or (f"tcp://{host}:0", f"tcp://{host}:0")
        self.service = BufferService(
            cfg.buffer,
            ingest_address=ingest,
            control_address=control,
            bank_dir=bank_dir,
            curve=curve,
            groups_per_version=cfg.groups_per_version,
            max_concurrent_groups=cfg.rollout.max_concurrent_groups,
        )

    def start(self) -> tuple[str, str]:
        return self.service.start()

    def pid(self) -> int:
        return os.getpid()

    def stats(self) -> dict[str, float]:
        if self.service.failure is not None:
            raise RuntimeError(f"buffer service failed: {self.service.failure!r}")
        return self.service.stats()

    def stop(self) -> None:
        self.service.stop()
