"""What every embedded server shares: binding, the API key, its middlewares, serving threads.

``HttpService`` is the base of the generation engine (``server.EmbeddedEngine``) and the
reward-model engine (``reward_server.RewardEngine``): a subclass lists its routes in
``add_routes`` and gets

- the bind rule: 127.0.0.1 by default; a non-loopback host requires an API key
  (``api_key`` or ``FLEETRL_API_KEY``), as DESIGN section 4 asks; with a key every route
  but ``/health*`` (as in SGLang) needs ``Authorization: Bearer <key>`` or answers 401;
- the error middleware: a bad body (``msgspec`` validation, ``RequestError``) is a 400
  naming the field, anything else a logged 500; the server keeps serving;
- ``serve`` on the running loop, or ``start_server`` on a thread of its own, and
  ``stop_http`` to end either.

Left out: TLS (put a proxy in front), per-route keys (SGLang's admin key).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import os
import threading
from typing import Any, TypedDict

import msgspec
from aiohttp import web

from fleetrl.log import get_logger
from rollout_fleet.engine.http_json import error_response, json_response
from rollout_fleet.engine.requests import RequestError

log = get_logger(__name__)

API_KEY_ENV = "FLEETRL_API_KEY"
MAX_BODY_BYTES = 256 * 1024 * 1024
_STOP_TIMEOUT_S = 10.0


class EngineStartupError(ValueError):
    """The engine cannot start with the given options (e.g. off loopback without a key)."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_api_key(host: str, api_key: str | None, require_api_key: bool = False) -> str | None:
    """The key to enforce (argument, else ``FLEETRL_API_KEY``); refuses an open non-loopback
    bind, and any bind without a key when ``require_api_key`` (``fleetrl engine`` always)."""
    key = api_key or os.environ.get(API_KEY_ENV) or None
    if key is None and (require_api_key or not is_loopback(host)):
        raise EngineStartupError(
            f"refusing to serve on {host!r} without an API key: set {API_KEY_ENV} (e.g. "
            f"export {API_KEY_ENV}=$(python -c 'import secrets; print(secrets.token_urlsafe(32))'))"
            " or pass --api-key; clients send it as 'Authorization: Bearer <key>'"
        )
    return key


class ServiceOptions(TypedDict, total=False):
    """``HttpService``'s options, which each server's constructor passes on unchanged."""

    engine_id: str | None  # the server's name in logs and replies (default: the class's)
    device: str  # where the model runs: cpu (default) or cuda[:i]
    dtype: str  # the model's dtype (default float32)
    api_key: str | None  # the bearer key to require (else FLEETRL_API_KEY)
    require_api_key: bool  # refuse to serve without a key, loopback included
    num_threads: int | None  # torch threads on the CPU (default 1; None: torch's own)
    max_body_bytes: int  # the largest request body accepted


class HttpService:
    """An engine's aiohttp server with fleetrl's bind rule, bearer key and error handling."""

    default_engine_id = "engine-0"

    def __init__(
        self,
        model_path: str,
        *,
        engine_id: str | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        api_key: str | None = None,
        require_api_key: bool = False,
        num_threads: int | None = 1,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        """The options every server takes (a subclass passes them on as ``ServiceOptions``)."""
        import torch

        if device == "cpu" and num_threads:
            torch.set_num_threads(num_threads)  # the engine's share of the node's cores
        self.model_path = str(model_path)
        self.engine_id = engine_id or self.default_engine_id
        self.device = device
        self.dtype = dtype
        self.api_key = api_key
        self.require_api_key = require_api_key
        self.max_body_bytes = max_body_bytes
        self.base_url: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner_web: web.AppRunner | None = None

    def add_routes(self, router: web.UrlDispatcher) -> None:
        """Register the service's handlers (every one an SGLang route)."""
        raise NotImplementedError(f"{type(self).__name__} lists no routes")

    def model_info(self, *, is_generation: bool, weight_version: str, **extra: Any) -> web.Response:
        """SGLang's ``GET /model_info`` reply: the model, whether it generates, its version."""
        return json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": is_generation,
                "preferred_sampling_params": None,
                "weight_version": weight_version,
                **extra,
            }
        )

    def server_info(self, engine: str, **fields: Any) -> web.Response:
        """``GET /get_server_info``: which server, model, device and dtype, then ``fields``."""
        return json_response(
            {
                "engine": engine,
                "engine_id": self.engine_id,
                "model_path": self.model_path,
                "device": self.device,
                "dtype": self.dtype,
                **fields,
            }
        )

    def app(self, api_key: str | None) -> web.Application:
        app = web.Application(
            client_max_size=self.max_body_bytes,
            middlewares=[self._auth_middleware(api_key), self._error_middleware],
        )
        self.add_routes(app.router)
        return app

    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start serving on the running loop; returns the base URL (``port=0`` picks one)."""
        key = resolve_api_key(host, self.api_key, self.require_api_key)
        self._loop = asyncio.get_running_loop()
        self._runner_web = web.AppRunner(self.app(key), handler_cancellation=True, access_log=None)
        await self._runner_web.setup()
        site = web.TCPSite(self._runner_web, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url_host = f"[{host}]" if ":" in host else host
        self.base_url = f"http://{url_host}:{bound}"
        log.info(
            "%s serving %s at %s (auth %s)",
            self.engine_id,
            self.model_path,
            self.base_url,
            "on" if key else "off",
        )
        return self.base_url

    def start_server(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve from a background thread with its own event loop; returns the base URL."""
        resolve_api_key(host, self.api_key, self.require_api_key)  # fail here, not in the thread
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        result: dict[str, Any] = {}

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                result["url"] = loop.run_until_complete(self.serve(host, port))
            except OSError as err:
                result["error"] = err
            ready.set()
            if "url" in result:
                loop.run_forever()

        self._thread = threading.Thread(target=run, name=f"{self.engine_id}-http", daemon=True)
        self._thread.start()
        ready.wait()
        if "error" in result:
            raise EngineStartupError(f"cannot bind {host}:{port}: {result['error']}")
        return result["url"]

    async def shutdown(self) -> None:
        if self._runner_web is not None:
            await self._runner_web.cleanup()
            self._runner_web = None

    def stop_http(self) -> None:
        """Stop a server that ``start_server`` runs on its own thread."""
        loop = self._loop
        if loop is not None and self._thread is not None and loop.is_running():
            asyncio.run_coroutine_threadsafe(self.shutdown(), loop).result(_STOP_TIMEOUT_S)
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(_STOP_TIMEOUT_S)

    # -- middlewares -----------------------------------------------------------------------

    @staticmethod
    def _auth_middleware(api_key: str | None):
        expected = f"Bearer {api_key}".encode() if api_key else None

        @web.middleware
        async def auth(request: web.Request, handler):
            if expected is not None and not request.path.startswith("/health"):
                got = request.headers.get("Authorization", "").encode()
                if not hmac.compare_digest(got, expected):
                    return error_response(
                        "missing or wrong API key (Authorization: Bearer <key>)", 401
                    )
            return await handler(request)

        return auth

    @web.middleware
    async def _error_middleware(self, request: web.Request, handler):
        try:
            return await handler(request)
        except (msgspec.ValidationError, msgspec.DecodeError) as err:
            return error_response(f"invalid body for {request.path}: {err}")
        except RequestError as err:
            return error_response(f"{request.path}: {err}")
        except web.HTTPException:
            raise
        except asyncio.CancelledError:
            raise
        except Exception as err:  # service boundary: log with context, answer 500, keep serving
            log.exception("%s: %s %s failed", self.engine_id, request.method, request.path)
            return error_response(
                f"internal error in {request.path}: {type(err).__name__}: {err}", 500
            )
