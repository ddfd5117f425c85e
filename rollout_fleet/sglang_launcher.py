"""Launch, watch and stop one SGLang server process (the GPU rollout engine).

``build_command(spec, key_config)`` turns an ``SGLangServerSpec`` into the
``python -m sglang.launch_server ...`` argument list (argument names as in
SGLang's ``server_args.py``: ``--model-path``, ``--tp-size``,
``--mem-fraction-static``, ``--load-format``, ``--weight-version``, ...).

The API key never goes on the command line, where ``/proc/<pid>/cmdline`` shows it to
every user of the host: SGLang 0.5.23 reads ``--api-key`` from the argv or from a YAML
file named by ``--config`` (``prepare_server_args`` merges the file's keys into the
arguments in memory; no environment variable carries it). ``write_key_config`` writes
``api-key: <key>`` to a file only the user can read (0600, in a 0700 folder of its own),
the command names the file, and the server removes it once SGLang has read it (healthy).
SGLang logs its resolved arguments, the key among them, at ``--log-level info``; the
launcher starts it at ``warning``. ``SGLangServer`` starts it in its own process group
(its pid recorded), waits for ``GET /health`` with a deadline while watching
that the process has not exited, restarts it a bounded number of times, and
ends it by its process group id (SIGTERM, then SIGKILL).

By default the server starts with ``--load-format dummy``: random weights that
the learner's first broadcast replaces (the fleet does not route to it until
then), so nothing reads the checkpoint from disk N times. ``load_format="auto"``
loads real weights. ``--weight-version 0`` makes the version SGLang reports an
integer from the start (fleetrl tags tokens with ``int(weight_version)``), which
needs an SGLang release that has ``--weight-version`` (0.5 or later).

``--enable-memory-saver`` goes on for co-located engines (``rollout.placement``): without
it SGLang's ``/release_memory_occupation`` frees nothing (it needs ``torch_memory_saver``,
which ``fleetrl check`` looks for). ``--enable-weights-cpu-backup`` is not used: every
resume of the weights is followed by a push, so a host copy would cost a copy per step
and host memory for nothing.

``--disable-radix-cache`` goes on when the run pauses engines ``in_place`` for
weight updates (``radix_cache_disabled_for``): SGLang refuses to flush its cache
while requests run, and in-place pause keeps them running, so a prefix cached
under old weights would otherwise be served under the new version tag.

A reward-model server (``is_embedding``) starts with ``--is-embedding`` and
``--load-format auto``: it serves the folder's weights and never takes a push.

Without sglang installed in the tested range (``rollout_fleet.sglang_version``)
or without CUDA, ``check_available`` raises ``SGLangUnavailable`` with the
reason in one line. Left out: multi-node tensor parallel
(``--nnodes``/``--dist-init-addr``), data parallel inside one server (use more
engines instead).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from fleetrl.log import get_logger
from rollout_fleet.sglang_version import (
    SGLangVersionError,
    check_sglang_version,
    installed_sglang_version,
)

log = get_logger(__name__)

_HEALTH_POLL_S = 1.0


class SGLangUnavailable(RuntimeError):
    """SGLang cannot run here (not installed, or no CUDA device)."""


class SGLangStartError(RuntimeError):
    """The server exited or did not become healthy in time (after the allowed restarts)."""


@dataclass
class SGLangServerSpec:
    """Everything that goes on the SGLang command line."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port at launch
    tp_size: int = 1
    mem_fraction_static: float = 0.85
    api_key: str | None = field(default=None, repr=False)  # by --config file, never argv
    load_format: Literal["dummy", "auto"] = "dummy"
    dtype: str = "auto"
    max_running_requests: int | None = None
    random_seed: int | None = None
    weight_version: str | None = "0"
    disable_radix_cache: bool = False  # see radix_cache_disabled_for
    base_gpu_id: int | None = None
    lora_rank: int = 0  # > 0: serve LoRA adapters (see lora_args)
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    is_embedding: bool = False  # a reward model: served on /classify and /encode
    enable_memory_saver: bool = False  # co-located: release frees memory (torch_memory_saver)
    log_level: str = "warning"
    extra_args: list[str] = field(default_factory=list)
    python: str = sys.executable

    def validate(self) -> None:
        if not self.model_path:
            raise ValueError("SGLangServerSpec.model_path is empty")
        if self.tp_size < 1:
            raise ValueError(f"SGLangServerSpec.tp_size must be >= 1, got {self.tp_size}")
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError(
                f"SGLangServerSpec.mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}"
            )
        if self.load_format not in ("dummy", "auto"):
            raise ValueError(
                f"SGLangServerSpec.load_format {self.load_format!r}; accepted: dummy, auto"
            )
        if not 0 <= self.port < 65536:
            raise ValueError(f"SGLangServerSpec.port {self.port} is not a TCP port")
        if self.lora_rank < 0:
            raise ValueError(f"SGLangServerSpec.lora_rank must be >= 0, got {self.lora_rank}")
        if self.lora_rank and not self.lora_target_modules:
            raise ValueError("SGLangServerSpec.lora_target_modules is empty with lora_rank > 0")
        if self.host not in ("127.0.0.1", "localhost", "::1") and not self.api_key:
            raise ValueError(
                f"SGLang server on non-loopback host {self.host!r} needs an api_key "
                "(every HTTP endpoint, weight updates included, would be open to the network)"
            )


def radix_cache_disabled_for(pause_mode: str) -> bool:
    """Whether SGLang must run without its radix (prefix) cache under this weight-sync pause mode.

    ``in_place`` keeps requests running across an update, and SGLang refuses
    ``flush_cache`` while requests run; a prefix cached under the old weights
    would then be reused by requests tagged with the new version. ``abort`` and
    ``retract`` stop every request, so the cache is flushed once per update and
    can stay on.
    """
    return pause_mode == "in_place"


# Adapters an engine holds at once under LoRA weight sync: the current version, the
# previous one (requests still running on it) and the one before while its unload waits
# for its last requests (weight_sync.adapter_sender); as many in one batch (SGLang counts
# a base-model request as one more in --max-loras-per-batch; fleetrl sends none).
LORA_SLOTS = 3


def lora_args(rank: int, target_modules: list[str]) -> list[str]:
    """SGLang's LoRA flags for adapters of ``rank`` on ``target_modules`` (peft's names;
    peft's ``all-linear`` is SGLang's ``all``). Adapters arrive by ``/load_lora_adapter``
    (``weight_sync.adapter_sender``), so none is named at launch."""
    modules = ["all" if m == "all-linear" else m for m in target_modules]
    return [
        "--enable-lora",
        "--max-lora-rank",
        str(rank),
        "--lora-target-modules",
        *modules,
        "--max-loras-per-batch",
        str(LORA_SLOTS),
        "--max-loaded-loras",
        str(LORA_SLOTS),
    ]


def write_key_config(api_key: str) -> Path:
    """A YAML file holding ``api_key`` for SGLang's ``--config``, readable by this user alone
    (0600, in a fresh 0700 folder); ``remove_key_config`` deletes both."""
    folder = Path(tempfile.mkdtemp(prefix="fleetrl-sglang-key-"))
    path = folder / "api_key.yaml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(f"api-key: {json.dumps(api_key)}\n")  # SGLang makes it --api-key; JSON is YAML
    return path


def remove_key_config(path: Path | None) -> None:
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        with contextlib.suppress(OSError):
            path.parent.rmdir()


def build_command(spec: SGLangServerSpec, key_config: Path | None = None) -> list[str]:
    """The argument list that launches ``spec`` (port must already be chosen); a spec with an
    API key names the file ``write_key_config`` wrote for it (``key_config``)."""
    spec.validate()
    if spec.port == 0:
        raise ValueError("build_command: choose a port first (SGLang does not accept port 0)")
    if spec.api_key and key_config is None:
        raise ValueError("build_command: the API key goes in a file (write_key_config), never argv")  # fmt: skip
    cmd = [
        spec.python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        spec.model_path,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--tp-size",
        str(spec.tp_size),
        "--mem-fraction-static",
        str(spec.mem_fraction_static),
        "--load-format",
        spec.load_format,
        "--dtype",
        spec.dtype,
        "--log-level",
        spec.log_level,
    ]
    if spec.api_key:
        cmd += ["--config", str(key_config)]
    if spec.weight_version is not None:
        cmd += ["--weight-version", spec.weight_version]
    if spec.disable_radix_cache:
        cmd += ["--disable-radix-cache"]
    if spec.max_running_requests is not None:
        cmd += ["--max-running-requests", str(spec.max_running_requests)]
    if spec.random_seed is not None:
        cmd += ["--random-seed", str(spec.random_seed)]
    if spec.base_gpu_id is not None:
        cmd += ["--base-gpu-id", str(spec.base_gpu_id)]
    if spec.lora_rank:
        cmd += lora_args(spec.lora_rank, spec.lora_target_modules)
    if spec.is_embedding:
        cmd += ["--is-embedding"]
    if spec.enable_memory_saver:
        cmd += ["--enable-memory-saver"]
    cmd += list(spec.extra_args)
    return cmd


def check_available(lookup: Callable[[], str | None] | None = None) -> None:
    """Raise SGLangUnavailable unless a tested sglang is installed and a CUDA device is visible.

    ``lookup`` returns the installed sglang version (None: not installed); tests inject it.
    """
    try:
        check_sglang_version(lookup=lookup or installed_sglang_version)
    except SGLangVersionError as err:
        raise SGLangUnavailable(
            f"rollout.backend=sglang: {err} (or use rollout.backend=embedded)"
        ) from None
    import torch

    if not torch.cuda.is_available():
        raise SGLangUnavailable(
            "rollout.backend=sglang needs a CUDA GPU on the engine's node, and none is "
            "visible; use rollout.backend=embedded for CPU runs"
        )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host if host not in ("localhost",) else "127.0.0.1", 0))
        return int(sock.getsockname()[1])


class SGLangServer:
    """One SGLang server subprocess: start, wait healthy, restart (bounded), stop by pid."""

    NAME = "SGLang"  # how messages name the server

    def __init__(
        self,
        spec: SGLangServerSpec,
        *,
        startup_timeout_s: float = 600.0,
        max_restarts: int = 2,
        log_path: str | Path | None = None,
        env: dict[str, str] | None = None,
        require_available: bool = True,
    ):
        spec.validate()
        self.spec = spec
        self.startup_timeout_s = startup_timeout_s
        self.max_restarts = max_restarts
        self.log_path = Path(log_path) if log_path else None
        self.env = env
        self.require_available = require_available
        self.restarts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._key_config: Path | None = None  # the key's file, until SGLang has read it

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.spec.host in ("0.0.0.0", "localhost") else self.spec.host
        return f"http://{host}:{self.spec.port}"

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> str:
        """Launch and wait until healthy, restarting up to ``max_restarts`` times; returns the URL."""
        if self.require_available:
            self._check_available()
        last_error: Exception | None = None
        for attempt in range(self.max_restarts + 1):
            if attempt:
                self.restarts += 1
                log.warning(
                    "restarting SGLang (attempt %d/%d) after: %s",
                    attempt + 1,
                    self.max_restarts + 1,
                    last_error,
                )
            try:
                self._launch()
                self.wait_healthy(self.startup_timeout_s)
                return self.url
            except SGLangStartError as err:
                last_error = err
                self.stop()
        raise SGLangStartError(
            f"{self.NAME} server for {self.spec.model_path} did not start after "
            f"{self.max_restarts + 1} attempts; last error: {last_error}"
        )

    def ensure_running(self) -> bool:
        """Restart the server if its process exited (bounded); True if it was restarted."""
        if self.alive():
            return False
        if self.restarts >= self.max_restarts:
            raise SGLangStartError(
                f"{self.NAME} server (pid {self.pid}) exited and its {self.max_restarts} restarts are spent"
            )
        self.restarts += 1
        log.warning("%s server pid %s exited; restart %d", self.NAME, self.pid, self.restarts)
        self.stop()
        self._launch()
        self.wait_healthy(self.startup_timeout_s)
        return True

    def wait_healthy(self, timeout_s: float) -> None:
        """Poll GET /health until 200; raise SGLangStartError on exit or timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                raise SGLangStartError(
                    f"{self.NAME} server exited with status {code} before it was healthy"
                    + (f"; see {self.log_path}" if self.log_path else "")
                )
            if self.health(timeout_s=min(5.0, max(0.1, deadline - time.monotonic()))):
                log.info("%s server healthy at %s (pid %s)", self.NAME, self.url, self.pid)
                remove_key_config(self._key_config)  # read at start: nothing reads it again
                self._key_config = None
                return
            if time.monotonic() >= deadline:
                raise SGLangStartError(
                    f"{self.NAME} server at {self.url} not healthy after {timeout_s:.0f} s"
                )
            time.sleep(_HEALTH_POLL_S)

    def health(self, timeout_s: float = 5.0) -> bool:
        request = urllib.request.Request(f"{self.url}/health")
        if self.spec.api_key:
            request.add_header("Authorization", f"Bearer {self.spec.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the server's process group (SIGTERM, then SIGKILL after ``timeout_s``)."""
        proc, self._proc = self._proc, None
        remove_key_config(self._key_config)
        self._key_config = None
        if proc is not None and proc.poll() is None:
            pgid = proc.pid  # started with start_new_session: its pid is its group id
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning(
                    "%s pid %d ignored SIGTERM for %.0f s; SIGKILL", self.NAME, pgid, timeout_s
                )
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                proc.wait(timeout=timeout_s)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _check_available(self) -> None:
        check_available()

    def _command(self) -> list[str]:
        """The server's argument list (a subclass launches another server the same way); the
        run's key goes to SGLang in a fresh 0600 file, removed once the server has read it."""
        remove_key_config(self._key_config)
        self._key_config = write_key_config(self.spec.api_key) if self.spec.api_key else None
        return build_command(self.spec, self._key_config)

    def _launch(self) -> None:
        if self.spec.port == 0 or self.restarts:
            # a fresh port per launch: the old one may linger in TIME_WAIT
            self.spec.port = free_port(self.spec.host)
        cmd = self._command()
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        log.info("launching %s: %s", self.NAME, " ".join(cmd))
        # without a log file the server's output goes where ours goes (Ray's worker logs)
        self._proc = subprocess.Popen(
            cmd,
            stdout=self._log_file,
            stderr=subprocess.STDOUT if self._log_file is not None else None,
            env={**os.environ, **(self.env or {})},
            start_new_session=True,
        )
