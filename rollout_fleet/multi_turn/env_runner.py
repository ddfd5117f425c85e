"""Run an environment step off the event loop with a timeout; a failure fails the sample.

``EnvRunner.step`` calls the environment (``rollout_fleet.multi_turn.environment``)
in a daemon thread (``rollout_fleet.threaded_call``) and awaits it for
``rollout.multi_turn.env_timeout_s``. Unlike a reward (which scores 0 on
failure), an environment that raises, runs past its timeout or returns
something that is not a message has no reply to give, so the conversation
cannot go on: ``EnvironmentFailed`` (a ``SampleFailed``) names the environment,
the sample and the cause, and the sample takes the path of a sample whose
engines all failed: its group is dropped and counted (validation counts it
failed); every other sample goes on.
"""

from __future__ import annotations

from typing import Any

from fleetrl.log import get_logger
from rollout_fleet.multi_turn.environment import EnvFn, check_observation
from rollout_fleet.sample_runner import SampleFailed
from rollout_fleet.threaded_call import ThreadedCalls

log = get_logger(__name__)


class EnvironmentFailed(SampleFailed):
    """The environment raised, timed out or answered with something that is not a message."""


class EnvRunner:
    """Timeout-bounded environment steps with counters (see the module docstring)."""

    def __init__(self, name: str, fn: EnvFn, *, timeout_s: float, max_workers: int) -> None:
        if timeout_s <= 0:
            raise ValueError(f"environment timeout_s must be > 0, got {timeout_s}")
        self.name = name
        self.fn = fn
        self.timeout_s = timeout_s
        self._calls = ThreadedCalls(max_workers)
        self.num_steps = 0
        self.num_errors = 0
        self.num_timeouts = 0
        self.env_s = 0.0

    @property
    def num_hung(self) -> int:
        return self._calls.num_hung

    async def step(
        self, uid: str, messages: list[dict[str, Any]], extra_info: Any
    ) -> tuple[dict[str, Any] | None, float]:
        """(the next observation or None when done, seconds the step took)."""
        self.num_steps += 1
        kwargs = {"messages": [dict(m) for m in messages], "extra_info": extra_info}
        try:
            outcome = await self._calls.call(self.fn, kwargs, self.timeout_s, f"env-{self.name}")
        except TimeoutError:
            self.num_timeouts += 1
            self.env_s += self.timeout_s
            raise self._failed(
                uid,
                f"timed out after {self.timeout_s:g} s (rollout.multi_turn.env_timeout_s; "
                f"{self.num_hung} hung environment threads)",
            ) from None
        self.env_s += outcome.elapsed_s
        if outcome.raised is not None:
            self.num_errors += 1
            raise self._failed(uid, f"raised {outcome.raised!r}") from outcome.raised
        try:
            return check_observation(outcome.value, self.name, uid), outcome.elapsed_s
        except ValueError as err:
            self.num_errors += 1
            raise EnvironmentFailed(str(err)) from None

    def _failed(self, uid: str, why: str) -> EnvironmentFailed:
        message = f"sample {uid}: environment {self.name!r} {why}"
        log.warning("%s", message)
        return EnvironmentFailed(message)
