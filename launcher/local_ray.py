"""A local Ray instance's start, tried once more when Ray gives up waiting for its raylet.

Ray waits a fixed 30 s for a new local node's raylet to register with its GCS
(``ray/_private/node.py``, with no setting) and then raises "The current node timed out
during startup". On a loaded machine (two runs starting on two cores, a laptop compiling)
the raylet can miss that wait with nothing wrong with it. The failed start leaves its
processes running and no handle on them (the exception comes from the constructor of the
object that holds them), and a second start beside them would load the machine further.
So the processes the attempt started are ended, by id, and the start is tried once more:
the children this process gained meanwhile that run Ray's own programs (its GCS, raylet,
reaper and Python helpers, found by Ray's folder in their command lines; a check's
subprocess started by another thread meanwhile is not one), with their own children. Any
other error, or a second timeout, is raised as it was.

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
        before = children(os.getpid())
        try:
            init()
            return
        except Exception as err:
            if RAYLET_WAIT_TIMEOUT not in str(err) or attempt == START_ATTEMPTS:
                raise
            if before is None:  # no /proc: what the attempt started cannot be found
                raise
            if ray_dir is None:
                import ray

                ray_dir = os.path.dirname(ray.__file__)
            started = [p for p in (children(os.getpid()) or set()) - before if _runs(p, ray_dir)]
            left = sorted(set(started).union(*(descendants(p) or set() for p in started)))
            end_processes(left)
            log.warning(
                "Ray's local start gave up waiting for its raylet (Ray waits 30 s; a loaded "
                "machine?): ended the %d processes it had started, starting once more",
                len(left),
            )


def children(pid: int) -> set[int] | None:
    """The ids of ``pid``'s own children; None without ``/proc``."""
    tree = _parents()
    return None if tree is None else set(tree.get(pid, []))


def descendants(pid: int) -> set[int] | None:
    """The ids of ``pid``'s children, theirs, and so on; None without ``/proc``."""
    tree = _parents()
    if tree is None:
        return None
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _parents() -> dict[int, list[int]] | None:
    """Parent id -> its children's ids, over every process ``/proc`` lists."""
    if not PROC.is_dir():
        return None
    tree: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


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
    try:
        state = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"  # a zombie has ended
