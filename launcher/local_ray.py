"""A local Ray instance's start, tried once more when Ray gives up waiting for its raylet.

Ray waits a fixed 30 s for a new local node's raylet to register with its GCS
(``ray/_private/node.py``, with no setting) and then raises "The current node timed out
during startup". On a loaded machine (two runs starting on two cores, a laptop compiling)
the raylet can miss that wait with nothing wrong with it. The failed start leaves its
processes running and no handle on them (the exception comes from the constructor of the
object that holds them), and a second start beside them would load the machine further.
So the processes the attempt started are ended, by id, and the start is tried once more:
this process's children started since the attempt began (their start time in ``/proc``)
that run Ray's own programs (its GCS, raylet, reaper and Python helpers, found by Ray's
folder in their command lines; a check's subprocess started by another thread meanwhile
is not one), with their own children. Nothing is read from ``/proc`` unless a start
failed so, beyond one clock reading per attempt. Any other error, or a second timeout, is
raised as it was.

Where ``/proc`` is missing (macOS), the processes cannot be found, and the timeout is
raised at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from fleetrl.log import get_logger

log = get_logger(__name__)

START_ATTEMPTS = 2
RAYLET_WAIT_TIMEOUT = "timed out during startup"  # Ray's text for the 30 s wait given up
EXIT_WAIT_S = 5.0  # an ended process is gone well within this (SIGKILL)
PROC = Path("/proc")


def start_local(init: Callable[[], None], ray_dir: str | None = None) -> None:
    """``init()`` (Ray's ``ray.init`` of a local instance), once more after Ray's wait for
    its raylet timed out, with the first attempt's processes ended; ``ray_dir``: the folder
    Ray is installed in (its programs' command lines name it; default: the imported Ray's)."""
    for attempt in range(1, START_ATTEMPTS + 1):
        began = _ticks_since_boot()
        try:
            init()
            return
        except Exception as err:
            if RAYLET_WAIT_TIMEOUT not in str(err) or attempt == START_ATTEMPTS:
                raise
            tree = _tree()
            if began is None or tree is None:  # no /proc: what it started cannot be found
                raise
            if ray_dir is None:
                import ray

                ray_dir = os.path.dirname(ray.__file__)
            started = [
                p for p in tree.get(os.getpid(), [])
                if _started_at(p) >= began and _runs(p, ray_dir)
            ]  # fmt: skip
            left = sorted(set(started).union(*(_below(tree, p) for p in started)))
            end_processes(left)
            log.warning(
                "Ray's local start gave up waiting for its raylet (Ray waits 30 s; a loaded "
                "machine?): ended the %d processes it had started, starting once more",
                len(left),
            )


def descendants(pid: int) -> set[int] | None:
    """The ids of ``pid``'s children, theirs, and so on; None without ``/proc``."""
    tree = _tree()
    return None if tree is None else _below(tree, pid)


def _below(tree: dict[int, list[int]], pid: int) -> set[int]:
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _tree() -> dict[int, list[int]] | None:
    """Parent id -> its children's ids, over every process ``/proc`` lists; None without."""
    if not PROC.is_dir():
        return None
    tree: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))) is not None:
            tree.setdefault(int(fields[1]), []).append(int(entry.name))
    return tree


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` after its command name, from the state on (field 3 is index 0);
    None if the process is gone."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses


def _started_at(pid: int) -> int:
    """When process ``pid`` started, in clock ticks since boot (stat field 22); -1 if gone."""
    fields = _stat_fields(pid)
    return -1 if fields is None else int(fields[19])


def _ticks_since_boot() -> int | None:
    """Now, on the clock of ``_started_at``; None without ``/proc``."""
    try:
        uptime = float((PROC / "uptime").read_text().split()[0])
    except OSError:
        return None
    return int(uptime * os.sysconf("SC_CLK_TCK"))


def _runs(pid: int, ray_dir: str) -> bool:
    """Whether process ``pid`` runs one of Ray's programs (its command line names Ray's folder)."""
    try:
        return ray_dir in (PROC / str(pid) / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def end_processes(pids: list[int]) -> None:
    """SIGKILL each of ``pids``; reap those that are this process's children; wait (up to
    ``EXIT_WAIT_S``) until the others are gone."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # gone already
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + EXIT_WAIT_S
    for pid in pids:
        try:
            os.waitpid(pid, 0)  # this process's own child: reaped, no zombie left
            continue
        except ChildProcessError:  # a grandchild: its parent, ended too, was its reaper
            pass
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"  # a zombie has ended
