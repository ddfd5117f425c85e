"""A BufferService on loopback ports chosen by the OS, stopped after each test."""

from __future__ import annotations

import pytest
import zmq

from buffer.config import BufferConfig
from buffer.service import BufferService


@pytest.fixture
def start_service(tmp_path):
    started: list[BufferService] = []

    def start(
        config: BufferConfig | None = None, *, curve=None, bank_dir=None, **kw
    ) -> BufferService:
        service = BufferService(
            config or BufferConfig(),
            ingest_address="tcp://127.0.0.1:0",
            control_address="tcp://127.0.0.1:0",
            bank_dir=bank_dir or tmp_path / f"bank{len(started)}",
            curve=curve,
            groups_per_version=kw.get("groups_per_version", 2),
            max_concurrent_groups=kw.get("max_concurrent_groups", 8),
        )
        service.start()
        started.append(service)
        return service

    yield start
    for service in started:
        service.stop()


@pytest.fixture
def zmq_context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)
