"""Which LoRA adapter a rollout request names, and the version its tokens carry.

With ``learner.lora.rank > 0`` every policy version is an adapter that the
learner loads on each engine as ``fleetrl-policy-v<version>``
(``weight_sync.adapter_sender``) and then tags the engine with
``weight_version = <version>``. A request names its adapter in ``lora_path``.

- Name: per engine, the adapter of the version the engine last reported
  (``meta_info.weight_version`` of its replies; ``GET /model_info`` when none
  is known yet or the engine said the named adapter is gone).
- Version tags: every token of a request comes from the adapter it named
  (SGLang applies adapters per request; the embedded engine aborts the requests
  of an adapter it replaces), so all its tokens carry that adapter's version.
  SGLang's ``weight_versions`` spans are not used here: they mark when the
  engine's version tag moved, which a request pinned to its adapter does not
  follow.
- Gone: an engine answers 400 with SGLang's message when a request names an
  adapter it no longer holds (``is_adapter_gone``); the sample runner follows
  the engine to its current name (``follow``: one ``/model_info`` per switch,
  however many requests meet it) and resubmits the piece.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from fleetrl.log import get_logger
from rollout_fleet.client import EngineError
from rollout_fleet.protocol import policy_version_of
from weight_sync.adapters import adapter_name, adapter_version

log = get_logger(__name__)

# SGLang 0.5.23's /generate errors for an adapter that is not (or no longer) loaded:
# "The following requested LoRA adapters are not loaded", "Got LoRA adapter that has
# never been loaded", "Failed to implicitly load LoRA adapter".
_GONE_MARKERS = ("LoRA adapters are not loaded", "never been loaded", "implicitly load LoRA")


class VersionSource(Protocol):
    async def get_weight_version(self) -> str: ...


def is_adapter_gone(error: BaseException) -> bool:
    """Whether ``error`` is an engine saying the adapter a request named is not loaded."""
    return (
        isinstance(error, EngineError)
        and error.status == 400
        and any(marker in error.message for marker in _GONE_MARKERS)
    )


class AdapterNames:
    """The adapter each engine serves now, as far as this rollout worker has seen."""

    def __init__(self) -> None:
        self._versions: dict[str, int] = {}
        self._asking: dict[str, asyncio.Lock] = {}  # one /model_info per engine at a time
        self.refreshes = 0

    def observe(self, engine: str, weight_version: str) -> None:
        """Note the version an engine reported (a reply's ``meta_info.weight_version``)."""
        version = policy_version_of(weight_version)
        if version >= 0:
            self._versions[engine] = version

    async def name_for(self, engine: str, client: Any) -> str:
        """The adapter to name in a request to ``engine`` (asks the engine when unknown)."""
        if engine not in self._versions:
            await self.refresh(engine, client)
        return adapter_name(self._versions[engine])

    async def follow(self, engine: str, client: VersionSource, gone: str) -> bool:
        """After ``engine`` said adapter ``gone`` is not loaded: True once another name is
        known for it. The requests that meet a switch together ask the engine once."""
        async with self._asking.setdefault(engine, asyncio.Lock()):
            known = self._versions.get(engine)
            if known is not None and adapter_name(known) != gone:
                return True  # another request already learned the new name
            return await self.refresh(engine, client)

    async def refresh(self, engine: str, client: VersionSource) -> bool:
        """Ask ``engine`` which version it serves; True if that changed the name."""
        before = self._versions.get(engine)
        reported = await client.get_weight_version()
        version = policy_version_of(reported)
        if version < 0:
            raise ValueError(
                f"engine {engine} reports weight_version {reported!r}, not a policy version:"
                " with LoRA on, engines must be tagged by the learner's adapter sync"
            )
        self._versions[engine] = version
        self.refreshes += 1
        if version != before:
            log.info("engine %s serves adapter %s", engine, adapter_name(version))
        return version != before

    def forget(self, engine: str) -> None:
        self._versions.pop(engine, None)

    @staticmethod
    def version_of(name: str) -> int:
        return adapter_version(name)
