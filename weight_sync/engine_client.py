"""HTTP calls the learner makes to one rollout engine during weight sync (SGLang's endpoints).

Only routes that SGLang 0.5.23's HTTP server has (the conformance tier runs
this client against SGLang's own app): ``/init_weights_update_group``,
``/begin_weight_update`` and ``/end_weight_update`` (every update must run
between them), ``/update_weights_from_distributed``,
``/destroy_weights_update_group``, ``/pause_generation``,
``/continue_generation``, ``/flush_cache``, ``GET /model_info`` (which holds
``weight_version``), ``/update_weight_version``, ``/get_weights_by_name`` (the
first rows of one tensor, for verification; SGLang answers it for some
architectures only), and for LoRA ``/load_lora_adapter`` and
``/unload_lora_adapter`` (their failures carry SGLang's ``error_message``), and for
co-located engines ``/update_weights_from_tensor`` (tensors by handle: see
``weight_sync.ipc_payload``).

Every call has a timeout, sends the engine's bearer key when it has one, and
turns every way it can fail (no connection, timeout, HTTP error status,
``{"success": false}``, a body that is not JSON) into ``EngineCallError``
naming the engine and the endpoint. Nothing here retries: the sender decides
what a failure means.

Left out: the generation endpoints (``rollout_fleet`` owns those).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import requests


@dataclass(frozen=True)
class EngineEndpoint:
    """Where one rollout engine listens; ``world_size`` is its number of ranks in the group (TP size).

    ``incarnation`` tells a replacement at the same URL from the process it replaced
    (``rollout_fleet.membership``): a different endpoint, so the group is formed again.
    """

    name: str
    url: str
    api_key: str | None = None
    world_size: int = 1
    incarnation: int = 0
    api: str = "sglang"  # the HTTP API the engine speaks: sglang | vllm (weight_sync.engine_api)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("EngineEndpoint.name must not be empty")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(
                f"engine {self.name}: url must start with http:// or https://, got {self.url!r}"
            )
        if self.world_size < 1:
            raise ValueError(f"engine {self.name}: world_size must be >= 1, got {self.world_size}")


@dataclass(frozen=True)
class GroupJoin:
    """What an engine needs to join the learner's weight group (the learner is rank 0).

    ``rank_offset`` is the engine's first rank (its TP ranks follow); ``bucket_bytes`` the
    sender's bucket size, for an API that sizes its receive buffers once at the join.
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str
    bucket_bytes: int = 0


class EngineCallError(RuntimeError):
    """One HTTP call to one engine failed; ``engine`` names it, ``unreachable`` says it did not answer."""

    def __init__(self, engine: str, endpoint: str, message: str, *, unreachable: bool) -> None:
        self.engine = engine
        self.endpoint = endpoint
        self.unreachable = unreachable
        super().__init__(f"engine {engine}: {endpoint}: {message}")


class EngineClient:
    """A small requests-based client bound to one engine (SGLang's API; ``weight_sync.engine_api``
    is the interface it implements)."""

    # tensors sent uncopied, one broadcast each inside one request, are SGLang's per-tensor
    # format; an engine API without it gets every tensor in a flat bucket
    takes_per_tensor_broadcasts = True
    weight_version_route = "/model_info"  # GET: a body with the version the engine serves

    def __init__(self, endpoint: EngineEndpoint, timeout_s: float) -> None:
        self.endpoint = endpoint
        self.timeout_s = float(timeout_s)
        self._session = requests.Session()
        if endpoint.api_key:
            self._session.headers["Authorization"] = f"Bearer {endpoint.api_key}"

    @property
    def name(self) -> str:
        return self.endpoint.name

    def call(
        self,
        path: str,
        payload: dict[str, Any] | None = None,
        *,
        method: str = "POST",
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        url = self.endpoint.url.rstrip("/") + path
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            response = self._session.request(method, url, json=payload, timeout=timeout)
        except requests.Timeout:
            raise EngineCallError(
                self.name, path, f"no reply within {timeout:.1f}s", unreachable=True
            ) from None
        except requests.ConnectionError as err:
            raise EngineCallError(
                self.name, path, f"cannot connect: {err}", unreachable=True
            ) from None
        try:
            body = response.json() if response.content else {}
        except ValueError:
            body = {"message": response.text[:300]}
        if not isinstance(body, dict):
            body = {"result": body}
        if response.status_code >= 400 or body.get("success") is False:
            message = (
                body.get("message")
                or body.get("error_message")
                or body.get("error")
                or body.get("detail")
                or response.reason
            )
            raise EngineCallError(
                self.name, path, f"HTTP {response.status_code}: {message}", unreachable=False
            )
        return body

    def healthy(self, timeout_s: float = 5.0) -> bool:
        """True if ``GET /health`` answers 2xx within ``timeout_s``."""
        try:
            self.call("/health", method="GET", timeout_s=timeout_s)
        except EngineCallError:
            return False
        return True

    def init_group(self, join: GroupJoin) -> dict[str, Any]:
        """Join the learner's group (``join.bucket_bytes``: SGLang learns the bucket size from
        each request instead)."""
        return self.call(
            "/init_weights_update_group",
            {
                "master_address": join.master_address,
                "master_port": join.master_port,
                "rank_offset": join.rank_offset,
                "world_size": join.world_size,
                "group_name": join.group_name,
                "backend": join.backend,
            },
        )

    def begin_update(self) -> dict[str, Any]:
        """Open the engine's weight-update session (SGLang refuses updates outside one)."""
        return self.call("/begin_weight_update", {})

    def end_update(self, weight_version: str | None = None) -> dict[str, Any]:
        """Close the session (SGLang took the version with each bucket already)."""
        return self.call("/end_weight_update", {})

    @staticmethod
    def weight_group(store: Any, **options: Any) -> Any:
        """Rank 0 of the group this API's engines join (``weight_sync.group.WeightGroup``)."""
        from weight_sync.group import WeightGroup

        return WeightGroup(store, **options)

    def update_weights(
        self,
        wire_fields: dict[str, list],
        *,
        group_name: str,
        weight_version: str,
        load_format: str | None,
    ) -> dict[str, Any]:
        """One bucket's metadata. ``flush_cache`` is always false here (SGLang's default is
        true): the cache is flushed once per version, by ``flush_cache``, where allowed."""
        return self.call(
            "/update_weights_from_distributed",
            {
                **wire_fields,
                "group_name": group_name,
                "flush_cache": False,
                "abort_all_requests": False,
                "weight_version": weight_version,
                "load_format": load_format,
            },
        )

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        *,
        load_format: str | None,
        weight_version: str,
    ) -> dict[str, Any]:
        """One bucket by handle (one base64 entry per engine TP rank). ``flush_cache`` is
        false: a co-located engine's cache was flushed when its KV cache was released."""
        return self.call(
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": serialized_named_tensors,
                "load_format": load_format,
                "flush_cache": False,
                "abort_all_requests": False,
                "weight_version": weight_version,
            },
        )

    def flush_cache(self) -> dict[str, Any]:
        """Drop cached prefixes (SGLang refuses while requests run, i.e. after an in_place pause)."""
        return self.call("/flush_cache", {})

    def destroy_group(self, group_name: str, timeout_s: float | None = None) -> dict[str, Any]:
        return self.call(
            "/destroy_weights_update_group", {"group_name": group_name}, timeout_s=timeout_s
        )

    def pause(self, mode: str) -> dict[str, Any]:
        return self.call("/pause_generation", {"mode": mode})

    def resume(self) -> dict[str, Any]:
        return self.call("/continue_generation", {})

    def weight_version(self) -> str:
        """The version the engine serves, from ``GET`` its ``weight_version_route``."""
        body = self.call(self.weight_version_route, method="GET")
        if "weight_version" not in body:
            raise EngineCallError(
                self.name,
                self.weight_version_route,
                "reply has no weight_version",
                unreachable=False,
            )
        return str(body["weight_version"])

    def set_weight_version(self, version: str) -> dict[str, Any]:
        """``/update_weight_version`` without aborting requests (SGLang's default aborts them all)."""
        return self.call(
            "/update_weight_version", {"new_version": version, "abort_all_requests": False}
        )

    def load_lora_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Load the PEFT folder at ``path`` (a path the engine reads) as adapter ``name``;
        the reply's ``loaded_adapters`` maps every loaded name to its path."""
        return self.call(
            "/load_lora_adapter", {"lora_name": name, "lora_path": path, "pinned": False}
        )

    def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        """Unload adapter ``name``; SGLang answers once no running request uses it."""
        return self.call("/unload_lora_adapter", {"lora_name": name})

    def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Load the checkpoint folder at ``model_path`` (a path the engine reads) in place;
        with ``weight_version`` the engine reports it from then on. Running requests are not
        aborted (SGLang lets them finish first)."""
        payload: dict[str, Any] = {"model_path": model_path, "abort_all_requests": False}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return self.call("/update_weights_from_disk", payload, timeout_s=timeout_s)

    def weights_by_name(self, name: str, rows: int) -> list | None:
        """The first ``rows`` rows (or elements) of one tensor as floats, or None when the
        engine cannot report it (SGLang implements this for some architectures only)."""
        try:
            body = self.call("/get_weights_by_name", {"name": name, "truncate_size": int(rows)})
        except EngineCallError as err:
            if err.unreachable:
                raise
            return None
        parameter = body.get("result", body.get("parameter"))
        return parameter if isinstance(parameter, list) else None

    def close(self) -> None:
        self._session.close()
