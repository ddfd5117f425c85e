"""Supervision of a run's roles: who died, what to do about it, and the run's secrets.

The training loop (launcher/train.py) calls its roles through one wrapper,
``Supervised``: every call to the role handles is guarded in the same way, so
the loop names no fault. When a call fails with a fault (a Ray error or a
timeout), ``Supervisor.diagnose`` asks every role whether it is still there (a
short ``pid()`` call each) and turns the answer into one of:

- a dead **buffer**: restarted by the loop on the same bank directory and the
  same ZeroMQ addresses (``BufferRole`` binds the ports chosen at first start),
  so the learner's DEALER and the fleet's PUSH reconnect by themselves; the
  fleet then re-sends every group the buffer has not durably accepted
  (rollout_fleet/delivery.py) and the call that failed is retried with the same
  arguments (at most ``MAX_BUFFER_RESTARTS`` restarts per run);
- a dead **learner rank** or **rollout supervisor**: ``TrainingStopped`` with a
  one-line reason naming the role, its pid and the checkpoint a rerun with
  ``trainer.resume=auto`` continues from. The loop then kills every actor it
  started and shuts down the local Ray instance (no orphans);
- nothing dead: the original error is re-raised (a bug, not a fault).

Collective calls (every learner rank at once) go through ``gather``: it returns
as soon as any rank fails instead of waiting, in list order, on a rank that is
blocked in a collective with a dead peer.

Also here: ``BadStepGuard`` (stop after k consecutive non-finite steps),
``RunSecrets`` (a bearer key for the engines' HTTP API, made per run; CURVE keys for
every ZeroMQ socket whenever the run leaves loopback), checkpoint
candidates newest first (a checkpoint that fails to load falls back to the
previous complete one), and process helpers used by the fault tests and the
soak script (``listening_pid``, ``alive_pids``).

Left out: restarting a dead learner rank in place (the group is restarted from
the last checkpoint instead, as torchrun-style elastic agents do) and
restarting a dead rollout supervisor.
"""

from __future__ import annotations

import functools
import os
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetrl.log import get_logger

log = get_logger(__name__)

MAX_BUFFER_RESTARTS = 5  # per run; a buffer that keeps dying stops the run
PING_TIMEOUT_S = 10.0  # a role that cannot answer pid() within this is treated as gone
STARTUP_TIMEOUT_S = 600.0  # a new actor's process start (imports torch) may take a while
GATHER_POLL_S = 1.0


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (non-finite losses, a dead role) with a clear reason."""


class BufferDown(RuntimeError):
    """The buffer actor died; the loop restarts it and retries what failed."""


# ---- secrets ---------------------------------------------------------------------------
@dataclass(frozen=True)
class RunSecrets:
    """Per-run credentials: the engines' API key always (every engine and reward server
    the run starts requires it, loopback included); CURVE keys as soon as the run spans
    nodes (None on loopback)."""

    buffer_server: Any = None  # buffer.security.CurveServerKeys
    learner_client: Any = None  # CurveClientKeys of learner rank 0 (control socket)
    rollout_client: Any = None  # CurveClientKeys of the rollout supervisor (ingest + control)
    engine_api_key: str | None = field(default=None, repr=False)

    @property
    def secure(self) -> bool:
        return self.buffer_server is not None


def make_run_secrets(secure: bool) -> RunSecrets:
    """A fresh engine API key, and fresh CURVE keys (one server, two clients) when ``secure``."""
    key = secrets.token_urlsafe(32)
    if not secure:
        return RunSecrets(engine_api_key=key)
    from buffer.security import make_run_keys

    server, (learner, rollout) = make_run_keys(2)
    return RunSecrets(server, learner, rollout, key)


ENGINE_KEY_FILE = "engine_api_key"  # in <run dir>/secrets/, readable by the user alone


def write_engine_key(run_dir: Path, key: str) -> Path:
    """The run's engine key in ``<run dir>/secrets/engine_api_key`` (0600, folder 0700), for
    the user's own requests to the run's engines (``curl -H "Authorization: Bearer $(cat
    ...)"``); never on a command line or in a log. Replaced by each start of the run."""
    folder = run_dir / "secrets"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    path = folder / ENGINE_KEY_FILE
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(key + "\n")
    return path


# ---- non-finite steps ------------------------------------------------------------------
class BadStepGuard:
    """Counts consecutive skipped (non-finite) steps; raises TrainingStopped at ``limit``."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"trainer.max_bad_steps must be >= 1, got {limit}")
        self.limit = limit
        self.in_a_row = 0
        self.total = 0

    def observe(self, step: int, skipped_nonfinite: bool) -> None:
        if not skipped_nonfinite:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        log.warning(
            "step %d: non-finite loss or gradient, update skipped (%d in a row)",
            step,
            self.in_a_row,
        )
        if self.in_a_row >= self.limit:
            raise TrainingStopped(
                f"{self.in_a_row} consecutive steps had a non-finite loss or gradient "
                f"(trainer.max_bad_steps={self.limit}); last checkpoint stays valid"
            )


# ---- checkpoints -----------------------------------------------------------------------
def checkpoint_candidates(root: str | Path) -> list[Path]:
    """Complete ``step_<N>`` checkpoints under ``root``, newest first (incomplete ones logged)."""
    from learner.checkpoint import checkpoint_problem, latest_complete_checkpoint

    root = Path(root)
    out: list[Path] = []
    newest = latest_complete_checkpoint(root)  # logs every skipped folder once
    if newest is None:
        return out
    steps = []
    for child in root.iterdir():
        name = child.name
        if name.startswith("step_") and name[5:].isdigit():
            steps.append((int(name[5:]), child))
    for step, path in sorted(steps, reverse=True):
        if step <= int(newest.name[5:]) and checkpoint_problem(path) is None:
            out.append(path)
    return out


# ---- Ray calls -------------------------------------------------------------------------
def is_actor_death(err: BaseException) -> bool:
    """True when ``err`` says an actor (process) is gone rather than that a method raised."""
    import ray.exceptions as rex

    return isinstance(err, rex.RayActorError | rex.ActorUnavailableError)


def gather(refs: Sequence[Any], what: str, timeout_s: float | None = None) -> list[Any]:
    """``ray.get(refs)``, but the first failure (in completion order) raises at once."""
    import ray

    if len(refs) == 1 and timeout_s is None:  # one rank: its answer or its failure, one call
        return [ray.get(refs[0])]
    pending = list(refs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        wait = GATHER_POLL_S
        if deadline is not None:
            wait = min(wait, max(0.0, deadline - time.monotonic()))
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=wait)
        for ref in ready:
            ray.get(ref)  # raises the role's error (or its death) now
        if deadline is not None and pending and time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: no answer within {timeout_s:.0f}s")
    return ray.get(list(refs))


@dataclass
class RoleHandle:
    """One actor the run started: what to call it in messages, and its process id."""

    name: str
    actor: Any
    pid: int = -1


class Supervisor:
    """Knows the run's actors; ``diagnose`` says which one is gone after a failed call."""

    def __init__(self) -> None:
        self.roles: dict[str, RoleHandle] = {}

    def register(self, name: str, actor: Any, pid: int | None = None) -> RoleHandle:
        import ray

        if pid is None:
            pid = int(ray.get(actor.pid.remote(), timeout=STARTUP_TIMEOUT_S))
        handle = RoleHandle(name, actor, pid)
        self.roles[name] = handle
        return handle

    def pids(self) -> dict[str, int]:
        return {name: h.pid for name, h in self.roles.items()}

    def dead_roles(self) -> list[RoleHandle]:
        """Roles whose process no longer answers (checked in parallel, ``PING_TIMEOUT_S`` each)."""
        import ray
        import ray.exceptions as rex

        probes = {name: h.actor.pid.remote() for name, h in self.roles.items()}
        dead = []
        for name, ref in probes.items():
            try:
                ray.get(ref, timeout=PING_TIMEOUT_S)
            except (rex.RayActorError, rex.ActorUnavailableError, rex.GetTimeoutError):
                dead.append(self.roles[name])
        return dead

    def diagnose(self, err: BaseException, what: str, resume_hint: str) -> None:
        """Called with the error of a failed call; raises what the loop should act on."""
        dead = self.dead_roles()
        if not dead:
            raise err
        names = [h.name for h in dead]
        log.error("%s failed; dead roles: %s (%s)", what, ", ".join(names), _one_line(err))
        fatal = [h for h in dead if h.name != "buffer"]
        if fatal:
            first = fatal[0]
            raise TrainingStopped(
                f"{first.name} (pid {first.pid}) died during {what}: {_one_line(err)}; "
                f"{resume_hint}"
            ) from err
        raise BufferDown(f"buffer (pid {self.roles['buffer'].pid}) died during {what}") from err

    def kill_all(self) -> None:
        """Kill every registered actor (after a role died: the others may be stuck)."""
        import ray

        for handle in self.roles.values():
            try:
                ray.kill(handle.actor, no_restart=True)
            except (ValueError, RuntimeError) as err:  # already gone or Ray shutting down
                log.info("kill %s: %s", handle.name, err)


class Supervised:
    """The run's role handles with every call guarded: restart, retry and stop in one place.

    ``roles`` is any object whose methods are the role calls (``launcher.session.Run``
    with Ray; a fake in the controller tests). Calling ``supervised.step(v)`` calls
    ``roles.step(v)``; when that raises one of ``faults``, ``diagnose(err, what)``
    raises what to do: ``BufferDown`` (restart the buffer through ``restart_buffer``,
    then call again with the same arguments), ``TrainingStopped`` (the run stops;
    ``failed`` tells ``close`` to kill what is left), or the error itself (a bug).
    Anything that is not a fault (a stop request, a bug) passes through untouched.
    """

    def __init__(
        self,
        roles: Any,
        *,
        diagnose: Callable[[BaseException, str], None],
        restart_buffer: Callable[[int], None],
        faults: tuple[type[BaseException], ...] = (TimeoutError,),
        max_buffer_restarts: int = MAX_BUFFER_RESTARTS,
    ) -> None:
        self.roles = roles
        self.diagnose = diagnose
        self.restart_buffer = restart_buffer
        self.faults = faults
        self.max_buffer_restarts = max_buffer_restarts
        self.buffer_restarts = 0
        self.failed = False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.roles, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            return self.call(name.replace("_", " "), attr, *args, **kwargs)

        return guarded

    def call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, retried after each buffer restart; stops on other deaths."""
        while True:
            try:
                return fn(*args, **kwargs)
            except self.faults as err:
                try:
                    self.diagnose(err, what)  # raises BufferDown, TrainingStopped or err
                except BufferDown as down:
                    self._restart_buffer(down, what)
                    continue
                except TrainingStopped:
                    self.failed = True
                    raise
                raise  # diagnose returned: nothing to act on, the fault stands
            except TrainingStopped:
                self.failed = True
                raise

    def _restart_buffer(self, down: BufferDown, what: str) -> None:
        if self.buffer_restarts >= self.max_buffer_restarts:
            self.failed = True
            raise TrainingStopped(
                f"{down}; it was restarted {self.max_buffer_restarts} times already"
            ) from down
        self.buffer_restarts += 1
        log.warning("%s; restarting it (%d) and retrying %s", down, self.buffer_restarts, what)
        self.restart_buffer(self.buffer_restarts)

    def supervision_metrics(self) -> dict[str, float]:
        return {"supervision/buffer_restarts": float(self.buffer_restarts)}


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    first = next((line for line in text if line.strip()), type(err).__name__)
    return f"{type(err).__name__}: {first[:300]}"


# ---- processes (tests and the soak script) ---------------------------------------------
def import_psutil() -> Any:
    """psutil as Ray bundles it (importing ray puts its third-party folder on sys.path)."""
    import importlib

    import ray  # noqa: F401

    return importlib.import_module("psutil")


def listening_pid(port: int) -> int | None:
    """The pid of the process listening on TCP ``port`` (this user's processes), or None."""
    psutil = import_psutil()
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            return conn.pid
    return None


def alive_pids(pids: Iterable[int]) -> list[int]:
    """The ones of ``pids`` that still run (zombies count as gone)."""
    psutil = import_psutil()
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            continue
    return out


def write_roster(path: Path, roster: dict[str, Any]) -> None:
    """Atomically write the run's role -> pid map (read by fault tests and the soak script)."""
    import json

    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(roster, indent=2, sort_keys=True))
    os.replace(tmp, path)
