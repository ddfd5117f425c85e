"""JSON in and out of the embedded engine's aiohttp handlers.

Shared by the server and its route holders (``weight_routes``, ``adapter_routes``):
``read_body`` decodes a request body into a typed ``rollout_fleet.protocol`` Struct
(a bad field raises ``msgspec.ValidationError``, which the server's error
middleware turns into a 400 naming it); ``json_response`` and ``error_response``
encode replies, the latter in SGLang's ``{"error": {"message", "code"}}`` shape.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from rollout_fleet.engine.requests import RequestError


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(data), status=status, content_type="application/json"
    )


def error_response(message: str, status: int = 400) -> web.Response:
    return json_response({"error": {"message": message, "code": status}}, status)


async def read_body(request: web.Request, struct: type, *, optional: bool = False) -> Any:
    """The body decoded as ``struct``; an empty body is ``struct()`` if ``optional``, else 400."""
    raw = await request.read()
    if not raw.strip():
        if optional:
            return struct()
        raise RequestError(f"{request.path} needs a JSON body")
    return msgspec.json.decode(raw, type=struct)
