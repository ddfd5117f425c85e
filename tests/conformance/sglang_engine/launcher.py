"""Start the engine: one process per TP rank plus the HTTP process; stop what was started.

Usage::

    with start_sglang_engine(model_dir, tp_size=2, api_key="k") as engine:
        requests.get(f"{engine.url}/model_info", headers={"Authorization": "Bearer k"})
        weights = engine.rank_weights()  # one {name: tensor} per TP rank
        memory = engine.rank_memory()    # offload tags and memory-saver calls per TP rank

Processes come from a fork server that has SGLang imported, and are ended by their own pid
(``Process.terminate`` / ``kill``), never by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import socket
import time
from multiprocessing.connection import Connection
from pathlib import Path

from . import messages as m

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 180.0
READ_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class SGLangEngine:
    """A running engine. ``url`` serves SGLang's HTTP API; ``rank_weights`` reads each TP rank."""

    url: str
    tp_size: int
    api_key: str | None
    _processes: list[mp.Process]
    _inspect: list[Connection]

    @property
    def pids(self) -> list[int]:
        """The processes this engine started: one per TP rank, then the HTTP process."""
        return [proc.pid for proc in self._processes]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def rank_weights(self, timeout: float = READ_TIMEOUT_S) -> list[dict]:
        """Each TP rank's current weights as ``{hf_name: torch.Tensor}`` (copies, bit for bit)."""
        import torch

        out = []
        for conn in self._inspect:
            conn.send_bytes(m.encode(m.RankWeightsRequest()))
        for rank, conn in enumerate(self._inspect):
            if not conn.poll(timeout):
                raise TimeoutError(f"TP rank {rank} did not answer within {timeout}s")
            _, reply = m.decode(conn.recv_bytes())
            tensors = {}
            for t in reply.tensors:
                dtype = getattr(torch, t.dtype)
                raw = torch.frombuffer(bytearray(t.data), dtype=torch.uint8)
                tensors[t.name] = raw.view(dtype).reshape(t.shape).clone()
            out.append(tensors)
        return out

    def rank_weight_versions(self, timeout: float = READ_TIMEOUT_S) -> list[str]:
        """The weight version each TP rank's scheduler serves."""
        versions = []
        for conn in self._inspect:
            conn.send_bytes(m.encode(m.RankWeightsRequest()))
        for conn in self._inspect:
            if not conn.poll(timeout):
                raise TimeoutError("a TP rank did not answer")
            versions.append(m.decode(conn.recv_bytes())[1].weight_version)
        return versions

    def rank_memory(self, timeout: float = READ_TIMEOUT_S) -> list:
        """Each TP rank's ``RankMemoryReply``: SGLang's offload tags, the memory saver's
        calls in order, errors SGLang's scheduler would have died of, weight bytes held."""
        for conn in self._inspect:
            conn.send_bytes(m.encode(m.RankMemoryRequest()))
        replies = []
        for rank, conn in enumerate(self._inspect):
            if not conn.poll(timeout):
                raise TimeoutError(f"TP rank {rank} did not answer")
            replies.append(m.decode(conn.recv_bytes())[1])
        return replies

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the ranks to exit, terminate the HTTP process; kill, by pid, what is left."""
        for conn in self._inspect:
            with contextlib.suppress(OSError):
                conn.send_bytes(m.encode(m.Shutdown()))
        for proc in self._processes:
            if proc.name.startswith("sglang-http") and proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in self._processes:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                logger.warning("killing %s (pid %s)", proc.name, proc.pid)
                proc.kill()
                proc.join(5.0)
        for conn in self._inspect:
            conn.close()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _wait_ready(url: str, headers: dict, procs: list[mp.Process], timeout: float) -> None:
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [p for p in procs if not p.is_alive()]
        if dead:
            raise RuntimeError(f"{dead[0].name} exited with code {dead[0].exitcode} at startup")
        try:
            if requests.get(f"{url}/model_info", headers=headers, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"the engine at {url} was not ready within {timeout}s")


# Imported once by the fork server, so each engine process starts with SGLang loaded.
PRELOAD = [
    "tests.conformance.sglang_engine.rank",
    "tests.conformance.sglang_engine.http_process",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.scheduler_components.weight_updater",
    "sglang.srt.model_executor.model_runner_components.weight_updater",
    "transformers",
]


def _context():
    """A fork-server context that preloads SGLang (importing it costs seconds per process).

    The fork server is a fresh process started before any engine; engine processes are
    forked from it, never from the test process.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_sglang_engine(
    model_dir: str | Path,
    tp_size: int = 1,
    api_key: str | None = None,
    startup_timeout: float = STARTUP_TIMEOUT_S,
    lora_rank: int = 0,
    is_embedding: bool = False,
) -> SGLangEngine:
    """Start the TP-rank processes and the HTTP process; return once ``/model_info`` answers.
    ``lora_rank`` > 0 starts it with LoRA on, as fleetrl's launcher does (``--enable-lora``);
    ``is_embedding`` serves a reward-model folder as fleetrl's reward fleet does
    (``--is-embedding``: ``/classify`` and ``/encode``)."""
    from .http_process import HttpConfig, http_main
    from .rank import RankConfig, rank_main

    if tp_size not in (1, 2):
        raise ValueError(f"tp_size must be 1 or 2, got {tp_size}")
    ctx = _context()
    model_dir = str(model_dir)
    group_port = free_port()
    procs: list[mp.Process] = []
    inspect_ends: list[Connection] = []
    http_ends: list[Connection] = []
    try:
        for rank in range(tp_size):
            http_end, rank_ctrl = ctx.Pipe()
            test_end, rank_inspect = ctx.Pipe()
            proc = ctx.Process(
                target=rank_main,
                args=(
                    RankConfig(model_dir, rank, tp_size, group_port, lora_rank, is_embedding),
                    rank_ctrl,
                    rank_inspect,
                ),
                name=f"sglang-tp{rank}",
                daemon=True,
            )
            proc.start()
            rank_ctrl.close()
            rank_inspect.close()
            procs.append(proc)
            inspect_ends.append(test_end)
            http_ends.append(http_end)
        port = free_port()
        http = ctx.Process(
            target=http_main,
            args=(
                HttpConfig(
                    model_dir,
                    tp_size,
                    port,
                    api_key,
                    lora_rank=lora_rank,
                    is_embedding=is_embedding,
                ),
                http_ends,
            ),
            name="sglang-http",
            daemon=True,
        )
        http.start()
        for end in http_ends:
            end.close()
        procs.append(http)
        engine = SGLangEngine(f"http://127.0.0.1:{port}", tp_size, api_key, procs, inspect_ends)
        deadline = time.monotonic() + startup_timeout
        for rank, conn in enumerate(inspect_ends):
            while not conn.poll(0.5):
                if not procs[rank].is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"TP rank {rank} did not start")
            m.decode(conn.recv_bytes())  # Ready
        _wait_ready(engine.url, engine.headers, procs, max(1.0, deadline - time.monotonic()))
        return engine
    except BaseException:
        SGLangEngine("", tp_size, api_key, procs, inspect_ends).stop()
        raise
