"""Judge access: what a custom reward function is handed to call a model itself.

An LLM judge or a generative reward model (verl's GenRM, slime's and AReaL's judges
through the rollout engines) needs the addresses of servers that can run it. A
custom reward function that declares any of these keywords gets them on every call,
current at the call (the fleet may have replaced a server); one that takes
``**kwargs`` gets them all but the keys, which go only to a function naming them:

==========================  ============================================================
``reward_router_address``   verl's name: ``host:port`` of one of the run's reward servers
                            (round robin over them, call by call, as verl's router
                            spreads requests); None when the run has none
``reward_model_tokenizer``  verl's name: the reward model's tokenizer (None without one)
``reward_servers``          every reward server, ``{name: base URL}``
``reward_api_key``          their bearer key (None: no key); only when named
``engine_urls``             the run's rollout engines, ``{name: base URL}`` (SGLang's or
                            the embedded engine's HTTP API: ``/generate``; they serve the
                            policy being trained, at the version they hold)
``engine_api_key``          their bearer key (the run's own); only when named
==========================  ============================================================

Left out: a router process of our own (the function picks a server from the
mapping, or takes ``reward_router_address``); rate limiting (an async function
can hold its own semaphore). A request to a rollout engine during a weight
update waits or comes back aborted, as the rollout's own requests do.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlparse

JUDGE_KEYWORDS = (
    "reward_router_address",
    "reward_model_tokenizer",
    "reward_servers",
    "reward_api_key",
    "engine_urls",
    "engine_api_key",
)
SECRET_KEYWORDS = frozenset({"reward_api_key", "engine_api_key"})  # only when named


def _nothing() -> Mapping[str, str]:
    return {}


def host_port(url: str) -> str:
    """``http://10.0.0.5:30010/`` -> ``10.0.0.5:30010`` (verl's router address form)."""
    parsed = urlparse(url if "//" in url else f"//{url}")
    return parsed.netloc or url


class JudgeAccess:
    """The judge keywords' values, read from live sources at each call."""

    def __init__(
        self,
        *,
        reward_servers: Callable[[], Mapping[str, str]] = _nothing,
        reward_api_key: str | None = None,
        engines: Callable[[], Mapping[str, str]] = _nothing,
        engine_api_key: str | None = None,
        reward_model_tokenizer: Any = None,
    ) -> None:
        self._reward_servers = reward_servers
        self._engines = engines
        self.reward_api_key = reward_api_key
        self.engine_api_key = engine_api_key
        self.reward_model_tokenizer = reward_model_tokenizer
        self._turn = itertools.count()

    def kwargs(self, wanted: frozenset[str]) -> dict[str, Any]:
        """The values of the keywords in ``wanted`` (a subset of ``JUDGE_KEYWORDS``)."""
        if not wanted:
            return {}
        servers = dict(self._reward_servers())
        out: dict[str, Any] = {}
        if "reward_router_address" in wanted:
            urls = [servers[name] for name in sorted(servers)]
            out["reward_router_address"] = (
                host_port(urls[next(self._turn) % len(urls)]) if urls else None
            )
        values = {
            "reward_model_tokenizer": lambda: self.reward_model_tokenizer,
            "reward_servers": lambda: servers,
            "reward_api_key": lambda: self.reward_api_key,
            "engine_urls": lambda: dict(self._engines()),
            "engine_api_key": lambda: self.engine_api_key,
        }
        for name, value in values.items():
            if name in wanted:
                out[name] = value()
        return out
