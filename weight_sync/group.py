"""A weight-update process group among processes that did not start together.

The learner's rank 0 and every engine rank form their own small group, apart
from the learner's default (FSDP) group, the way SGLang's
``init_custom_process_group`` forms it (every engine rank calls that function
with ``init_method="tcp://addr:port"``): a ``TCPStore`` served by the learner,
a ``PrefixStore`` named after the group, and torch's
``_new_process_group_helper``. The default group and
``torch.distributed.is_initialized()`` stay as the learner left them; the group
is registered by name in torch's registry until it is closed.

Timeouts: every collective is waited on with a deadline (``wait``), and the
backend's own timeout is set as well (gloo honours it directly). For NCCL the
watchdog timeout is set ``NCCL_WATCHDOG_GRACE_S`` beyond ours, so our deadline
fires first and we ``abort`` the communicator ourselves, instead of the
watchdog tearing the learner down.

Security: the store listens only on ``master_address`` (a socket bound there is
handed to the store). Gloo and NCCL pick their transport interfaces as they do
on the engine side (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``): the group
belongs on a private network, like Ray's and torch.distributed's own stores.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from typing import Any

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


def gloo_backend(
    store: dist.Store, rank: int, world_size: int, timeout_s: float
) -> dist.ProcessGroupGloo:
    """A gloo process group on ``store`` with ``timeout_s`` on every collective."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = _timedelta(timeout_s)
    options._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def broadcast_options(src: int, timeout_s: float) -> dist.BroadcastOptions:
    """A broadcast from rank ``src`` that gives up after ``timeout_s``."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    opts.timeout = _timedelta(timeout_s)
    return opts


def _sglang_style_group(
    store: dist.Store,
    group_name: str,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    *,
    register: bool,
) -> dist.ProcessGroup:
    """The torch calls of SGLang's ``init_custom_process_group`` after its rendezvous.

    ``register=True`` goes through torch's ``_new_process_group_helper`` exactly as
    SGLang does (the group is then in torch's registry under ``group_name`` until
    ``WeightGroup.close``). ``register=False`` builds the same store prefixes
    (``group_name``, ``"{group_name}/"``, ``"{device}/"``) and backend without the
    registry, for an engine rank living in a process that may also hold rank 0 of
    the same group (tests, single-process tools): torch allows one group per name
    per process. The conformance tier proves both against SGLang's own function.
    """
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    prefixed = dist.PrefixStore(group_name, store)
    timeout = _timedelta(timeout_s)
    if register:
        pg, _ = _new_process_group_helper(
            world_size,
            rank,
            [],
            Backend(backend),
            prefixed,
            group_name=group_name,
            backend_options=None,
            timeout=timeout,
        )
        _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
        return pg
    device = "cuda" if backend == "nccl" else "cpu"
    group_store = dist.PrefixStore(f"{group_name}/", prefixed)
    backend_store = dist.PrefixStore(f"{device}/", group_store)
    pg = dist.ProcessGroup(group_store, rank, world_size)
    if backend == "gloo":
        impl = gloo_backend(backend_store, rank, world_size, timeout_s)
        kind = dist.ProcessGroup.BackendType.GLOO
    else:
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = timeout
        impl = dist.ProcessGroupNCCL(backend_store, rank, world_size, nccl_options)
        kind = dist.ProcessGroup.BackendType.NCCL
    pg._set_default_backend(kind)
    # As torch's helper does: one gloo backend serves CPU and CUDA tensors (a receiver on
    # a GPU whose learner shares the device broadcasts CUDA tensors through gloo).
    for device_type in ("cpu", "cuda") if backend == "gloo" else ("cuda",):
        pg._register_backend(torch.device(device_type), kind, impl)
    return pg


def _release_in_background(holder: list[Any], group_name: str) -> None:
    """Clear ``holder``, the only reference to an aborted group, on a thread of its own:
    gloo's destructor joins its worker threads, and one still sending to a peer that never
    joined waits out the collective's timeout (a refused version held the learner that long)."""

    def release(holder: list[Any]) -> None:
        holder.clear()
        log.debug("weight group %s released", group_name)

    threading.Thread(
        target=release, args=(holder,), name=f"release-{group_name}", daemon=True
    ).start()


class BroadcastGroup:
    """Rank 0's side of one engine API's weight-update group: what every such group shares.

    The constructor's surface (``EngineClient.weight_group`` passes the same options to
    each API's group), the checks of rank and backend, and ``wait``: a deadline on every
    collective and every backend failure as ``GroupError``. A subclass forms the group
    (``_connect``), starts broadcasts and says when a collective is done (``_until_done``).
    """

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
        register: bool = True,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size} ({group_name})")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"unsupported weight-sync backend {backend!r}")
        self.group_name = group_name
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self.device = torch.device(device)
        self.master_address = master_address
        self._store = store  # the master keeps its server alive through this reference
        self._connect(register)
        self.closed = False

    def _connect(self, register: bool) -> None:
        """Form the group on ``self._store`` (``register``: in torch's registry by name)."""
        raise NotImplementedError

    def _until_done(self, work: Any, deadline: float) -> bool:
        """Block until ``work`` completes (True) or ``deadline`` passes (False)."""
        raise NotImplementedError

    def wait(self, work: Any, what: str, deadline: float | None = None) -> None:
        """Block until ``work`` is done; GroupError on failure or past ``deadline`` (monotonic)."""
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        try:
            if not self._until_done(work, deadline):
                raise GroupError(
                    f"{what}: no completion within {self.timeout_s:.1f}s in group {self.group_name}"
                )
            work.wait()
        except RuntimeError as err:  # gloo/nccl report peer failures as RuntimeError
            if isinstance(err, GroupError):
                raise
            raise GroupError(f"{what} failed in group {self.group_name}: {err}") from err


def poll_until_done(work: Any, deadline: float, poll_s: float = _POLL_S) -> bool:
    """Poll ``work.is_completed()`` every ``poll_s``: True once done, False past ``deadline``."""
    while not work.is_completed():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


class WeightGroup(BroadcastGroup):
    """One rank's membership in a weight-update group; rank 0 is the learner.

    Formed exactly as SGLang's ``init_custom_process_group`` forms every engine
    rank (sglang/srt/utils/common.py): the store wrapped in
    ``PrefixStore(group_name)``, then torch's ``_new_process_group_helper`` with
    no global ranks (which adds its own ``"{group_name}/"`` and ``"{device}/"``
    prefixes), and the identity rank map registered. Building rank 0 any other
    way leaves the two sides waiting on different store keys. The store itself
    is ours (bound to ``master_address``); engines reach it through
    ``tcp://master_address:port`` as SGLang's rendezvous does.
    """

    def _connect(self, register: bool) -> None:
        """The SGLang-style group on the store, NCCL's watchdog given a grace period."""
        # NCCL's watchdog gets a grace period so our own deadline (``wait``) fires first.
        grace = NCCL_WATCHDOG_GRACE_S if self.backend == "nccl" else 0.0
        self._registered = register
        self._pg = _sglang_style_group(
            self._store,
            self.group_name,
            self.rank,
            self.world_size,
            self.backend,
            self.timeout_s + grace,
            register=register,
        )

    def broadcast(self, flat: torch.Tensor, src: int = 0) -> dist.Work:
        """Start a broadcast of a tensor from ``src`` (all ranks call it); returns the Work."""
        if self.closed:
            raise GroupError(f"group {self.group_name} is closed")
        return self._pg.broadcast([flat], broadcast_options(src, self.timeout_s))

    def wait(self, work: dist.Work, what: str, deadline: float | None = None) -> None:
        """``BroadcastGroup.wait``, then the current CUDA stream synchronized (nccl)."""
        super().wait(work, what, deadline)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _until_done(self, work: dist.Work, deadline: float) -> bool:
        """Block until ``work`` completes (True) or ``deadline`` passes (False).

        gloo: sleep on the work's future (completed by gloo's thread, with or without an
        error) - polling with short sleeps cost a wake-up per poll on both sides of every
        broadcast, which on a loaded CPU delays each completion by a scheduler tick.
        nccl: poll ``is_completed`` (the CUDA event), as before.
        """
        if self.backend == "gloo":
            done = threading.Event()
            work.get_future().add_done_callback(lambda _future: done.set())
            return done.wait(max(0.0, deadline - time.monotonic()))
        return poll_until_done(work, deadline)

    def close(self, *, abort: bool = False) -> None:
        """Leave the group. ``abort`` drops in-flight collectives (peers see an error at once)
        and releases the group on a thread of its own (``_release_in_background``)."""
        if self.closed:
            return
        self.closed = True
        holder, self._pg = [self._pg], None  # the only reference: whoever clears it frees it
        try:
            if abort:
                holder[0].abort()
        except RuntimeError as err:  # a backend without abort support: drop it anyway
            log.warning("aborting weight group %s: %s", self.group_name, err)
        try:
            if self._registered:
                dist.destroy_process_group(holder[0])  # shuts it down, frees its registry name
            elif not abort:
                holder[0].shutdown()
        except (RuntimeError, ValueError, KeyError) as err:
            log.warning("closing weight group %s: %s", self.group_name, err)
        if abort:
            _release_in_background(holder, self.group_name)
        else:
            holder.clear()
        self._store = None  # type: ignore[assignment]
