"""The weight sender's group lifecycle: form the broadcast group with the current members,
blame the engines a failed formation is on, tear the group down when membership changes.

``GroupLifecycle`` is a part of ``weight_sync.sender.WeightSender`` (one weight-update group
on learner rank 0, SGLang's rendezvous: DESIGN.md §5); it reads the sender's members
(``_clients`` under ``_lock``), its group state (``_group``, ``_store``, ``_group_clients``,
``_generation``, ``_instance``, ``_leaving``), ``config``, ``master_address``, ``backend``,
``bucket_bytes``, ``device``, its HTTP thread pool and its ``_gather_calls`` and ``_drop``.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

from fleetrl.log import get_logger
from weight_sync.engine_client import EngineCallError, EngineClient, GroupJoin
from weight_sync.group import MasterStore, WeightGroup

log = get_logger(__name__)

HEALTH_PROBE_S = 5.0  # how long an engine has to answer /health when blame is decided


class GroupLifecycle:
    """Forming, blaming and tearing down the weight group (see the module docstring)."""

    _clients: dict[str, EngineClient]
    _lock: Any
    _group: WeightGroup | None
    _store: MasterStore | None
    _group_clients: list[EngineClient]
    _leaving: list[EngineClient]

    def _ensure_group(self) -> dict[str, str]:
        """Form the group with the current members if it is missing or stale; return dropped engines."""
        with self._lock:
            wanted = list(self._clients.values())
        if self._group is not None and self._group_clients == wanted:  # the same clients
            return {}
        self._teardown_group(notify=True, abort=False)
        errors: dict[str, str] = {}
        while wanted:
            failed = self._form_group(wanted)
            if not failed:
                break
            errors.update(failed)
            for name, reason in failed.items():
                self._drop(name, reason)
            wanted = [c for c in wanted if c.name not in failed]
        return errors

    def _form_group(self, members: list[EngineClient]) -> dict[str, str]:
        self._generation += 1
        group_name = f"{self.config.group_name}-{self._instance}-{self._generation}"
        world_size = 1 + sum(c.endpoint.world_size for c in members)
        store = MasterStore(self.master_address, self.config.timeout_s)
        deadline = time.monotonic() + self.config.timeout_s
        futures: dict[str, Future] = {}
        rank_offset = 1
        for client in members:
            join = GroupJoin(
                master_address=self.master_address,
                master_port=store.port,
                rank_offset=rank_offset,
                world_size=world_size,
                group_name=group_name,
                backend=self.backend,
                bucket_bytes=self.bucket_bytes,
            )
            futures[client.name] = self._pool.submit(client.init_group, join)
            rank_offset += client.endpoint.world_size
        group: WeightGroup | None = None
        join_error = ""
        try:
            assert store.store is not None
            group = members[0].weight_group(  # the group this engine API's ranks join
                store.store,
                group_name=group_name,
                rank=0,
                world_size=world_size,
                backend=self.backend,
                timeout_s=self.config.timeout_s,
                master_address=self.master_address,
                device=self.device,
            )
        except RuntimeError as err:  # DistError / gloo timeouts: some rank never joined
            join_error = str(err).splitlines()[0] if str(err) else type(err).__name__
            store.close()  # engines still waiting in the rendezvous fail now, not at their timeout
        call_errors = self._gather_calls(futures, deadline)
        if group is not None and not call_errors:
            self._group, self._store, self._group_clients = group, store, list(members)
            log.info(
                "weight group %s formed: %s, world %d, engines %s",
                group_name,
                self.backend,
                world_size,
                [c.name for c in members],
            )
            return {}
        if group is not None:
            group.close(abort=True)
        store.close()
        failed = self._blame(members, call_errors, f"group {group_name} did not form: {join_error}")
        for client in members:  # engines that did join this attempt forget it
            if client.name not in failed:
                self._best_effort_destroy(client, group_name)
        return failed

    def _blame(
        self, members: list[EngineClient], call_errors: dict[str, EngineCallError], reason: str
    ) -> dict[str, str]:
        """Which engines a failed group operation is blamed on, with why.

        Most certain first: engines that no longer answer ``/health``; then those
        whose call got no reply (dead or hung); then those that replied with an
        error (possibly only collateral of another's failure); else everyone.
        """
        unhealthy = {c.name for c in members if not c.healthy(HEALTH_PROBE_S)}
        silent = {n for n, err in call_errors.items() if err.unreachable}
        blamed = unhealthy or silent or set(call_errors) or {c.name for c in members}
        errors = {}
        for name in blamed:
            call_error = call_errors.get(name)
            errors[name] = (str(call_error) if call_error else f"engine {name}: {reason}") + (
                " (engine does not answer /health)" if name in unhealthy else ""
            )
        return errors

    def _teardown_group(self, *, notify: bool, abort: bool) -> None:
        group, store, clients = self._group, self._store, self._group_clients
        self._group, self._store, self._group_clients = None, None, []
        with self._lock:
            leaving, self._leaving = self._leaving, []
        if group is not None and notify:
            # members and removed engines leave the group; engines dropped (failed) are not asked
            with self._lock:
                alive = [c for c in clients if self._clients.get(c.name) is c or c in leaving]
            for client in alive:
                self._best_effort_destroy(client, group.group_name)
        for client in leaving:
            client.close()
        if group is None:
            return
        group.close(abort=abort)
        if store is not None:
            store.close()

    def _best_effort_end(self, client: EngineClient) -> None:
        """Close an open weight-update session, so the next version's begin is accepted."""
        try:
            client.end_update()
        except EngineCallError as err:
            log.warning("could not end the weight update on %s: %s", client.name, err)

    def _best_effort_destroy(self, client: EngineClient, group_name: str) -> None:
        try:
            client.destroy_group(group_name, timeout_s=HEALTH_PROBE_S)
        except EngineCallError as err:
            log.warning("could not destroy group %s on %s: %s", group_name, client.name, err)
