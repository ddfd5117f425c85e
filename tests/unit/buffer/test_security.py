"""Loopback detection and the rule that nothing binds off loopback without CURVE."""

from __future__ import annotations

import pytest

from buffer.security import InsecureBindError, check_bind_allowed, is_loopback, make_run_keys


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.0.0.2:0", True),
        ("tcp://localhost:1", True),
        ("tcp://[::1]:5555", True),
        ("ipc:///tmp/x", True),
        ("inproc://x", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://10.0.0.3:5555", False),
        ("tcp://eth0:5555", False),
    ],
)
def test_is_loopback(address, loopback):
    assert is_loopback(address) is loopback


def test_off_loopback_bind_requires_curve():
    with pytest.raises(InsecureBindError, match="CURVE"):
        check_bind_allowed("tcp://0.0.0.0:5555", None)
    server, _ = make_run_keys(1)
    check_bind_allowed("tcp://0.0.0.0:5555", server)
    check_bind_allowed("tcp://127.0.0.1:5555", None)


def test_run_keys_allow_exactly_the_clients_made():
    server, clients = make_run_keys(3)
    assert server.allowed_clients == tuple(c.public for c in clients)
    assert all(c.server_public == server.public for c in clients)
    assert len({c.public for c in clients}) == 3
