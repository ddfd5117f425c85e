"""CURVE keys and authentication for every buffer socket, and the loopback-only bind rule.

Off loopback every socket uses CURVE (DESIGN §4): the driver makes one server
key pair and one key pair per client for each run (``make_run_keys``), gives
the server its secret plus the clients' public keys and each client its own
pair plus the server's public key. The server runs a ZAP authenticator on its
own ZeroMQ context that admits only those client public keys, so a process
that merely knows the address (or the server's public key) is refused at the
handshake. Keys are Z85 text bytes: plain data that passes through Ray.

``check_bind_allowed`` refuses to bind anything but loopback (or ipc/inproc)
without CURVE. CURVE also works on loopback, which is how the tests exercise it.

Left out: key rotation within a run, certificates on disk (keys live in memory).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field

import zmq
import zmq.auth.thread

from fleetrl.log import get_logger

log = get_logger(__name__)

ZAP_DOMAIN = "fleetrl"


class InsecureBindError(ValueError):
    """Binding off loopback without CURVE keys."""


@dataclass(frozen=True)
class CurveServerKeys:
    public: bytes
    secret: bytes
    allowed_clients: tuple[bytes, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class CurveClientKeys:
    public: bytes
    secret: bytes
    server_public: bytes


def make_run_keys(num_clients: int) -> tuple[CurveServerKeys, list[CurveClientKeys]]:
    """A fresh server key pair and ``num_clients`` client key pairs allowed to connect."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support")
    server_public, server_secret = zmq.curve_keypair()
    clients = []
    for _ in range(num_clients):
        public, secret = zmq.curve_keypair()
        clients.append(CurveClientKeys(public, secret, server_public))
    server = CurveServerKeys(server_public, server_secret, tuple(c.public for c in clients))
    return server, clients


class _AllowList:
    """ZAP credentials provider: a client is admitted iff its public key is listed."""

    def __init__(self, allowed: Iterable[bytes]) -> None:
        self.allowed = frozenset(allowed)
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.allowed
        if not ok:
            self.refused += 1
            log.warning("CURVE client refused (key not in this run's allow list): %s", key[:8])
        return ok


def start_authenticator(
    context: zmq.Context, keys: CurveServerKeys
) -> zmq.auth.thread.ThreadAuthenticator:
    """Run a ZAP handler on ``context`` that admits only ``keys.allowed_clients``."""
    auth = zmq.auth.thread.ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_AllowList(keys.allowed_clients))
    return auth


def refused_clients(auth: zmq.auth.thread.ThreadAuthenticator) -> int:
    provider = auth.credentials_providers.get(ZAP_DOMAIN)
    return provider.refused if isinstance(provider, _AllowList) else 0


def apply_server(socket: zmq.Socket, keys: CurveServerKeys) -> None:
    socket.zap_domain = ZAP_DOMAIN.encode()
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_server = True


def apply_client(socket: zmq.Socket, keys: CurveClientKeys) -> None:
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_serverkey = keys.server_public


def is_loopback(address: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on 127.0.0.0/8, ::1 or localhost."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name or a host name: not provably loopback
        return False


def check_bind_allowed(address: str, curve: CurveServerKeys | None) -> None:
    if curve is None and not is_loopback(address):
        raise InsecureBindError(
            f"refusing to bind {address} without CURVE: off loopback every socket must be "
            "authenticated (give the service CurveServerKeys from make_run_keys)"
        )
