"""The fleet control endpoint of a running job: what `fleetrl fleet scale` and `fleetrl fleet
status` reach.

The rollout role binds one ZeroMQ ROUTER socket (loopback on a local instance, the node's
IP on a cluster) with CURVE on, loopback included: its ZAP handler admits only the client
key made for this run (``buffer.security``), so a process that learns the address is
refused at the handshake. The driver makes the keys (``make_control_keys``) and writes the
client's half with the address into ``<run dir>/fleet_control.json``, created with mode
0600 (``write_control_file``): whoever may read the run directory may steer the run, and
the keys travel to the role through Ray, never on a command line or in a log.

One request, one reply, as msgpack-encoded msgspec structs with a ``type`` tag and a
schema version (``ScaleRequest`` / ``StatusRequest`` -> ``ScaleReply`` / ``StatusReply``
/ ``ErrorReply``); a frame that does not decode is answered with an ``ErrorReply`` (when
its sender is known) and logged, never fatal. Requests are answered one at a time by
``handle`` (the rollout role runs it on its event loop).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq

from buffer.security import (
    CurveClientKeys,
    CurveServerKeys,
    apply_client,
    apply_server,
    make_run_keys,
    start_authenticator,
)
from fleetrl.log import get_logger

log = get_logger(__name__)

CONTROL_FILE = "fleet_control.json"
CONTROL_SCHEMA = 1
MAX_REQUEST_BYTES = 64 * 1024
POLL_MS = 200
FLEETS = ("rollout", "reward")


# ---- messages ----------------------------------------------------------------------------
class ScaleRequest(msgspec.Struct, tag="scale", tag_field="type", kw_only=True):
    """Aim ``fleet`` ("rollout" | "reward") at ``engines`` engines."""

    schema: int = CONTROL_SCHEMA
    fleet: str
    engines: int


class StatusRequest(msgspec.Struct, tag="status", tag_field="type", kw_only=True):
    schema: int = CONTROL_SCHEMA


class EngineRow(msgspec.Struct, kw_only=True):
    """One engine as ``fleetrl fleet status`` shows it."""

    name: str
    state: str
    node: str = ""
    version: int | None = None
    needs_version: int | None = None
    in_flight: int = 0  # requests (rollout) or batches (reward) on it now
    groups: int = 0  # rollout groups pinned to it
    reason: str = ""


class FleetState(msgspec.Struct, kw_only=True):
    fleet: str
    elastic: bool
    target: int
    min_engines: int
    max_engines: int
    serving: int
    engines: list[EngineRow] = []
    joins: int = 0
    leaves: int = 0
    lost: int = 0


class StatusReply(msgspec.Struct, tag="status", tag_field="type", kw_only=True):
    schema: int = CONTROL_SCHEMA
    policy_version: int = 0
    fleets: list[FleetState] = []


class ScaleReply(msgspec.Struct, tag="scaled", tag_field="type", kw_only=True):
    schema: int = CONTROL_SCHEMA
    fleet: str
    previous: int
    target: int
    min_engines: int
    max_engines: int
    serving: int


class ErrorReply(msgspec.Struct, tag="error", tag_field="type", kw_only=True):
    schema: int = CONTROL_SCHEMA
    message: str


ControlRequest = ScaleRequest | StatusRequest
ControlReply = StatusReply | ScaleReply | ErrorReply
_ENCODER = msgspec.msgpack.Encoder()
_REQUESTS = msgspec.msgpack.Decoder(ControlRequest)
_REPLIES = msgspec.msgpack.Decoder(ControlReply)


class ControlError(RuntimeError):
    """The run's control endpoint could not be reached, or answered nothing usable."""


# ---- keys and the control file -------------------------------------------------------------
def make_control_keys() -> tuple[CurveServerKeys, CurveClientKeys]:
    """A server key pair for the endpoint and the one client key pair it admits."""
    server, (client,) = make_run_keys(1)
    return server, client


def write_control_file(run_dir: str | Path, address: str, client: CurveClientKeys) -> Path:
    """``<run dir>/fleet_control.json`` (mode 0600): where the endpoint listens and the
    client keys that it admits."""
    path = Path(run_dir) / CONTROL_FILE
    tmp = path.with_suffix(".tmp")
    body = {
        "address": address,
        "server_public": client.server_public.decode("ascii"),
        "client_public": client.public.decode("ascii"),
        "client_secret": client.secret.decode("ascii"),
    }
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # an older file of another mode is replaced, not reused
        json.dump(body, f)
    os.replace(tmp, path)
    return path


def read_control_file(run_dir: str | Path) -> tuple[str, CurveClientKeys]:
    """The endpoint's address and the client keys, from a run directory."""
    path = Path(run_dir) / CONTROL_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: no run is training in {run_dir} (the file exists while a run "
            "started with fleetrl train is up)"
        )
    try:
        body = json.loads(path.read_text())
        keys = CurveClientKeys(
            public=body["client_public"].encode("ascii"),
            secret=body["client_secret"].encode("ascii"),
            server_public=body["server_public"].encode("ascii"),
        )
        return str(body["address"]), keys
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path}: not a fleet control file ({err!r})") from None


# ---- the endpoint ----------------------------------------------------------------------------
class ControlServer:
    """A ROUTER socket on its own thread answering control requests through ``handle``."""

    def __init__(
        self, keys: CurveServerKeys, host: str, handle: Callable[[ControlRequest], ControlReply]
    ) -> None:
        self._keys = keys
        self._host = host
        self._handle = handle
        self._context = zmq.Context()
        self._auth = start_authenticator(self._context, keys)
        self._socket: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.address = ""
        self.requests = 0
        self.bad_frames = 0

    def start(self) -> str:
        """Bind and start answering; the address clients connect to."""
        sock = self._context.socket(zmq.ROUTER)
        apply_server(sock, self._keys)  # before bind: CURVE applies to the listener
        sock.maxmsgsize = MAX_REQUEST_BYTES
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.linger = 0
        port = sock.bind_to_random_port(f"tcp://{self._host}")
        self._socket = sock
        self.address = f"tcp://{self._host}:{port}"
        self._thread = threading.Thread(target=self._serve, name="fleet-control", daemon=True)
        self._thread.start()
        log.info("fleet control endpoint on %s (CURVE, this run's client key only)", self.address)
        return self.address

    def _serve(self) -> None:
        sock = self._socket
        assert sock is not None
        while not self._stop.is_set():
            if not sock.poll(POLL_MS):
                continue
            frames = sock.recv_multipart()
            if len(frames) != 2:
                self.bad_frames += 1
                log.warning("fleet control: dropped a message of %d frames", len(frames))
                continue
            identity, payload = frames
            try:
                reply = self._answer(payload)
            except Exception as err:  # noqa: BLE001 - a failing handler answers, never kills the thread
                log.error("fleet control: request failed: %r", err)
                reply = ErrorReply(message=f"the run could not answer: {err}")
            try:
                sock.send_multipart([identity, _ENCODER.encode(reply)])
            except zmq.ZMQError as err:  # the client went away
                log.info("fleet control: reply not delivered: %s", err)

    def _answer(self, payload: bytes) -> ControlReply:
        try:
            request = _REQUESTS.decode(payload)
        except msgspec.DecodeError as err:
            self.bad_frames += 1
            log.warning("fleet control: dropped a request that does not decode: %s", err)
            return ErrorReply(message=f"request does not decode: {err}")
        if request.schema != CONTROL_SCHEMA:
            return ErrorReply(message=f"request schema {request.schema}, this run speaks {CONTROL_SCHEMA}")  # fmt: skip
        self.requests += 1
        return self._handle(request)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._socket is not None:
            self._socket.close(linger=0)
        self._auth.stop()
        self._context.term()


def call(run_dir: str | Path, request: ControlRequest, timeout_s: float = 30.0) -> ControlReply:
    """Send ``request`` to the run in ``run_dir``; its reply (``ControlError`` if none came)."""
    address, keys = read_control_file(run_dir)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    try:
        apply_client(sock, keys)
        sock.linger = 0
        sock.connect(address)
        sock.send(_ENCODER.encode(request))
        if not sock.poll(int(timeout_s * 1000)):
            raise ControlError(
                f"the run at {address} did not answer within {timeout_s:.0f}s (is it still "
                "training? a stale fleet_control.json outlives a killed run)"
            )
        return _REPLIES.decode(sock.recv())
    except msgspec.DecodeError as err:
        raise ControlError(f"the run at {address} answered something unreadable: {err}") from None
    finally:
        sock.close(linger=0)
        context.term()
