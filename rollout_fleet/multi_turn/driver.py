"""Drive one multi-turn sample: the policy speaks, the environment replies, until done.

::

    response = []                                   # one SampleProgress, budget max_new_tokens
    for turn in 1..max_turns:
        generate a turn on prompt + response         # SampleRunner: aborts, resubmits, failover
        append it (loss_mask 1)
        if the turn ran out of budget: finish "length"
        observation = env(messages, extra_info)      # off the loop, with a timeout
        if observation is None: finish "stop"        # the environment is done
        if turn == max_turns: finish "length"        # it would go on, the limit says no
        append the template's tokens for it (loss_mask 0, logprob 0.0, the version of
        the token before); if they fill the budget: finish "length"

Each turn is a sample of its own for ``SampleRunner.generate`` (its own
request ids, ``<uid>/t<turn>.<piece>.<attempt>``, and its own
``max_sample_attempts``), so a weight update that aborts a turn, or an engine
that dies in it, resumes that turn exactly as a single-turn sample resumes.
The group stays pinned to its engine across turns (prefix cache).

``rollout.max_new_tokens`` bounds the whole response, generated and
environment tokens together (verl's ``response_length``); an environment
reply is cut at the budget. The reward function is then called on the
decoded whole response (special tokens skipped, environment text included,
as verl passes it) with the row's ``extra_info``.

Left out: a per-turn token limit, tool-call parsing (the environment reads
the text), and environment objects holding state between turns (an
environment is a function of the conversation so far, which it gets whole).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleetrl.data.reader import PromptItem
from rollout_fleet.multi_turn.chat_turns import ChatTokenizer, ChatTurns
from rollout_fleet.multi_turn.config import MultiTurnConfig
from rollout_fleet.multi_turn.env_runner import EnvRunner
from rollout_fleet.multi_turn.environment import load_env
from rollout_fleet.sample_runner import SampleRunner
from rollout_fleet.trajectory import SampleProgress


@dataclass
class Conversation:
    """A finished multi-turn sample: the response, its generated turns, its environment time."""

    sample: SampleProgress
    turns: int
    env_s: float


class MultiTurnDriver:
    """Runs multi-turn samples on a ``SampleRunner`` (see the module docstring)."""

    def __init__(
        self,
        config: MultiTurnConfig,
        runner: SampleRunner,
        tokenizer: ChatTokenizer,
        env: EnvRunner | None = None,
    ) -> None:
        if not config.enabled:
            raise ValueError("MultiTurnDriver needs rollout.multi_turn.env set")
        self.config = config
        self.runner = runner
        self.chat = ChatTurns(tokenizer)
        self.env = env or EnvRunner(
            config.env,
            load_env(config.env),
            timeout_s=config.env_timeout_s,
            max_workers=config.env_workers,
        )
        self.samples = 0
        self.turns = 0
        self.env_tokens = 0

    async def generate(
        self, group_id: str, uid: str, prompt: PromptItem, sampling: dict[str, Any]
    ) -> Conversation:
        """Run the conversation of one sample; raises ``SampleFailed`` (engines, environment,
        chat template) as ``SampleRunner.generate`` does."""
        if not prompt.raw_prompt or isinstance(prompt.raw_prompt, str):
            raise ValueError(f"sample {uid}: multi-turn needs the prompt's chat messages")
        messages: list[dict[str, Any]] = [dict(m) for m in prompt.raw_prompt]
        response = SampleProgress([int(t) for t in prompt.prompt_ids], sampling["max_new_tokens"])
        turns, env_s = 0, 0.0
        while True:
            turns += 1
            turn = SampleProgress(response.resume_input_ids(), response.remaining_tokens)
            await self.runner.generate(group_id, f"{uid}/t{turns}", turn, sampling)
            response.add_turn(turn)
            if turn.final_finish_reason == "length":
                response.finish("length")
                break
            messages.append(
                {"role": "assistant", "content": self.chat.assistant_content(turn.output_ids)}
            )
            observation, step_s = await self.env.step(uid, messages, prompt.extra_info)
            env_s += step_s
            if observation is None:
                response.finish("stop")
                break
            if turns >= self.config.max_turns:
                response.finish("length")
                break
            response.add_env_tokens(
                self.chat.observation_ids(messages, observation, turn.output_ids, uid)
            )
            messages.append(observation)
            if response.remaining_tokens <= 0:
                response.finish("length")
                break
        self.samples += 1
        self.turns += turns
        self.env_tokens += response.num_env_tokens
        return Conversation(response, turns, env_s)

    def stats(self) -> dict[str, float]:
        samples = max(1, self.samples)
        return {
            "rollout/multi_turn/turns_per_sample": self.turns / samples,
            "rollout/multi_turn/env_tokens_per_sample": self.env_tokens / samples,
            "rollout/multi_turn/env_steps": float(self.env.num_steps),
            "rollout/multi_turn/env_s": self.env.env_s,
            "rollout/multi_turn/env_errors": float(self.env.num_errors),
            "rollout/multi_turn/env_timeouts": float(self.env.num_timeouts),
            "rollout/multi_turn/env_hung": float(self.env.num_hung),
        }
