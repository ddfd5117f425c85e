"""Small in-process fakes for rollout worker and fleet tests: engine client, reader items, sender,
rewards, engine actor."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleetrl.data.reader import PromptItem
from rollout_fleet.client import EngineError, generate_sample_sglang
from rollout_fleet.rewards.pipeline import RewardPipeline
from rollout_fleet.rewards.runner import RewardRunner


def prompt(index: int, data_source: str = "synth/add", length: int = 3) -> PromptItem:
    ids = np.arange(10 + index, 10 + index + length, dtype=np.int32)
    return PromptItem(
        index=index,
        prompt_ids=ids,
        data_source=data_source,
        ground_truth="1",
        extra_info={},
        raw_prompt=[{"role": "user", "content": "x"}],
    )


class FakeEngine:
    """An engine speaking SGLang's generate response format.

    Every output token is ``100 + position in the response``. ``version`` tags
    tokens; ``abort_first_after`` makes each sample's first request stop with
    finish_reason abort after that many tokens (and bumps the version, like an
    abort-mode weight update); ``fail`` raises EngineError; ``hold`` makes
    requests wait until ``release()``.
    """

    def __init__(self, name: str, *, version: int = 0, eos_at: int | None = None):
        self.name = name
        self.base_url = f"http://{name}"
        self.version = version
        self.eos_at = eos_at
        self.abort_first_after: int | None = None
        self.fail = False
        self.hold = False
        self.calls: list[dict[str, Any]] = []
        self.aborted_rids: list[str] = []
        self.inflight = 0
        self.max_inflight_groups = 0
        self._inflight_groups: dict[str, int] = {}
        self._gate = asyncio.Event()
        self._aborted_uids: set[str] = set()

    def release(self) -> None:
        self.hold = False
        self._gate.set()

    generate_sample = generate_sample_sglang  # the engine interface over SGLang's format

    async def generate(self, input_ids, sampling_params, return_logprob=True, rid=None):
        self.calls.append(
            {"input_ids": list(input_ids), "params": dict(sampling_params), "rid": rid}
        )
        group = rid.split("/")[0]
        self._inflight_groups[group] = self._inflight_groups.get(group, 0) + 1
        self.max_inflight_groups = max(self.max_inflight_groups, len(self._inflight_groups))
        self.inflight += 1
        try:
            if self.fail:
                raise EngineError(self.base_url, "/generate", None, "connection reset")
            while self.hold:
                self._gate.clear()
                await self._gate.wait()
            await asyncio.sleep(0)
            return self._respond(input_ids, sampling_params, rid)
        finally:
            self.inflight -= 1
            self._inflight_groups[group] -= 1
            if not self._inflight_groups[group]:
                del self._inflight_groups[group]

    def _respond(self, input_ids, params, rid):
        uid = rid.rsplit(".", 2)[0]
        budget = params["max_new_tokens"]
        start = sum(1 for t in input_ids if t >= 100)  # tokens generated before this request
        count, reason = budget, "length"
        version = self.version
        if self.abort_first_after is not None and uid not in self._aborted_uids:
            self._aborted_uids.add(uid)
            count, reason = min(budget, self.abort_first_after), "abort"
            self.version += 1  # the weight update that caused the abort
        ids = [100 + start + i for i in range(count)]
        if reason != "abort" and self.eos_at is not None and start + count > self.eos_at:
            ids = ids[: max(0, self.eos_at - start + 1)]
            reason = "stop"
        return {
            "text": "",
            "output_ids": ids,
            "meta_info": {
                "id": rid,
                "finish_reason": {"type": reason},
                "prompt_tokens": len(input_ids),
                "completion_tokens": len(ids),
                "weight_version": str(version),
                "output_token_logprobs": [[-0.5, t, None] for t in ids],
                "weight_versions": [{"version": str(version), "start": 0, "end": len(ids)}]
                if ids
                else [],
            },
        }

    async def abort_request(self, rid=None, abort_all=False):
        self.aborted_rids.append(rid)


class FakeTokenizer:
    eos_token_id = 2

    def decode(self, token_ids, skip_special_tokens=True):
        return " ".join(str(t) for t in token_ids)


def parity_reward(data_source, solution_str, ground_truth, extra_info):
    """Score = 1.0 when the response has an even number of tokens."""
    n = len(solution_str.split())
    return {"score": float(n % 2 == 0), "len": float(n)}


def fake_rewards(fn=parity_reward, **kwargs) -> RewardPipeline:
    """The real reward pipeline with ``fn`` as the custom function of every row."""
    return RewardPipeline(RewardRunner(5, 2, fn), **kwargs)


class CollectingSender:
    def __init__(self):
        self.trajectories = []
        self.threads: set[int] = set()
        self.lock = threading.Lock()

    def send(self, traj):
        with self.lock:
            self.threads.add(threading.get_ident())
            self.trajectories.append(traj)


@dataclass
class Admission:
    policy_version: int = 0
    accepted_groups: int = 0
    max_staleness: int = 0
    groups_per_version: int = 1000
    max_concurrent: int = 64


class FakeAdmission:
    """Buffer counters: accepted = groups sent so far (when tied to a sender)."""

    def __init__(self, sender: CollectingSender | None = None, group_size: int = 1):
        self.policy_version = 0
        self.sender = sender
        self.group_size = group_size
        self.polls = 0
        self.fail_next = 0
        self.max_staleness, self.groups_per_version, self.max_concurrent = 0, 1000, 64

    def __call__(self) -> Admission:
        self.polls += 1
        if self.fail_next:
            self.fail_next -= 1
            raise TimeoutError("buffer did not answer")
        accepted = len(self.sender.trajectories) // self.group_size if self.sender else 0
        return Admission(
            self.policy_version,
            accepted,
            self.max_staleness,
            self.groups_per_version,
            self.max_concurrent,
        )


class FakeMethod:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        async def call():
            return self.fn(*args)

        return call()


class FakeActor:
    """Stands in for a Ray actor handle: ``actor.method.remote()`` returns an awaitable."""

    launched = 0

    def __init__(self, spec, fail_start=False, node=""):
        FakeActor.launched += 1
        self.spec = spec
        self.node = node  # the Ray node it reports
        self.dead = False
        self.killed = False
        self.number = FakeActor.launched
        self.fail_start = fail_start
        self.start = FakeMethod(self._start)
        self.ping = FakeMethod(self._ping)
        self.stop = FakeMethod(lambda: None)

    def _start(self):
        if self.fail_start:
            raise RuntimeError("no model")
        return f"http://{self.spec.name}/{self.number}"

    def _ping(self):
        if self.dead:
            raise ConnectionError("actor died")
        return {"alive": True, "node": self.node}

    def kill(self):
        self.killed = True
