"""Preflight's vocabulary: a finding, a node, the probes of the machine, and their real versions.

``launcher.preflight`` (the checks on config, data, backend, tracking, disk and cluster) and
``launcher.preflight_resources`` (placing the learner group and the engines per node) both
speak these types; tests replace any probe with a fake.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from fleetrl.machine import usable_cpus

ADDRESS_TIMEOUT_S = 3.0


class Finding(msgspec.Struct, frozen=True, kw_only=True):
    """One unmet precondition: the config key (or variable) it concerns, what is wrong, the fix.

    ``fatal=False`` findings are warnings: logged, the run goes on (an autoscaling cluster
    may still add the nodes).
    """

    key: str
    problem: str
    fix: str
    fatal: bool = True

    def line(self) -> str:
        kind = "preflight error" if self.fatal else "preflight warning"
        return f"{kind} at {self.key}: {self.problem} ({self.fix})"


class Node(msgspec.Struct, frozen=True):
    """A Ray node as the checks see it: a name for messages and its resource totals."""

    name: str
    resources: dict[str, float]


class PreflightFailed(ValueError):
    """Raised by ``ensure_ready``; the CLI prints ``lines`` (the config's rule errors, then
    one per finding) and exits 2."""

    def __init__(self, findings: list[Finding], config_errors: list[str] | None = None):
        self.findings = findings
        self.config_errors = list(config_errors or [])
        self.lines = self.config_errors + [f.line() for f in findings]
        super().__init__("; ".join(self.lines))

    def named(self, name: Callable[[str], str]) -> PreflightFailed:
        """The same findings with each key as ``name`` gives it (a verl config's own keys)."""
        findings = [msgspec.structs.replace(f, key=name(f.key)) for f in self.findings]
        return PreflightFailed(findings, self.config_errors)


@dataclass
class Probes:
    """What the checks ask the machine or cluster; tests replace any of these with fakes."""

    env: Mapping[str, str] = field(default_factory=lambda: os.environ)
    cpu_count: Callable[[], int] = lambda: usable_cpus()  # affinity and cgroup quota
    cuda_devices: Callable[[], int] = lambda: _torch_cuda_devices()
    package_version: Callable[[str], str | None] = lambda name: _package_version(name)
    disk_free: Callable[[Path], int] = lambda path: shutil.disk_usage(path).free
    writable: Callable[[Path], str | None] = lambda path: _try_write(path)
    reachable: Callable[[str, int], bool] = lambda host, port: _tcp_reachable(host, port)
    cluster_nodes: Callable[[str], list[Node]] = lambda address: _ray_nodes(address)
    cuda_memory_gb: Callable[[], float] = lambda: _smallest_cuda_memory_gb()
    host_memory_gb: Callable[[], float] = lambda: _host_memory_gb()


def _smallest_cuda_memory_gb() -> float:
    """The memory of this machine's smallest CUDA device (0 without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return 0.0
    return (
        min(
            torch.cuda.get_device_properties(i).total_memory
            for i in range(torch.cuda.device_count())
        )
        / 2**30
    )


def _host_memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def _torch_cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _try_write(folder: Path) -> str | None:
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as err:
        return err.strerror or str(err)


def _tcp_reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=ADDRESS_TIMEOUT_S):
            return True
    except OSError:
        return False


def _ray_nodes(address: str) -> list[Node]:
    """Join the cluster, read its live nodes, leave (the run joins again when it starts)."""
    import ray

    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    try:
        return [
            Node(n.get("NodeManagerAddress") or n["NodeID"][:8], dict(n.get("Resources", {})))
            for n in ray.nodes()
            if n.get("Alive")
        ]
    finally:
        ray.shutdown()


def _num(value: float) -> str:
    return f"{value:g}"


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def shown(path: str | Path) -> str:
    """A path as a message shows it: absolute (``~`` expanded), so a relative one says where
    it was looked for."""
    return os.path.abspath(os.path.expanduser(str(path)))


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__
