"""Learner side of weight sync with LoRA on: publish each version as an adapter, not as weights.

Same interface as ``weight_sync.sender.WeightSender`` (``connect``, ``add_engine``,
``remove_engine``, ``set_members``, ``publish``, ``publish_restored``, ``close``), so the
launcher drives either one. Every FSDP rank walks
``LearnerWorker.named_adapter_tensors()`` (a collective); rank 0 hands its stream
to ``publish``, the other ranks drain theirs (``drain_stream``).

``publish(stream, v)`` in order:
  1. collect the adapter tensors (megabytes, not gigabytes) and write the PEFT
     folder ``<adapter_dir>/fleetrl-policy-v<v>`` atomically (``adapters``);
  2. on every engine, concurrently: ``/load_lora_adapter`` the new folder by
     path, then ``/update_weight_version`` v (without aborting requests), so
     ``/model_info`` reports v; then, without waiting, ``/unload_lora_adapter`` of
     what it holds besides v and the previous version (SGLang answers once no
     running request uses the adapter; an engine so holds at most three, which
     ``--max-loaded-loras`` allows, so SGLang never evicts one itself);
  3. delete folders older than the previous version: an engine may reload an
     unloaded adapter by its path (SGLang does so for a request naming it), so a
     deleted folder makes a stale name fail loudly instead of serving old weights.

Why the path route: SGLang 0.5.23's ``/load_lora_adapter_from_tensors`` carries
ForkingPickler payloads (CUDA-IPC / shared-memory handles), which only work on
the engine's own host; ``/load_lora_adapter`` works across hosts given a folder
the engines can read, so ``adapter_dir`` must be shared storage on a cluster.

No pause, whatever ``pause_mode`` says: adapters are chosen per request, so a
request in flight finishes on the adapter it named while new requests name the
new one. Each request's tokens carry the version of the adapter it named
(``rollout_fleet.adapters``); the embedded engine, which merges one adapter into
its weights, aborts the requests that named another one when it switches (they
are resubmitted, as after an abort pause), so the same rule is exact there.

Failures: an engine whose calls fail or time out is dropped and named in a
``WeightSyncError`` (carrying the metrics) after the others are done; loading
an adapter is all or nothing, so no engine is ever left ``partial``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import torch

from fleetrl.log import get_logger
from weight_sync.adapters import (
    adapter_name,
    existing_adapter_folders,
    remove_adapter_folder,
    write_adapter_folder,
)
from weight_sync.config import WeightSyncConfig
from weight_sync.engine_client import EngineCallError, EngineClient, EngineEndpoint
from weight_sync.errors import WeightSyncError, describe
from weight_sync.metrics import EngineSyncStatus, SyncMetrics
from weight_sync.publisher import Publisher

log = get_logger(__name__)

HEALTH_PROBE_S = 5.0
_MAX_HTTP_THREADS = 64
_ALREADY_LOADED = "already loaded"  # SGLang's LoRAManager.validate_new_adapter
_NOT_LOADED = "does not exist"  # SGLang's LoRARegistry.unregister


class AdapterSender(Publisher):
    """Publishes LoRA adapter versions to every engine through SGLang's adapter routes."""

    def __init__(
        self, config: WeightSyncConfig, *, adapter_dir: str | Path, adapter_config: dict[str, Any]
    ) -> None:
        if not adapter_config.get("r"):
            raise ValueError(f"adapter_config has no LoRA rank 'r': {sorted(adapter_config)}")
        super().__init__(config)
        self.adapter_dir = Path(adapter_dir).resolve()
        self.adapter_config = dict(adapter_config)
        self._held: dict[str, list[str]] = {}  # engine -> adapter names it holds, oldest first
        # adapter folders on disk, oldest first: those of an earlier run (a resume) included
        self._folders: list[str] = existing_adapter_folders(self.adapter_dir)
        self._pool = ThreadPoolExecutor(_MAX_HTTP_THREADS, thread_name_prefix="adapter-sync-http")

    # ------------------------------------------------------------------ membership

    def _member_added(self, name: str) -> None:
        self._held[name] = []  # it loads the current adapter at the next publish

    def _member_removed(self, client: EngineClient) -> None:
        client.close()
        self._held.pop(client.name, None)

    def connect(self, engines: Iterable[EngineEndpoint]) -> None:
        """Add engines and check each answers ``/health``; those that do not are dropped and named."""
        for endpoint in engines:
            self.add_engine(endpoint)
        with self._lock:
            clients = list(self._clients.values())
        futures = {c.name: self._pool.submit(c.healthy, HEALTH_PROBE_S) for c in clients}
        errors = {
            name: f"engine {name}: does not answer /health"
            for name, future in futures.items()
            if not future.result()
        }
        for name, reason in errors.items():
            self._drop(name, reason)
        if errors:
            raise WeightSyncError(describe(errors, "engines unreachable"), engines=sorted(errors))

    # ------------------------------------------------------------------ publish

    def publish(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        verify: bool | None = None,
    ) -> SyncMetrics:
        """Write adapter ``version`` and load it on every member engine (module docstring)."""
        if version < 0:
            raise ValueError(f"weight version must be >= 0, got {version}")
        verify = self.config.verify if verify is None else verify
        started = time.perf_counter()
        name = adapter_name(version)
        metrics = SyncMetrics(
            version=version, engines={n: EngineSyncStatus(n) for n in self.engines}
        )

        t0 = time.perf_counter()
        tensors = list(named_tensors)
        metrics.gather_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        folder, metrics.bytes = write_adapter_folder(
            self.adapter_dir, name, tensors, self.adapter_config
        )
        metrics.write_s = time.perf_counter() - t0
        metrics.num_tensors = len(tensors)
        metrics.num_buckets = 1

        with self._lock:
            clients = list(self._clients.values())
        t0 = time.perf_counter()
        futures = {
            c.name: self._pool.submit(self._push, c, name, str(folder), version, verify)
            for c in clients
        }
        errors: dict[str, str] = {}
        deadline = time.monotonic() + 3 * self.config.timeout_s  # unload, load, version
        for engine, future in futures.items():
            status = metrics.engines.setdefault(engine, EngineSyncStatus(engine))
            try:
                status.load_s, status.verified = future.result(
                    timeout=max(0.0, deadline - time.monotonic()) + 1.0
                )
            except EngineCallError as err:
                errors[engine] = str(err)
            except FutureTimeout:
                errors[engine] = (
                    f"engine {engine}: adapter load took over {3 * self.config.timeout_s:.0f}s"
                )
        load_s = time.perf_counter() - t0
        metrics.engine_load_s = max((s.load_s for s in metrics.engines.values()), default=0.0)
        for engine, reason in errors.items():
            self._drop(engine, reason)
            status = metrics.engines[engine]
            status.ok, status.error = False, reason
        self.latest_version = version
        self._prune_folders(name)
        metrics.total_s = time.perf_counter() - started
        moved_s = metrics.write_s + load_s
        metrics.gbps = metrics.bytes / moved_s / 1e9 if moved_s > 0 else 0.0
        log.debug("%s", metrics.summary())
        if errors:
            raise WeightSyncError(
                describe(errors, f"dropped during adapter version {version}"),
                engines=sorted(errors),
                version=version,
                metrics=metrics,
            )
        return metrics

    def _push(
        self, client: EngineClient, name: str, path: str, version: int, verify: bool
    ) -> tuple[float, bool | None]:
        """One engine: load ``name``, set the version, then unload (in the background) what
        it holds besides ``name`` and the previous adapter."""
        started = time.perf_counter()
        with self._lock:
            held = list(self._held.get(client.name, []))
        others = [n for n in held if n != name]
        previous = others[-1] if others else None
        if name in held:
            # the same version again (a retry, an engine rejoining): the engine has it already
            loaded: dict[str, Any] | None = None
        else:
            try:
                reply = client.load_lora_adapter(name, path)
            except EngineCallError as err:
                if _ALREADY_LOADED not in str(err):
                    raise
                # held from before this sender existed (a resumed learner): load it afresh
                self._unload(client, name)
                reply = client.load_lora_adapter(name, path)
            loaded = reply.get("loaded_adapters")
        with self._lock:
            if client.name in self._held:
                self._held[client.name] = [n for n in (previous, name) if n]
        stale = [n for n in others if n != previous]
        if stale:
            # SGLang answers an unload once no request uses the adapter: do not wait for that
            self._pool.submit(self._unload_quietly, client, stale)
        client.set_weight_version(str(version))
        verified = None
        if verify:
            problem = ""
            if loaded is not None and name not in loaded:
                problem = f"loaded_adapters {sorted(loaded)} lacks {name}"
            served = client.weight_version()
            if served != str(version):
                problem = problem or f"serves weight_version {served!r}, expected {version}"
            if problem:
                raise EngineCallError(client.name, "/load_lora_adapter", problem, unreachable=False)
            verified = True
        return time.perf_counter() - started, verified

    def _unload_quietly(self, client: EngineClient, names: list[str]) -> None:
        for name in names:
            try:
                self._unload(client, name)
            except EngineCallError as err:  # it only holds memory; the next version tries again
                log.warning("could not unload adapter %s: %s", name, err)
                with self._lock:
                    if client.name in self._held and name not in self._held[client.name]:
                        self._held[client.name].insert(0, name)

    @staticmethod
    def _unload(client: EngineClient, name: str) -> None:
        try:
            client.unload_lora_adapter(name)
        except EngineCallError as err:
            if _NOT_LOADED not in str(err):  # gone already (evicted, or replaced by the engine)
                raise

    def _prune_folders(self, current: str) -> None:
        """Keep the folders of the current and the previous version only."""
        if current in self._folders:
            self._folders.remove(current)
        self._folders.append(current)
        while len(self._folders) > 2:
            remove_adapter_folder(self.adapter_dir, self._folders.pop(0))

    # ------------------------------------------------------------------ helpers

    def _drop(self, name: str, reason: str) -> None:
        with self._lock:
            client = self._clients.pop(name, None)
            self._held.pop(name, None)
        if client is not None:
            client.close()
            log.error("dropping engine %s from weight sync: %s", name, reason)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for client in self._clients.values():
                client.close()
