"""A weight-update process group among processes that did not start together.

The learner's rank 0 and every engine rank form their own small group, apart
from the learner's default (FSDP) group, as SGLang's ``init_custom_process_group``
does: a ``TCPStore`` served by the learner, a ``PrefixStore`` named after the
group, and a collective backend built directly on it. Building the backend
object ourselves (``ProcessGroupGloo`` / ``ProcessGroupNCCL``) instead of going
through ``torch.distributed.init_process_group`` means nothing global is
touched: the default group, ``torch.distributed.is_initialized()`` and the
group registry stay exactly as the learner (or the engine) left them.

Timeouts: every collective is waited on with a deadline (``wait``), and the
backend's own timeout is set as well (gloo honours it directly). For NCCL the
watchdog timeout is set ``NCCL_WATCHDOG_GRACE_S`` beyond ours, so our deadline
fires first and we ``abort`` the communicator ourselves, instead of the
watchdog tearing the learner down.

Security: the store listens only on ``master_address`` (a socket bound there is
handed to the store), and gloo's transport is bound to the interface that
reaches the master. NCCL picks its own interfaces (``NCCL_SOCKET_IFNAME``).

Left out: multi-rank engines joining from one process (each engine rank calls
``join_group`` with its own rank).
"""

from __future__ import annotations

import datetime
import socket
import time

import torch
import torch.distributed as dist

from fleetrl.log import get_logger

log = get_logger(__name__)

NCCL_WATCHDOG_GRACE_S = 60.0
_POLL_S = 0.0005


class GroupError(RuntimeError):
    """A collective of the weight-update group failed or ran past its deadline."""


def resolve_backend(backend: str, device: str | torch.device) -> str:
    """``auto`` -> ``nccl`` for a CUDA device, else ``gloo``; nccl on a CPU device is an error."""
    kind = torch.device(device).type
    if backend == "auto":
        return "nccl" if kind == "cuda" else "gloo"
    if backend == "nccl" and kind != "cuda":
        raise ValueError(f"weight_sync.backend 'nccl' needs a CUDA device, got device {device!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight_sync.backend: expected auto, gloo or nccl, got {backend!r}")
    return backend


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


class MasterStore:
    """The TCPStore the learner serves for one group, on a socket bound to ``master_address``.

    The store's server takes over our listening socket (it closes the descriptor
    when the last reference to the store goes), so after handing it over the
    Python socket object lets go of it.
    """

    def __init__(self, master_address: str, timeout_s: float) -> None:
        family = socket.AF_INET6 if ":" in master_address else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.bind((master_address, 0))
            self._sock.listen(128)
            self.port: int = self._sock.getsockname()[1]
            self.store: dist.TCPStore | None = dist.TCPStore(
                master_address,
                self.port,
                None,
                True,
                _timedelta(timeout_s),
                wait_for_workers=False,
                master_listen_fd=self._sock.fileno(),
            )
        except Exception:
            self._sock.close()
            raise
        self._sock.detach()

    def close(self) -> None:
        self.store = None


def connect_store(master_address: str, master_port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the master's TCPStore (raises after ``timeout_s`` if it cannot connect)."""
    return dist.TCPStore(master_address, int(master_port), None, False, _timedelta(timeout_s))


def _local_address_towards(master_address: str) -> str:
    """The local IP this host uses to reach ``master_address`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in master_address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((master_address, 9))
            return probe.getsockname()[0]
        except OSError:
            return master_address


class WeightGroup:
    """One rank's membership in a weight-update group; rank 0 is the learner."""

    def __init__(
        self,
        store: dist.Store,
        *,
        group_name: str,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        master_address: str,
        device: str | torch.device = "cpu",
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size} ({group_name})")
        self.group_name = group_name
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self.device = torch.device(device)
        self._store = store  # the master keeps its server alive through this reference
        prefixed = dist.PrefixStore(group_name, store)
        if backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = _timedelta(timeout_s)
            options._devices = [
                dist.ProcessGroupGloo.create_device(hostname=_local_address_towards(master_address))
            ]
            self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
        elif backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = _timedelta(timeout_s + NCCL_WATCHDOG_GRACE_S)
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            raise ValueError(f"unsupported weight-sync backend {backend!r}")
        self.closed = False

    def broadcast(self, flat: torch.Tensor, src: int = 0) -> dist.Work:
        """Start a broadcast of a tensor from ``src`` (all ranks call it); returns the Work."""
        if self.closed:
            raise GroupError(f"group {self.group_name} is closed")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = _timedelta(self.timeout_s)
        return self._pg.broadcast([flat], opts)

    def wait(self, work: dist.Work, what: str, deadline: float | None = None) -> None:
        """Block until ``work`` is done; GroupError on failure or past ``deadline`` (monotonic)."""
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        try:
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise GroupError(
                        f"{what}: no completion within {self.timeout_s:.1f}s in group {self.group_name}"
                    )
                time.sleep(_POLL_S)
            work.wait()
        except RuntimeError as err:  # gloo/nccl report peer failures as RuntimeError
            if isinstance(err, GroupError):
                raise
            raise GroupError(f"{what} failed in group {self.group_name}: {err}") from err
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def close(self, *, abort: bool = False) -> None:
        """Leave the group. ``abort`` drops in-flight collectives (peers see an error at once)."""
        if self.closed:
            return
        self.closed = True
        try:
            if abort:
                self._pg.abort()
            else:
                self._pg.shutdown()
        except RuntimeError as err:  # a backend without abort/shutdown support: drop it anyway
            log.warning("closing weight group %s: %s", self.group_name, err)
        self._pg = None  # type: ignore[assignment]
        self._store = None  # type: ignore[assignment]
