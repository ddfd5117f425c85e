"""Agent episodes as the rollout: the gateway, the agent calls, and what each episode leaves.

::

    AgentRollout.run_episode(group, i, prompt, sampling)
      SessionTable.open ─► (episode, key)                       per-episode key
      agent(base_url, key, sample=row)   async on the loop, or sync in a thread,
        │  ≤ max_concurrency at once, timeout_s               ──► calls ─► gateway ─► fleet
        ▼
      close the key ─► EpisodeOutcome: the episode's leaf branches (its trajectories),
                       the agent's reward (float | None) and its last reply, or why it failed

An episode fails, counted by cause (``agent/episodes_failed/<cause>``), and
nothing of it trains, when its agent raises, runs past ``timeout_s``, returns
NaN, inf or something that is neither a number nor None, never called the model,
or when one of its calls could not be served or the gateway restarted under it.

``AgentRollout.start`` binds the gateway and starts its watchdog: every
``health_check_interval_s`` the gateway is probed over the network as an agent
reaches it; one that does not answer is restarted on the same port and its live
episodes fail (``agent/gateway_restarts``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from fleetrl.log import get_logger
from rollout_fleet.agents.config import AgentConfig
from rollout_fleet.agents.entrypoint import AgentFn, load_agent, sample_row
from rollout_fleet.gateway.calls import CallRunner
from rollout_fleet.gateway.episodes import Episode, SessionTable
from rollout_fleet.gateway.rendering import ChatRenderer
from rollout_fleet.gateway.server import AgentGateway
from rollout_fleet.gateway.tool_parsers import detect_tool_format
from rollout_fleet.sample_runner import SampleRunner
from rollout_fleet.threaded_call import ThreadedCalls
from rollout_fleet.trajectory import SampleProgress

log = get_logger(__name__)


@dataclass
class EpisodeOutcome:
    """What one episode left: its trajectories and reward, or why it failed."""

    uid: str
    leaves: list[SampleProgress] = field(default_factory=list)
    reward: float | None = None  # the agent's; None: the reward pipeline scores last_reply
    last_reply: str = ""
    failure: str = ""  # cause ("" = succeeded)
    detail: str = ""
    seconds: float = 0.0
    calls: int = 0

    @property
    def failed(self) -> bool:
        return bool(self.failure)


def _check_reward(value: Any) -> tuple[float | None, str]:
    """(the reward, "") or (None, why it is not one)."""
    if value is None:
        return None, ""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None, f"returned a {type(value).__name__}, not a float or None"
    if not math.isfinite(value):
        return None, f"returned {value}, not a finite reward"
    return float(value), ""


class AgentRollout:
    """Runs agent episodes on the fleet through the gateway (see the module docstring)."""

    def __init__(
        self,
        config: AgentConfig,
        runner: SampleRunner,
        tokenizer: Any,
        *,
        max_prompt_tokens: int,
        host: str = "127.0.0.1",
        agent: AgentFn | None = None,
    ) -> None:
        self.config = config
        self.agent = agent or load_agent(config.entrypoint)
        renderer = ChatRenderer(tokenizer)
        renderer.check_template()
        name = renderer.name
        if config.tool_format == "auto":
            tool_format = detect_tool_format(getattr(tokenizer, "chat_template", None), name)
        else:
            tool_format = config.tool_format
        self.sessions = SessionTable()
        self.calls = CallRunner(
            runner, renderer, tool_format=tool_format, max_prompt_tokens=max_prompt_tokens,
            vocab_size=len(tokenizer),
        )  # fmt: skip
        self.gateway = AgentGateway(
            self.sessions, self.calls, model_name=config.model_name,
            token_text=lambda token: tokenizer.decode([token]),
        )  # fmt: skip
        self.host = config.host or host
        self._threads = ThreadedCalls(config.max_concurrency)
        self._slots: asyncio.Semaphore | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._starting = asyncio.Lock()
        self.episodes = 0
        self.failures: Counter[str] = Counter()
        self.episode_s = 0.0
        self.trajectories = 0

    async def start(self) -> str:
        """Bind the gateway and start its one watchdog, once; the base_url agents get.

        Later episodes get the same address, also while the watchdog restarts the gateway
        on it (an episode never binds a gateway of its own)."""
        async with self._starting:
            if self._watchdog is None:
                await self.gateway.start(self.host, self.config.port)
                self._slots = asyncio.Semaphore(self.config.max_concurrency)
                self._watchdog = asyncio.create_task(self._watch(), name="agent-gateway-watchdog")
        return self.gateway.base_url

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
        self.sessions.fail_all("the rollout worker stopped")
        await self.gateway.stop()
        self._threads.close()

    async def _watch(self) -> None:
        """Restart the gateway after ``health_check_failures`` probes in a row failed (one
        slow probe on a loaded machine is not a dead gateway), or at once when a restart
        left it unbound."""
        missed = 0
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            if await self.gateway.healthy(self.config.health_check_timeout_s):
                missed = 0
                continue
            missed += 1
            if self.gateway.serving and missed < self.config.health_check_failures:
                continue
            log.error(
                "agent gateway on %s did not answer %d probes: restarting it",
                self.gateway.base_url, missed,
            )  # fmt: skip
            try:
                await self.gateway.restart()
                missed = 0
            except OSError as err:  # the port is taken meanwhile: try again next round
                log.error("agent gateway restart failed: %s", err)

    async def run_episode(
        self, group_id: str, index: int, prompt: Any, sampling: dict[str, Any]
    ) -> EpisodeOutcome:
        """Run the agent once for ``prompt`` as episode ``<group_id>/e<index>``."""
        base_url = await self.start()
        assert self._slots is not None
        async with self._slots:
            episode, key = self.sessions.open(f"{group_id}/e{index}", group_id, sampling)
            t0 = time.monotonic()
            try:
                reward, failure, detail = await self._call_agent(base_url, key, prompt, episode)
            finally:
                self.sessions.close(episode)
        outcome = self._outcome(episode, reward, failure, detail, time.monotonic() - t0)
        self.episodes += 1
        self.episode_s += outcome.seconds
        if outcome.failed:
            self.failures[outcome.failure] += 1
            log.warning("agent episode %s failed: %s", episode.uid, outcome.detail)
        else:
            self.trajectories += len(outcome.leaves)
        return outcome

    async def _call_agent(
        self, base_url: str, key: str, prompt: Any, episode: Episode
    ) -> tuple[float | None, str, str]:
        """(reward, failure cause, detail) of one agent call."""
        kwargs = {"base_url": base_url, "api_key": key, "sample": sample_row(prompt)}
        timeout = self.config.timeout_s
        try:
            if inspect.iscoroutinefunction(self.agent):
                value = await asyncio.wait_for(self.agent(**kwargs), timeout)
            else:
                outcome = await self._threads.call(
                    self.agent, kwargs, timeout, f"agent-{episode.uid}"
                )
                if outcome.raised is not None:
                    return None, "raised", f"the agent raised {outcome.raised!r}"
                value = outcome.value
        except TimeoutError:
            return None, "timeout", f"the agent ran past rollout.agent.timeout_s={timeout:g}"
        except Exception as err:  # user code: the episode fails, counted; the run goes on
            return None, "raised", f"the agent raised {err!r}"
        reward, why = _check_reward(value)
        return reward, ("bad_reward" if why else ""), (f"the agent {why}" if why else "")

    def _outcome(self, episode: Episode, reward: float | None, failure: str, detail: str,
                 seconds: float) -> EpisodeOutcome:  # fmt: skip
        out = EpisodeOutcome(episode.uid, reward=reward, last_reply=episode.last_reply,
                             seconds=seconds, calls=episode.calls)  # fmt: skip
        if episode.failure:  # the root cause: the agent's own error (a 401, a 503) follows it
            failure = "gateway_restart" if "restarted" in episode.failure else "call_failed"
            detail = episode.failure
        if not failure and not episode.leaves():
            failure, detail = "no_calls", "the agent never called the model"
        out.failure, out.detail = failure, detail
        if not failure:
            out.leaves = [b.progress for b in episode.leaves()]
        return out

    def stats(self) -> dict[str, float]:
        out = {
            "agent/episodes": float(self.episodes),
            "agent/episodes_failed": float(sum(self.failures.values())),
            "agent/episode_s": self.episode_s,
            "agent/trajectories": float(self.trajectories),
            "agent/hung_threads": float(self._threads.num_hung),
        }
        for cause, count in self.failures.items():
            out[f"agent/episodes_failed/{cause}"] = float(count)
        out.update(self.gateway.stats())
        return out
