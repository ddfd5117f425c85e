"""HTTP calls the learner makes to one rollout engine during weight sync (SGLang's endpoints).

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
    """Where one rollout engine listens; ``world_size`` is its number of ranks in the group (TP size)."""

    name: str
    url: str
    api_key: str | None = None
    world_size: int = 1

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("EngineEndpoint.name must not be empty")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(
                f"engine {self.name}: url must start with http:// or https://, got {self.url!r}"
            )
        if self.world_size < 1:
            raise ValueError(f"engine {self.name}: world_size must be >= 1, got {self.world_size}")


class EngineCallError(RuntimeError):
    """One HTTP call to one engine failed; ``engine`` names it, ``unreachable`` says it did not answer."""

    def __init__(self, engine: str, endpoint: str, message: str, *, unreachable: bool) -> None:
        self.engine = engine
        self.endpoint = endpoint
        self.unreachable = unreachable
        super().__init__(f"engine {engine}: {endpoint}: {message}")


class EngineClient:
    """A small requests-based client bound to one engine."""

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
            message = body.get("message") or body.get("error") or response.reason
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

    def init_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> dict[str, Any]:
        return self.call(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    def update_weights(
        self,
        wire_fields: dict[str, list],
        *,
        group_name: str,
        weight_version: str,
        flush_cache: bool,
        load_format: str | None,
    ) -> dict[str, Any]:
        return self.call(
            "/update_weights_from_distributed",
            {
                **wire_fields,
                "group_name": group_name,
                "flush_cache": flush_cache,
                "weight_version": weight_version,
                "load_format": load_format,
            },
        )

    def destroy_group(self, group_name: str, timeout_s: float | None = None) -> dict[str, Any]:
        return self.call(
            "/destroy_weights_update_group", {"group_name": group_name}, timeout_s=timeout_s
        )

    def pause(self, mode: str) -> dict[str, Any]:
        return self.call("/pause_generation", {"mode": mode})

    def resume(self) -> dict[str, Any]:
        return self.call("/continue_generation", {})

    def weight_version(self) -> str:
        return str(self.call("/get_weight_version", method="GET").get("weight_version"))

    def weights_digest(self, *, per_param: bool = False) -> tuple[str, str, dict[str, str] | None]:
        """(weight_version, digest, per-tensor sha256 or None) from ``GET /fleetrl/weights_digest``."""
        path = "/fleetrl/weights_digest" + ("?per_param=1" if per_param else "")
        body = self.call(path, method="GET")
        if "digest" not in body or (per_param and not isinstance(body.get("per_param"), dict)):
            raise EngineCallError(
                self.name,
                path,
                f"reply lacks the digest fields: {str(body)[:200]}",
                unreachable=False,
            )
        return str(body.get("weight_version")), str(body["digest"]), body.get("per_param")

    def close(self) -> None:
        self._session.close()
