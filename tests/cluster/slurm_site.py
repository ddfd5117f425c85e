"""A real Slurm cluster on this machine for the Slurm tests: munged, slurmctld and two
slurmd (nodes n1 and n2, one host), all from Debian's slurm-wlm and munge packages.

Everything lives in one private folder (configuration, munge key and socket, state, spool,
logs) and on free ports, so it never meets another Slurm on the host. Each daemon runs in
the foreground under this process, which stops it by its pid: ``scontrol shutdown`` first,
then whatever is left of each daemon's own process group.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

SLURM_DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol")
NODES = ("n1", "n2")


def missing_tools() -> list[str]:
    return [name for name in SLURM_DAEMONS if shutil.which(name) is None]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SlurmSite:
    """Start with ``start()``, stop with ``stop()`` (idempotent); ``env`` is what Slurm's
    client commands (sbatch, squeue, scontrol) need to reach this controller."""

    def __init__(self, cpus: int | None = None) -> None:
        # short: munge's and Slurm's unix sockets live under it
        self.root = Path(tempfile.mkdtemp(prefix="frl-slurm-", dir="/tmp"))
        self.root.chmod(0o755)  # munged runs as the munge user and must reach its folder
        self.cpus = cpus or os.cpu_count() or 1
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.processes: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # --- start ---------------------------------------------------------------------------

    def start(self, timeout: float = 120) -> None:
        try:
            self._start_munge()
            self._write_conf()
            self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
            for node in NODES:
                self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
            self._wait_nodes_idle(timeout)
        except BaseException:
            self.stop()
            raise

    def _start_munge(self) -> None:
        munge = pwd.getpwnam("munge")
        folder = self.root / "munge"
        folder.mkdir(mode=0o700)
        key = folder / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True)
        for path in (folder, key):
            os.chown(path, munge.pw_uid, munge.pw_gid)
        self._spawn(
            "munged",
            ["munged", "--foreground", "--force", f"--key-file={key}",
             f"--socket={self.munge_socket}", f"--pid-file={folder / 'munged.pid'}",
             f"--log-file={folder / 'munged.log'}", f"--seed-file={folder / 'munged.seed'}"],
            user=munge.pw_uid, group=munge.pw_gid,
        )  # fmt: skip
        _wait_for(lambda: self.munge_socket.exists(), 30, "munged's socket", self.logs)

    def _write_conf(self) -> None:
        host = socket.gethostname()
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir()
        nodes = "\n".join(
            f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={_free_port()} "
            f"CPUs={self.cpus} State=UNKNOWN"
            for node in NODES
        )
        self.conf.write_text(
            f"""ClusterName=fleetrl-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool/%n
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd-%n.pid
SlurmctldLogFile={self.root}/log/slurmctld.log
SlurmdLogFile={self.root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobRequeue=1
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
SlurmctldTimeout=30
SlurmdTimeout=60
KillWait=30
{nodes}
PartitionName=test Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _spawn(self, name: str, cmd: list[str], **kwargs) -> None:
        log = (self.root / f"{name}.out").open("w")
        self.processes[name] = subprocess.Popen(
            cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            **kwargs,
        )  # fmt: skip

    def _wait_nodes_idle(self, timeout: float) -> None:
        def idle() -> bool:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            return all(states.get(node) == "idle" for node in NODES)

        _wait_for(idle, timeout, "both slurmd idle in sinfo", self.logs)

    # --- use -----------------------------------------------------------------------------

    def run(
        self, cmd: list[str], check: bool = True, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        """A Slurm client command against this controller (``env``: the caller's, which
        must carry SLURM_CONF as ``self.env`` does)."""
        return subprocess.run(
            cmd, env=env or self.env, capture_output=True, text=True, check=check, timeout=60
        )

    def logs(self) -> str:
        """Every daemon's log tail, for a failure message."""
        parts = []
        for path in sorted([*self.root.glob("*.out"), *self.root.glob("log/*.log")]):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)

    # --- stop ----------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel every job (each ends as Slurm ends it: the job's own cleanup runs), shut
        the daemons down, then end by pid what is left: each daemon's process group, and any
        process that carries this site's SLURM_CONF (a job step's slurmstepd, which leaves
        its slurmd's session)."""
        if "slurmctld" in self.processes and self.conf.exists():
            jobs = self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
            if jobs:
                self.run(["scancel", *jobs], check=False)
                with contextlib.suppress(TimeoutError):
                    _wait_for(lambda: not self.run(["squeue", "-h"], check=False).stdout.strip(),
                              90, "cancelled jobs to end", lambda: "")  # fmt: skip
            subprocess.run(["scontrol", "shutdown"], env=self.env, capture_output=True, timeout=60)
        for name in [n for n in self.processes if n != "munged"] + ["munged"]:
            proc = self.processes.pop(name, None)
            if proc is not None:
                _stop_group(proc)
        for pid in _pids_with_env(f"SLURM_CONF={self.conf}"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


def _pids_with_env(entry: str) -> list[int]:
    found = []
    needle = entry.encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                environ = (proc / "environ").read_bytes()
            except OSError:
                continue
            if needle in environ.split(b"\0"):
                found.append(int(proc.name))
    return found


def _stop_group(proc: subprocess.Popen, grace: float = 20) -> None:
    """End a daemon we started and anything left in its own process group (a slurmd's
    slurmstepd), by that pid: TERM, then KILL."""
    deadline = time.monotonic() + grace
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _wait_for(check, timeout: float, what: str, logs) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}\n{logs()}")
        time.sleep(0.5)
