"""The bearer-key check fleetrl puts in front of every route of a vLLM server.

vLLM 0.34's own ``--api-key`` (or ``VLLM_API_KEY``) guards only paths under ``/v1``,
``/v2``, ``/inference`` and ``/cohere`` (``vllm/entrypoints/serve/middleware/
authenticate.py``): the dev-mode routes fleetrl needs for weight sync (``/pause``,
``/init_weight_transfer_engine``, ``/update_weights``, ``/sleep``, and
``/collective_rpc``, which calls any worker method) would answer anyone who reaches the
port. fleetrl's rule is that nothing listens without authentication, loopback included,
so ``vllm serve`` gets this class through its own ``--middleware`` option
(``rollout_fleet.vllm_launcher``), which vLLM adds with ``app.add_middleware(cls)``.

The key comes from ``VLLM_API_KEY`` in the server's environment (never its command line,
where ``ps`` would show it); without one the server refuses to start. Every HTTP and
WebSocket request must carry ``Authorization: Bearer <key>`` (compared in constant
time), ``/health`` included: fleetrl's probes send it.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from typing import Any

KEY_ENV = "VLLM_API_KEY"

Scope = dict[str, Any]
App = Callable[[Scope, Any, Any], Awaitable[None]]


class RequireBearerKey:
    """ASGI middleware: 401 for any request without the server's bearer key."""

    def __init__(self, app: App) -> None:
        key = os.environ.get(KEY_ENV, "")
        if not key:
            raise RuntimeError(
                f"{KEY_ENV} is not set: fleetrl starts vLLM only behind a bearer key on every route"
            )
        self.app = app
        self._expected = f"Bearer {key}".encode()

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                return hmac.compare_digest(value, self._expected)
        return False

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = b'{"error": {"message": "Unauthorized", "type": "authentication_error"}}'
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
