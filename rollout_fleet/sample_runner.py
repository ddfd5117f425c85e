"""Drive one sample to completion across a changing fleet of engines.

``SampleRunner.generate(group_id, uid, sample, sampling_params)`` loops until
the sample is finished (stop or length):

1. ask the router for an engine (the group's pinned one, else the least busy);
   with none routable, wait for an engine event (or re-check every second);
2. submit prompt + everything generated so far, with ``max_new_tokens`` reduced
   to what is left and a fresh ``rid`` (``<uid>.<piece>.<attempt>``);
3. on a response, append its tokens, logprobs and per-token versions; a
   ``finish_reason`` of ``abort`` (the engine paused in abort mode for a weight
   update) simply loops again: the partial is kept and resubmitted;
4. on an ``EngineError`` or timeout, mark the engine suspect, back off and retry
   on another engine (the partial is kept); after ``max_sample_attempts``
   failures raise ``SampleFailed``;
5. when the router declares the engine dead, the request is cancelled at once
   (the listener below) and the sample continues elsewhere.

``top_logprobs`` k > 0 asks each piece for its tokens' k largest logprobs
(``SampleProgress.top_logprobs``). With ``on_tokens``, pieces are streamed where the
engine's client streams (``on_partial``): ``on_tokens(ids)`` is called with all of
the sample's generated ids so far each time more arrive. A streamed piece whose
request then fails or is lost keeps the tokens it had streamed (as an ``abort``
piece: ids, logprobs and versions as the engine sent them) and the sample goes on
from there, so what a caller was shown is never generated again differently.

With LoRA on (``adapters`` given), each request names the engine's current
adapter in ``lora_path`` and its tokens carry that adapter's version
(``rollout_fleet.adapters``); an engine that says the adapter is gone gets the
piece again under the name it reports now (not an engine failure, unless the
name did not change).

It also owns the engine clients (one per engine name; a restarted engine with a
new URL gets a new client from ``client_factory``), the count of requests in
flight, and the rollout idle time (wall time with no request in flight).

``generate_group`` runs a group's fresh samples: their first piece as one batched
``/generate`` (SGLang's batch form, ``rollout.batch_groups``: one HTTP round trip and
one request to parse on each side instead of n; at the CPU demo's 16 groups × 8 a
step the step went from 97 to 81 ms), then each sample that piece left unfinished
through the loop above, from the tokens it holds. Its lease counts n samples.

Left out: hedged requests (sending a straggler to a second engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from fleetrl.log import get_logger
from rollout_fleet.adapters import AdapterNames, is_adapter_gone
from rollout_fleet.client import EngineError, GenerateOutput
from rollout_fleet.engine_api import RolloutEngine
from rollout_fleet.membership import EngineStatus, MembershipError, MembershipEvent
from rollout_fleet.router import Lease, Router
from rollout_fleet.trajectory import ABORT, SampleProgress

log = get_logger(__name__)

_NO_ENGINE_RECHECK_S = 1.0
_ABORT_REQUEST_TIMEOUT_S = 5.0


class SampleFailed(RuntimeError):
    """A sample met more engine failures than ``max_attempts`` allows."""


class SampleRunner:
    """Runs samples on the fleet: routing, failover, abort-resubmit, in-flight accounting."""

    def __init__(
        self,
        router: Router,
        engines: Mapping[str, RolloutEngine],
        *,
        max_attempts: int = 8,
        retry_backoff_s: float = 0.5,
        client_factory: Callable[[str], RolloutEngine] | None = None,
        clock: Callable[[], float] = time.monotonic,
        adapters: AdapterNames | None = None,
    ):
        self.router = router
        self.adapters = adapters
        self.clients: dict[str, RolloutEngine] = dict(engines)
        self._client_urls: dict[str, str] = {}
        self.max_attempts = max_attempts
        self.retry_backoff_s = retry_backoff_s
        self.client_factory = client_factory
        self._clock = clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._inflight: dict[str, dict[asyncio.Future[Any], str | list[str]]] = {}  # -> rid(s)
        self._engines_changed = asyncio.Event()
        self._num_inflight = 0
        self._idle_since: float | None = None
        self._idle_total = 0.0
        self._started_at: float | None = None
        self._closing: set[asyncio.Future[Any]] = set()
        # counters
        self.tokens_generated = 0
        self.requests_sent = 0
        self.abort_resubmits = 0
        self.engine_errors = 0
        self.requests_lost_to_dead_engines = 0

    # ---- lifecycle ------------------------------------------------------------------------

    def attach(self) -> None:
        """Bind to the running event loop and listen to the membership (idempotent)."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None:
            raise RuntimeError("SampleRunner is already attached to another event loop")
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._engines_changed = asyncio.Event()
        self._started_at = self._idle_since = self._clock()
        self.router.membership.subscribe(self._on_engine_event)

    def detach(self) -> None:
        if self._loop is not None:
            with contextlib.suppress(ValueError):
                self.router.membership.unsubscribe(self._on_engine_event)
            self._loop = None

    async def aclose(self) -> None:
        """Detach and close every client's HTTP session."""
        self.detach()
        for client in list(self.clients.values()):
            self._close_later(client)
        self.clients.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def set_client(self, name: str, client: RolloutEngine) -> None:
        self.clients[name] = client

    def remove_client(self, name: str) -> None:
        self.clients.pop(name, None)

    # ---- the sample loop ------------------------------------------------------------------

    async def generate_group(
        self,
        group_id: str,
        uids: list[str],
        samples: list[SampleProgress],
        sampling_params: dict[str, Any],
    ) -> None:
        """Run a group's fresh samples until each is finished: their first piece as one
        batched request where the engine's client takes one (``generate_batch``), then every
        sample that piece left unfinished (abort, a failed or lost request) alone through
        ``generate``; ``SampleFailed`` as ``generate`` raises it (in an exception group)."""
        self.attach()
        if len(samples) > 1 and self.adapters is None:
            await self._batched_first_piece(
                group_id, dict(zip(uids, samples, strict=True)), sampling_params
            )
        async with asyncio.TaskGroup() as tasks:
            for uid, sample in zip(uids, samples, strict=True):
                if not sample.finished:
                    tasks.create_task(self.generate(group_id, uid, sample, sampling_params))

    async def _batched_first_piece(
        self, group_id: str, samples: dict[str, SampleProgress], params: dict[str, Any]
    ) -> None:
        """One ``POST /generate`` for every sample of the group (uid -> sample; one HTTP
        round trip and one request to parse on each side instead of n). Whatever goes wrong
        is left to the per-sample loop, which starts from what each sample holds."""
        lease = self.router.acquire(group_id, count=len(samples))
        if lease is None:
            return
        client = self.clients.get(lease.engine)
        batch = getattr(client, "generate_batch", None)
        if batch is None:
            self.router.release(lease)
            return
        rids = [f"{uid}.{sample.pieces}.0" for uid, sample in samples.items()]
        first = next(iter(samples.values()))
        piece = {**params, "max_new_tokens": first.remaining_tokens}
        prompts = [s.resume_input_ids() for s in samples.values()]
        request = await self._send(lease, batch(prompts, piece, rids=rids), rids)
        if request.cancelled():
            self.requests_lost_to_dead_engines += 1
            log.info("batched request of group %s lost with engine %s", group_id, lease.engine)
            return
        error = request.exception()
        if error is not None:
            if not isinstance(error, EngineError | TimeoutError | ValueError):
                raise error
            self.engine_errors += 1
            self._suspect(lease, f"{type(error).__name__}: {error}")
            log.warning(
                "batched request of group %s on %s failed: %s", group_id, lease.engine, error
            )
            return
        for (uid, sample), output in zip(samples.items(), request.result(), strict=True):
            try:
                self.tokens_generated += sample.add(output, lease.engine)
            except ValueError as err:  # this sample's output was malformed: it runs again alone
                log.warning("sample %s: bad response from %s: %s", uid, lease.engine, err)
                continue
            if sample.finish_reason == ABORT:
                self.abort_resubmits += 1

    async def generate(
        self,
        group_id: str,
        uid: str,
        sample: SampleProgress,
        sampling_params: dict[str, Any],
        *,
        top_logprobs: int = 0,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> None:
        """Run ``sample`` until it is finished; raise SampleFailed after too many failures."""
        self.attach()
        failures = 0
        while not sample.finished:
            streamed: list[GenerateOutput] = []  # the latest partial of this piece
            lease = self.router.acquire(group_id)
            client = self.clients.get(lease.engine) if lease is not None else None
            if lease is None or client is None:
                if lease is not None:
                    self.router.release(lease)
                    log.warning("engine %s has no client yet; waiting", lease.engine)
                await self._wait_engines_changed()
                continue
            params = {**sampling_params, "max_new_tokens": sample.remaining_tokens}
            rid = f"{uid}.{sample.pieces}.{failures}"
            extra: dict[str, Any] = {}
            if self.adapters is not None:
                try:
                    extra["lora_path"] = await self.adapters.name_for(lease.engine, client)
                except (EngineError, TimeoutError) as err:
                    self.router.release(lease)
                    failures += 1
                    self.engine_errors += 1
                    self._suspect(lease, f"no weight version: {err}")
                    if failures >= self.max_attempts:
                        raise SampleFailed(
                            f"sample {uid}: {failures} engine failures (max_sample_attempts="
                            f"{self.max_attempts}); last engine {lease.engine}: {err}"
                        ) from None
                    await asyncio.sleep(self.retry_backoff_s)
                    continue
            if top_logprobs:
                extra["top_logprobs"] = top_logprobs
            if on_tokens is not None:
                extra["on_partial"] = self._on_partial(sample, streamed, on_tokens)
            call = client.generate_sample(sample.resume_input_ids(), params, rid=rid, **extra)
            request = await self._send(lease, call, rid)
            if request.cancelled():
                self.requests_lost_to_dead_engines += 1
                failures += 1
                self._keep_streamed(sample, streamed, lease.engine, extra.get("lora_path"))
                log.info("request %s lost with engine %s; resubmitting", rid, lease.engine)
            elif self.adapters is not None and is_adapter_gone(request.exception()):
                # the engine moved to a newer adapter: ask which, resubmit under its name
                if await self._follow_adapter(lease.engine, client, extra["lora_path"]):
                    continue
                failures += 1
                await asyncio.sleep(self.retry_backoff_s)
            else:
                error = self._take_piece(request, sample, lease.engine, extra.get("lora_path"))
                if error is None:
                    continue
                failures += 1
                self.engine_errors += 1
                self._suspect(lease, error)
                self._keep_streamed(sample, streamed, lease.engine, extra.get("lora_path"))
                log.warning("request %s on %s failed: %s", rid, lease.engine, error)
                if failures < self.max_attempts:
                    await asyncio.sleep(self.retry_backoff_s)
            if failures >= self.max_attempts:
                raise SampleFailed(
                    f"sample {uid}: {failures} engine failures (max_sample_attempts="
                    f"{self.max_attempts}); last engine {lease.engine}"
                )

    async def _send(self, lease: Lease, call: Any, rid: str | list[str]) -> asyncio.Future[Any]:
        """Run the request ``call`` on ``lease``'s engine, tracked in flight (a dead engine's
        requests are cancelled, ``abort_inflight`` aborts ``rid``), until it ends in any way;
        the lease is handed back. The finished future: its result, error or cancellation."""
        request = asyncio.ensure_future(call)
        self._track(lease, request, rid)
        try:
            await asyncio.wait({request})
        except asyncio.CancelledError:
            request.cancel()
            raise
        finally:
            self._untrack(lease, request)
            self.router.release(lease)
        self.requests_sent += 1
        return request

    @staticmethod
    def _on_partial(
        sample: SampleProgress,
        streamed: list[GenerateOutput],
        on_tokens: Callable[[list[int]], None],
    ) -> Callable[[GenerateOutput], None]:
        def on_partial(partial: GenerateOutput) -> None:
            streamed[:] = [partial]
            on_tokens(sample.output_ids + partial.output_ids[: sample.remaining_tokens])

        return on_partial

    def _keep_streamed(
        self,
        sample: SampleProgress,
        streamed: list[GenerateOutput],
        engine: str,
        adapter: str | None,
    ) -> None:
        """After a streamed piece failed: keep the tokens it had streamed, as an aborted piece."""
        if not streamed or not streamed[0].output_ids or sample.finished:
            return
        partial = msgspec.structs.replace(streamed[0], finish_reason=ABORT)
        if adapter is not None and self.adapters is not None:
            tag = self.adapters.version_of(adapter)
            partial = msgspec.structs.replace(
                partial, token_versions=[tag] * len(partial.output_ids)
            )
        try:
            self.tokens_generated += sample.add(partial, engine)
        except ValueError as err:  # a partial whose lists disagree: regenerate those tokens
            log.warning("streamed tokens of %s not kept: %s", engine, err)

    async def _follow_adapter(self, engine: str, client: Any, gone: str) -> bool:
        """After ``engine`` said adapter ``gone`` is not loaded: True once a newer name is known."""
        assert self.adapters is not None
        try:
            return await self.adapters.follow(engine, client, gone)
        except (EngineError, TimeoutError, ValueError) as err:
            log.warning("engine %s: cannot read its weight version: %s", engine, err)
            return False

    def _take_piece(
        self,
        request: asyncio.Future[Any],
        sample: SampleProgress,
        engine: str,
        adapter: str | None = None,
    ) -> str | None:
        """Append the response to ``sample``; return an error text if the engine failed.
        With ``adapter`` (LoRA), every token carries that adapter's version."""
        exc = request.exception()
        if exc is not None:
            if isinstance(exc, EngineError | TimeoutError):
                return f"{type(exc).__name__}: {exc}"
            if isinstance(exc, ValueError):  # a reply the client could not parse
                return f"bad response: {exc}"
            raise exc
        try:
            output = request.result()
            if adapter is not None and self.adapters is not None:
                self.adapters.observe(engine, output.weight_version)
                tag = self.adapters.version_of(adapter)
                output = msgspec.structs.replace(
                    output, token_versions=[tag] * len(output.output_ids)
                )
            taken = sample.add(output, engine)
        except ValueError as err:  # malformed response (InconsistentPieceError included)
            return f"bad response: {err}"
        self.tokens_generated += taken
        if sample.finish_reason == ABORT:
            self.abort_resubmits += 1
        return None

    # ---- in-flight accounting and engine events -------------------------------------------

    @property
    def num_inflight(self) -> int:
        return self._num_inflight

    def idle_fraction(self) -> float:
        """Share of wall time since attach with no request in flight."""
        if self._started_at is None:
            return 0.0
        now = self._clock()
        idle = self._idle_total + (now - self._idle_since if self._idle_since is not None else 0.0)
        wall = now - self._started_at
        return idle / wall if wall > 0 else 0.0

    def inflight_rids(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for name, reqs in self._inflight.items():
            for rid in reqs.values():  # a batched request holds one rid per sample
                out.setdefault(name, []).extend([rid] if isinstance(rid, str) else rid)
        return out

    async def abort_inflight(self) -> None:
        """Ask every engine to drop the requests this runner has in flight (best effort)."""
        calls = []
        for name, rids in self.inflight_rids().items():
            client = self.clients.get(name)
            if client is not None:
                calls += [self._abort_one(name, client, rid) for rid in rids]
        if calls:
            await asyncio.gather(*calls)

    async def _abort_one(self, name: str, client: RolloutEngine, rid: str) -> None:
        try:
            await asyncio.wait_for(client.abort_request(rid=rid), _ABORT_REQUEST_TIMEOUT_S)
        except (EngineError, TimeoutError) as err:
            log.info("abort of %s on %s failed (engine may be gone): %s", rid, name, err)

    def _track(self, lease: Lease, request: asyncio.Future[Any], rid: str | list[str]) -> None:
        self._inflight.setdefault(lease.engine, {})[request] = rid
        if self._num_inflight == 0 and self._idle_since is not None:
            self._idle_total += self._clock() - self._idle_since
            self._idle_since = None
        self._num_inflight += 1

    def _untrack(self, lease: Lease, request: asyncio.Future[Any]) -> None:
        self._inflight.get(lease.engine, {}).pop(request, None)
        self._num_inflight -= 1
        if self._num_inflight == 0:
            self._idle_since = self._clock()

    async def _wait_engines_changed(self) -> None:
        self._engines_changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._engines_changed.wait(), _NO_ENGINE_RECHECK_S)

    def _suspect(self, lease: Lease, error: str) -> None:
        """Report a failed request; the engine may have stopped serving or been replaced
        meanwhile (health checks, weight sync), which makes the report moot."""
        try:
            self.router.membership.suspect(lease.engine, error, incarnation=lease.incarnation)
        except MembershipError as err:
            log.debug("failed request on %s not reported: %s", lease.engine, err)

    def _on_engine_event(self, event: MembershipEvent) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if threading.get_ident() == self._loop_thread:
            self._handle_engine_event(event)
        else:
            loop.call_soon_threadsafe(self._handle_engine_event, event)

    def _handle_engine_event(self, event: MembershipEvent) -> None:
        # requests on an engine that must reload weights or is gone are regenerated
        # elsewhere; a draining engine finishes its own
        if event.removed or event.status in (EngineStatus.DEAD, EngineStatus.NEEDS_WEIGHTS):
            lost = list(self._inflight.get(event.name, {}))
            for request in lost:
                request.cancel()
            if lost:
                log.warning(
                    "engine %s %s: %d requests in flight go to other engines",
                    event.name,
                    "removed" if event.removed else event.status,
                    len(lost),
                )
            if event.removed and (gone := self.clients.pop(event.name, None)) is not None:
                self._close_later(gone)  # its HTTP session, without blocking the loop
        elif event.url and self.client_factory is not None:
            old = self.clients.get(event.name)
            old_url = self._client_urls.get(event.name) or getattr(old, "base_url", None)
            if old is None or old_url != event.url:
                self.clients[event.name] = self.client_factory(event.url)
                self._client_urls[event.name] = event.url
                if old is not None:
                    self._close_later(old)
        self._engines_changed.set()

    def _close_later(self, client: RolloutEngine) -> None:
        """Close a replaced client's HTTP session without blocking the event loop."""
        close = getattr(client, "close", None)
        if close is None:
            return
        result = close()
        if asyncio.iscoroutine(result):
            task = asyncio.ensure_future(result)
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
