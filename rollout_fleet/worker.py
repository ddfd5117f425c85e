"""The rollout worker: start GRPO groups as the staleness bound allows, score, send whole.

One asyncio loop drives the whole fleet (engines are HTTP servers; the worker
only waits on sockets)::

    while not stopping:
        state    = the buffer's admission state       (policy_version, accepted_groups,
                                                        and the rule's B, η, concurrency)
        capacity = StalenessAdmission.from_state(state).capacity(v, accepted, running_groups)
        start `capacity` groups with prompts from the reader
        sleep until a group finishes, a version is published (admission_changed)
              or admission_poll_interval_s passes
    drain: let groups in flight finish (stop deadline), abort the rest

A group is the ``n`` samples of one prompt. Each sample is one request with its
own ``rid`` (so one sample can be aborted, resubmitted or moved to another
engine alone), run by ``SampleRunner`` (routing, failover, abort-resubmit), then
decoded and given its rule score off the event loop as it finishes
(``RewardPipeline.rule_score``). When all ``n`` are generated, what needs the
whole group is scored in one go (``score_group``: the reward model's batched
call, a batched reward function), while other groups keep generating; then the
group's trajectories are sent, one after another, on a single sender thread: a
PUSH blocked at the high-water mark never stalls the event loop, and the group
counts as *running* until it is sent, so backpressure reaches admission. A group
is sent once and whole; if one sample exhausts its attempts the group is
dropped and counted (``groups_failed``).

A sample whose reward failed (rollout_fleet/rewards/pipeline.py) is sent with its
group, marked with ``Trajectory.reward_error``: it trains nothing and stays out of
its group's statistics. A group whose every sample's reward failed has nothing to
train on: it is dropped and counted (``reward/groups_failed``), not sent; after
``max_failed_reward_groups`` of them in a row ``reward_stop_reason`` says why the run should
stop (rollout_fleet/rewards/failure_streak.py).

With ``rollout.multi_turn.env`` set, a sample is a conversation instead of one
completion: ``rollout_fleet.multi_turn.driver`` runs its turns on the same
``SampleRunner`` and the environment's replies between them; the reward scores
the whole decoded response. A failing environment fails its sample as an
engine failure does (the group is dropped and counted).

``validate(prompts)`` runs a validation set through the same machinery (one
greedy sample per prompt by default, multi-turn too when it is on) and returns
mean scores per data source (the combined reward ``val/score`` and, apart, the rule
score and the model score), and a fixed choice of its samples (rollout_fleet/validation.py).

An elastic fleet (``serving_share``) scales the concurrency cap with the engines serving
now, as a share of ``rollout.num_engines``: a fleet grown to three engines starts groups for
three, one shrunk to one for one. The staleness window itself does not change: η holds
whatever the fleet's size.

Staleness: ``running_groups`` counts groups from start until fully sent, plus
(with a ``ledger``, rollout_fleet/delivery.py) those sent whole that the buffer
has not yet been seen to hold: without the ledger a group in ZeroMQ transit is
briefly in neither count and admission may run ahead by those groups (the
buffer's hand-out check is the safety net). The reader's cursor advances when a
group starts; the ledger re-queues the groups in flight at a checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from buffer.admission import StalenessAdmission
from buffer.wire import Trajectory
from fleetrl.data.reader import PromptItem
from fleetrl.log import get_logger
from rollout_fleet.adapters import AdapterNames
from rollout_fleet.agents.groups import AgentGroups
from rollout_fleet.config import RolloutConfig
from rollout_fleet.delivery import group_id_for
from rollout_fleet.engine_api import RolloutEngine
from rollout_fleet.multi_turn.driver import MultiTurnDriver
from rollout_fleet.rewards.failure_streak import FailureStreak
from rollout_fleet.rewards.pipeline import SampleReward
from rollout_fleet.router import Router
from rollout_fleet.sample_runner import SampleFailed, SampleRunner
from rollout_fleet.trajectory import SampleProgress, build_trajectory
from rollout_fleet.validation import Validation, ValResult, pick_samples, summarize
from rollout_fleet.worker_ports import (
    AdmissionCounters,
    Detokenizer,
    GroupRewards,
    SentLedger,
    TrajectorySink,
)

log = get_logger(__name__)


@dataclass
class _Generated:
    """One finished sample: its tokens, its decoded text and its rule score (if taken yet)."""

    sample: SampleProgress
    text: str
    rule: Any = None  # RewardResult, or None until its group is scored
    generate_s: float = 0.0
    turns: int = 1
    env_s: float | None = None  # multi-turn: seconds in environment steps


@dataclass
class _Group:
    group_id: str
    prompt: PromptItem
    task: asyncio.Task[None] | None = None


class RolloutWorker:
    """Samples groups on an engine fleet under the staleness bound; see the module docstring."""

    def __init__(
        self,
        config: RolloutConfig,
        *,
        engines: Mapping[str, RolloutEngine],
        router: Router,
        reader: Iterable[PromptItem] | Iterator[PromptItem],
        sender: TrajectorySink,
        admission_source: Callable[[], Any],
        rewards: GroupRewards,
        tokenizer: Detokenizer,
        stop_token_ids: list[int] | None = None,
        client_factory: Callable[[str], RolloutEngine] | None = None,
        ledger: SentLedger | None = None,
        lora: bool = False,
        serving_share: Callable[[], float] | None = None,
        max_prompt_tokens: int | None = None,
        gateway_host: str = "127.0.0.1",
        max_failed_reward_groups: int = 0,
    ):
        self.config = config
        # elastic fleets: the engines serving now over the start size; the concurrency cap
        # (rollout.max_concurrent_groups, sized for num_engines) scales with it
        self._serving_share = serving_share
        self.router = router
        # lora: requests name the engines' current LoRA adapter (rollout_fleet.adapters)
        self.runner = SampleRunner(
            router,
            engines,
            max_attempts=config.max_sample_attempts,
            retry_backoff_s=config.retry_backoff_s,
            client_factory=client_factory,
            adapters=AdapterNames() if lora else None,
        )
        self._prompts = iter(reader)
        self._sender = sender
        self._admission_source = admission_source
        # sent, not yet acknowledged: the delivery ledger's (see the module docstring)
        self._ledger = ledger
        self._rewards = rewards
        self._tokenizer = tokenizer
        if stop_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            stop_token_ids = [] if eos is None else [int(eos)]
        self.stop_token_ids = stop_token_ids
        self.multi_turn = (
            MultiTurnDriver(config.multi_turn, self.runner, tokenizer)
            if config.multi_turn.enabled
            else None
        )
        # rollout.agent: a sample is an agent episode through the gateway (rollout_fleet/agents)
        self.agents = self._agent_groups(max_prompt_tokens, gateway_host)
        self._groups: dict[str, _Group] = {}
        self._wake = asyncio.Event()
        self._stopping = False
        self._stop_deadline_s = config.stop_deadline_s
        self._running = False
        self._stopped = asyncio.Event()
        # one thread per blocking resource: ZeroMQ sockets must not be shared across threads
        self._send_thread = ThreadPoolExecutor(1, thread_name_prefix="rollout-send")
        self._admission_thread = ThreadPoolExecutor(1, thread_name_prefix="rollout-admission")
        self._started_at: float | None = None
        self.last_admission: Any = None
        self._fatal: BaseException | None = None
        # counters
        self.groups_started = 0
        self.groups_finished = 0
        self.groups_failed = 0
        self.groups_cancelled = 0
        self.groups_reward_failed = 0  # every sample's reward failed: nothing to send
        self.reward_streak = FailureStreak(max_failed_reward_groups)
        self.samples_sent = 0
        self.admission_errors = 0
        self.send_s = 0.0

    def _agent_groups(self, max_prompt_tokens: int | None, host: str) -> AgentGroups | None:
        if not self.config.agent.enabled:
            return None
        if max_prompt_tokens is None:
            raise ValueError("an agent rollout needs max_prompt_tokens (data.max_prompt_length)")
        from rollout_fleet.agents.rollout import AgentRollout

        agents = AgentRollout(
            self.config.agent, self.runner, self._tokenizer,
            max_prompt_tokens=max_prompt_tokens, host=host,
        )  # fmt: skip
        return AgentGroups(agents, self._rewards, self.config.n)

    # ---- public API -----------------------------------------------------------------------

    @property
    def running_groups(self) -> int:
        """Groups started and not yet fully sent (or dropped), plus those sent but not yet
        acknowledged by the buffer (when a ``ledger`` is given)."""
        in_transit = self._ledger.sent_unconfirmed() if self._ledger is not None else 0
        return len(self._groups) + in_transit

    def add_engine(self, name: str, client: RolloutEngine) -> None:
        """Use ``client`` for engine ``name`` (register the engine with the router too)."""
        self.runner.set_client(name, client)

    def remove_engine(self, name: str) -> None:
        self.runner.remove_client(name)

    def sampling_params(self, temperature: float | None = None) -> dict[str, Any]:
        cfg = self.config
        params: dict[str, Any] = {
            "temperature": cfg.temperature if temperature is None else temperature,
            "top_p": cfg.top_p,
            "top_k": cfg.top_k,
            "max_new_tokens": cfg.max_new_tokens,
        }
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        return params

    async def run(self, num_groups: int | None = None) -> None:
        """Generate until ``stop()`` (or until ``num_groups`` groups were started and ended)."""
        if self._running:
            raise RuntimeError("RolloutWorker.run is already running")
        self._running = True
        self._stopped = asyncio.Event()
        self._wake = asyncio.Event()
        self.runner.attach()
        self._started_at = time.monotonic()
        sampling = self.sampling_params()
        try:
            while not self._stopping and self._fatal is None:
                budget = None if num_groups is None else num_groups - self.groups_started
                if budget is not None and budget <= 0:
                    break
                capacity = await self._capacity()
                if budget is not None:
                    capacity = min(capacity, budget)
                if not self._start_groups(capacity, sampling):
                    log.info("the prompt reader is exhausted: no more groups start")
                    break
                await self._sleep_until_woken(self.config.admission_poll_interval_s)
            if self._fatal is not None:
                await self._drain(0.0)
                raise RuntimeError(f"rollout group crashed: {self._fatal!r}") from self._fatal
            await self._drain(None if not self._stopping else self._stop_deadline_s)
            if self._fatal is not None:  # a group crashed while the last ones drained
                raise RuntimeError(f"rollout group crashed: {self._fatal!r}") from self._fatal
        finally:
            self._running = False
            self._stopped.set()

    def admission_changed(self) -> None:
        """A new policy version was published (the buffer already counts it): check admission
        now, not at the next poll. Without this a synchronous run (η = 0) starts each batch
        up to ``admission_poll_interval_s`` after the version it waits for."""
        self._wake.set()

    async def stop(self, deadline_s: float | None = None, *, abort: bool = False) -> None:
        """Stop admitting; groups in flight get ``deadline_s`` to finish, then are aborted."""
        self._stopping = True
        self._stop_deadline_s = (
            0.0 if abort else (self.config.stop_deadline_s if deadline_s is None else deadline_s)
        )
        self._wake.set()
        if self._running:
            await self._stopped.wait()
        else:
            await self._drain(self._stop_deadline_s)

    async def aclose(self) -> None:
        """Release engine clients, threads and the router subscription (after ``stop``)."""
        if self.agents is not None:
            await self.agents.agents.close()
        await self.runner.aclose()
        self._send_thread.shutdown(wait=False, cancel_futures=True)
        self._admission_thread.shutdown(wait=False, cancel_futures=True)

    async def validate(
        self,
        prompts: Iterable[PromptItem],
        *,
        temperature: float | None = None,
        keep_samples: int = 0,
        sample_seed: int = 0,
    ) -> Validation:
        """Score one sample per prompt (greedy by default): the metrics (rollout_fleet/
        validation.py) and ``keep_samples`` of the samples, a choice fixed by ``sample_seed``."""
        self.runner.attach()
        temp = self.config.val_temperature if temperature is None else temperature
        sampling = self.sampling_params(temp)
        limit = asyncio.Semaphore(self.config.max_concurrent_groups)
        results: list[ValResult] = []
        failed: list[str] = []
        total = 0

        async def one(position: int, prompt: PromptItem) -> None:
            async with limit:
                group_id = f"val-{position}-{group_id_for(prompt)}"
                try:
                    if self.agents is not None:  # the same agent program, one episode
                        result = await self.agents.validate(group_id, position, prompt, sampling)
                        results.append(result)
                        return
                    done = await self._run_sample(group_id, 0, prompt, sampling)
                except SampleFailed as err:
                    failed.append(group_id)
                    log.error("validation sample %s failed: %s", group_id, err)
                    return
                finally:
                    self.router.finish_group(group_id)
                (reward,) = await self._rewards.score_group(
                    prompt, [done.text], [done.rule], record=False
                )
                results.append(ValResult(position, prompt, done.sample, reward, done.turns))

        async with asyncio.TaskGroup() as tasks:
            for position, prompt in enumerate(prompts):
                total = position + 1
                tasks.create_task(one(position, prompt))
        turns = self.multi_turn is not None or self.agents is not None
        metrics = summarize(results, len(failed), multi_turn=turns)
        decode = functools.partial(self._tokenizer.decode, skip_special_tokens=True)
        samples = pick_samples(results, total, keep_samples, sample_seed, decode)
        return Validation(metrics=metrics, samples=samples)

    def metrics(self) -> dict[str, float]:
        wall = time.monotonic() - self._started_at if self._started_at is not None else 0.0
        tokens = self.runner.tokens_generated
        out = {
            "rollout/groups_started": self.groups_started,
            "rollout/groups_finished": self.groups_finished,
            "rollout/groups_running": self.running_groups,
            "rollout/groups_failed": self.groups_failed,
            "rollout/groups_cancelled": self.groups_cancelled,
            "reward/groups_failed": self.groups_reward_failed,
            "reward/groups_failed_in_a_row": self.reward_streak.in_a_row,
            "rollout/samples_sent": self.samples_sent,
            "rollout/tokens_generated": tokens,
            "rollout/gen_tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "rollout/idle_fraction": self.runner.idle_fraction(),
            "rollout/requests_in_flight": self.runner.num_inflight,
            "rollout/requests_sent": self.runner.requests_sent,
            "rollout/abort_resubmits": self.runner.abort_resubmits,
            "rollout/engine_errors": self.runner.engine_errors,
            "rollout/requests_lost_to_dead_engines": self.runner.requests_lost_to_dead_engines,
            "rollout/admission_errors": self.admission_errors,
            "rollout/send_s": self.send_s,
        }
        if self.runner.adapters is not None:  # LoRA: times an engine was asked for its adapter
            out["rollout/adapter_refreshes"] = self.runner.adapters.refreshes
        if self.multi_turn is not None:
            out.update(self.multi_turn.stats())
        if self.agents is not None:
            out.update(self.agents.agents.stats())
        out.update(self._rewards.stats())
        return {k: float(v) for k, v in out.items()}

    # ---- admission ------------------------------------------------------------------------

    async def _capacity(self) -> int:
        await self._settle_in_transit()
        state = await self._poll_admission()
        if state is None:
            return 0
        self.last_admission = state
        admission = StalenessAdmission.from_state(state)
        if self._serving_share is not None:  # the fleet's current capacity, at least one group
            cap = math.ceil(admission.max_concurrent * self._serving_share())
            admission = dataclasses.replace(admission, max_concurrent=max(1, cap))
        return admission.capacity(state.policy_version, state.accepted_groups, self.running_groups)

    async def _poll_admission(self) -> AdmissionCounters | None:
        try:
            if inspect.iscoroutinefunction(self._admission_source):
                return await self._admission_source()
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._admission_thread, self._admission_source)
        except (OSError, TimeoutError, RuntimeError, ValueError) as err:
            # the buffer is a separate service: count, log, and try again next poll
            self.admission_errors += 1
            log.warning("admission poll failed (%d so far): %s", self.admission_errors, err)
            return None

    async def _settle_in_transit(self) -> None:
        """Let the ledger forget sent groups the buffer now holds whole (before admission)."""
        ledger = self._ledger
        if ledger is None or not ledger.sent_unconfirmed():
            return
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(
                self._admission_thread, functools.partial(ledger.reconcile, sent_only=True)
            )
        except (OSError, TimeoutError, RuntimeError, ValueError) as err:
            self.admission_errors += 1
            log.warning("delivery check failed (%d so far): %s", self.admission_errors, err)

    async def _sleep_until_woken(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout_s)
        self._wake.clear()

    # ---- groups ---------------------------------------------------------------------------

    def _start_groups(self, count: int, sampling: dict[str, Any]) -> bool:
        """Start ``count`` groups; False when the reader ran out of prompts."""
        for _ in range(count):
            prompt = next(self._prompts, None)
            if prompt is None:
                return False
            self._start_group(prompt, sampling)
        return True

    def _start_group(self, prompt: PromptItem, sampling: dict[str, Any]) -> None:
        group_id = group_id_for(prompt)
        if group_id in self._groups:  # the same prompt position again (reader seek): keep apart
            group_id = f"{group_id}-{self.groups_started}"
        group = _Group(group_id, prompt)
        self._groups[group_id] = group
        self.groups_started += 1
        group.task = asyncio.create_task(self._run_group(group, sampling), name=group_id)
        group.task.add_done_callback(self._note_crash)

    def _note_crash(self, task: asyncio.Task[None]) -> None:
        """A group task that died of an unexpected error stops the worker loudly."""
        if not task.cancelled() and task.exception() is not None and self._fatal is None:
            self._fatal = task.exception()
            self._wake.set()

    async def _run_group(self, group: _Group, sampling: dict[str, Any]) -> None:
        try:
            if self.agents is not None:
                trajectories = await self.agents.run(group.group_id, group.prompt, sampling)
            else:
                trajectories = await self._sample_group(group, sampling)
            if all(traj.reward_failed for traj in trajectories):
                self._drop_unscored(group, trajectories)
                return
            self.reward_streak.scored()
            t0 = time.monotonic()
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._send_thread, self._send_all, trajectories)
            self.send_s += time.monotonic() - t0
            self.groups_finished += 1
            self.samples_sent += len(trajectories)
        except* SampleFailed as failures:
            self.groups_failed += 1
            log.error("group %s dropped: %s", group.group_id, failures.exceptions[0])
            if self._ledger is not None:  # nothing of it will be sent: neither awaited nor redone
                self._ledger.forget(group.group_id)
        finally:
            self._groups.pop(group.group_id, None)
            self.router.finish_group(group.group_id)
            self._wake.set()

    async def _sample_group(self, group: _Group, sampling: dict[str, Any]) -> list[Trajectory]:
        """The group's n samples, generated concurrently (``rollout.batch_groups``: one
        request for all, ``SampleRunner.generate_group``) and scored (``SampleFailed`` if one
        exhausted its attempts)."""
        if self.multi_turn is None and self.config.batch_groups:
            done = await self._batched_samples(group, sampling)
        else:
            async with asyncio.TaskGroup() as tasks:
                pending = [
                    tasks.create_task(self._run_sample(group.group_id, i, group.prompt, sampling))
                    for i in range(self.config.n)
                ]
            done = [task.result() for task in pending]
        rewards = await self._rewards.score_group(
            group.prompt, [d.text for d in done], [d.rule for d in done]
        )
        return [
            self._trajectory(group, i, d, reward, sampling["temperature"])
            for i, (d, reward) in enumerate(zip(done, rewards, strict=True))
        ]

    async def _batched_samples(self, group: _Group, sampling: dict[str, Any]) -> list[_Generated]:
        """The group's n single-turn samples through ``SampleRunner.generate_group``, each
        decoded and rule-scored as ``_run_sample`` does it."""
        prompt = [int(t) for t in group.prompt.prompt_ids]
        samples = [SampleProgress(prompt, sampling["max_new_tokens"]) for _ in range(self.config.n)]
        uids = [f"{group.group_id}/{i}" for i in range(self.config.n)]
        t0 = time.monotonic()
        await self.runner.generate_group(group.group_id, uids, samples, sampling)
        generate_s = time.monotonic() - t0
        scoring = (self._scored(group.prompt, s, generate_s, 1, None) for s in samples)
        return list(await asyncio.gather(*scoring))

    def _drop_unscored(self, group: _Group, trajectories: list[Trajectory]) -> None:
        """Every sample's reward failed: nothing of the group can train; drop it, counted."""
        self.groups_reward_failed += 1
        self.reward_streak.failed(trajectories[0].reward_error)
        if self.groups_reward_failed <= 20 or self.groups_reward_failed % 1000 == 0:
            log.warning(
                "group %s dropped: the reward of all %d samples failed (%s); %d such groups",
                group.group_id,
                len(trajectories),
                trajectories[0].reward_error,
                self.groups_reward_failed,
            )
        if self._ledger is not None:  # nothing of it will be sent: neither awaited nor redone
            self._ledger.forget(group.group_id)

    async def _run_sample(
        self, group_id: str, index: int, prompt: PromptItem, sampling: dict[str, Any]
    ) -> _Generated:
        uid = f"{group_id}/{index}"
        t0 = time.monotonic()
        turns, env_s = 1, None
        if self.multi_turn is not None:
            conversation = await self.multi_turn.generate(group_id, uid, prompt, sampling)
            sample, turns, env_s = conversation.sample, conversation.turns, conversation.env_s
        else:
            sample = SampleProgress([int(t) for t in prompt.prompt_ids], sampling["max_new_tokens"])
            await self.runner.generate(group_id, uid, sample, sampling)
        return await self._scored(prompt, sample, time.monotonic() - t0, turns, env_s)

    async def _scored(
        self,
        prompt: PromptItem,
        sample: SampleProgress,
        generate_s: float,
        turns: int,
        env_s: float | None,
    ) -> _Generated:
        """A finished sample decoded and scored by the rule (the group's score comes later)."""
        text = self._tokenizer.decode(sample.output_ids, skip_special_tokens=True)
        rule = await self._rewards.rule_score(prompt, text)
        return _Generated(sample, text, rule, generate_s, turns, env_s)

    def _trajectory(
        self,
        group: _Group,
        index: int,
        done: _Generated,
        reward: SampleReward,
        temperature: float,
    ) -> Trajectory:
        return build_trajectory(
            done.sample,
            group_id=group.group_id,
            sample_index=index,
            group_size=self.config.n,
            score=reward.score,
            data_source=group.prompt.data_source,
            prompt_index=group.prompt.index,
            reward_metrics=reward.metrics,
            timings={
                "generate_s": done.generate_s,
                "reward_s": reward.rule_s,
                "reward_group_s": reward.group_s,
                **({"env_s": done.env_s} if done.env_s is not None else {}),
            },
            temperature=temperature,
            reward_error=reward.error or "",
        )

    def _send_all(self, trajectories: list[Trajectory]) -> None:
        for traj in trajectories:
            self._sender.send(traj)

    async def _drain(self, deadline_s: float | None) -> None:
        """Wait for the groups in flight (up to ``deadline_s``), then abort what is left."""
        tasks = [g.task for g in self._groups.values() if g.task is not None]
        if not tasks:
            return
        log.info("draining %d groups in flight (deadline %s s)", len(tasks), deadline_s)
        _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        if not pending:
            return
        await self.runner.abort_inflight()
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self.groups_cancelled += len(pending)
        log.warning("stop deadline passed: %d groups in flight were aborted", len(pending))
