"""One sample's generation, possibly in several pieces, and the Trajectory built from it.

A sample is usually one engine request. When an engine pauses with mode
``abort`` (weight sync) or dies, the request ends early; the tokens it did
produce are kept and the sample is resubmitted as prompt + those tokens with a
smaller ``max_new_tokens`` (AReaL's interruptible rollouts). ``SampleProgress``
accumulates the pieces: response ids, behaviour logprobs and, per token, the
policy version that produced it, so a trajectory spanning a weight update
stays exact. ``build_trajectory`` turns a finished sample into the wire
``Trajectory``.

A multi-turn response (``rollout_fleet.multi_turn``) is one ``SampleProgress``
too: each generated turn is run as a sample of its own and appended with
``add_turn``; the environment's reply between turns is appended with
``add_env_tokens`` (``loss_mask`` 0, behaviour logprob 0.0, the policy version
of the token before it, so ``min(token_versions)`` is unchanged), and
``finish`` sets the response's finish reason.

Left out: retract-mode bookkeeping (the engine re-runs the prefill itself and
returns the whole sequence in one response, so nothing differs here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from buffer.wire import Array, Trajectory

FINISHED_REASONS = ("stop", "length")
ABORT = "abort"
REWARD_ERROR_CHARS = 500


class GenerationPiece(Protocol):
    """What one engine response contributes (``rollout_fleet.client.GenerateOutput``)."""

    output_ids: Sequence[int]
    logprobs: Sequence[float]
    token_versions: Sequence[int]
    finish_reason: str


class InconsistentPieceError(ValueError):
    """An engine response whose ids, logprobs and versions disagree in length."""


@dataclass
class SampleProgress:
    """The tokens generated so far for one sample, across resubmissions."""

    prompt_ids: list[int]
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    finish_reason: str = ""  # of the latest piece; "" before the first
    pieces: int = 0
    aborted_pieces: int = 0
    engines: list[str] = field(default_factory=list)  # engine of each piece, in order
    # one per response token once an environment's tokens were added (1 = generated); None before
    loss_mask: list[int] | None = None
    # per generated token when the engine was asked for them: [(logprob, token id), ...]
    # (a reply's top logprobs; not part of the trajectory)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("SampleProgress: empty prompt")
        if self.max_new_tokens < 1:
            raise ValueError(f"SampleProgress: max_new_tokens {self.max_new_tokens} < 1")

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)

    @property
    def num_env_tokens(self) -> int:
        """Response tokens an environment added (``loss_mask`` 0)."""
        return 0 if self.loss_mask is None else self.loss_mask.count(0)

    @property
    def remaining_tokens(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason in FINISHED_REASONS or self.remaining_tokens <= 0

    @property
    def final_finish_reason(self) -> str:
        """stop | length; an aborted sample whose budget ran out counts as length."""
        if self.finish_reason in FINISHED_REASONS:
            return self.finish_reason
        if self.remaining_tokens <= 0:
            return "length"
        return self.finish_reason or ABORT

    def resume_input_ids(self) -> list[int]:
        """What to submit next: the prompt followed by everything generated so far."""
        return self.prompt_ids + self.output_ids

    def add(self, piece: GenerationPiece, engine_id: str = "") -> int:
        """Append one engine response; returns the number of tokens taken from it.

        Tokens beyond the sample's budget (an engine that overshoots
        ``max_new_tokens``) are cut, and the sample then finishes as ``length``.
        """
        n = len(piece.output_ids)
        if len(piece.logprobs) != n or len(piece.token_versions) != n:
            raise InconsistentPieceError(
                f"engine {engine_id or '?'} returned {n} tokens, {len(piece.logprobs)} logprobs "
                f"and {len(piece.token_versions)} versions"
            )
        if self.finished:
            raise ValueError("SampleProgress.add: the sample is already finished")
        take = min(n, self.remaining_tokens)
        self.output_ids.extend(int(t) for t in piece.output_ids[:take])
        self.logprobs.extend(float(lp) for lp in piece.logprobs[:take])
        self.token_versions.extend(int(v) for v in piece.token_versions[:take])
        self.top_logprobs.extend(getattr(piece, "top_logprobs", ())[:take])
        reason = piece.finish_reason if take == n else "length"
        self.finish_reason = reason
        self.pieces += 1
        self.aborted_pieces += reason == ABORT
        self.engines.append(engine_id)
        if self.loss_mask is not None:
            self.loss_mask.extend([1] * take)
        return take

    def add_turn(self, turn: SampleProgress) -> None:
        """Append a finished generated turn of a multi-turn response (the policy's tokens).

        The response's own ``finish_reason`` is left as it is: the caller decides
        with ``finish`` whether the conversation goes on.
        """
        if not turn.finished:
            raise ValueError("SampleProgress.add_turn: the turn is unfinished")
        if len(turn.output_ids) > self.remaining_tokens:
            raise ValueError(
                f"SampleProgress.add_turn: a turn of {len(turn.output_ids)} tokens exceeds the "
                f"{self.remaining_tokens} left in the response"
            )
        self.output_ids.extend(turn.output_ids)
        self.logprobs.extend(turn.logprobs)
        self.token_versions.extend(turn.token_versions)
        self.pieces += turn.pieces
        self.aborted_pieces += turn.aborted_pieces
        self.engines.extend(turn.engines)
        if self.loss_mask is not None:
            self.loss_mask.extend([1] * len(turn.output_ids))

    def add_env_tokens(self, token_ids: Sequence[int]) -> int:
        """Append an environment's tokens (cut to the budget); returns how many were taken.

        They are context, not the policy's: ``loss_mask`` 0, logprob 0.0, and the
        version of the generated token before them.
        """
        if not self.output_ids:
            raise ValueError(
                "SampleProgress.add_env_tokens: a response starts with a generated turn"
            )
        take = min(len(token_ids), self.remaining_tokens)
        if self.loss_mask is None:
            self.loss_mask = [1] * len(self.output_ids)
        self.output_ids.extend(int(t) for t in token_ids[:take])
        self.logprobs.extend([0.0] * take)
        self.token_versions.extend([self.token_versions[-1]] * take)
        self.loss_mask.extend([0] * take)
        return take

    def finish(self, reason: str) -> None:
        """End a multi-turn response as ``stop`` or ``length``."""
        if reason not in FINISHED_REASONS:
            raise ValueError(f"finish reason {reason!r}; accepted: {', '.join(FINISHED_REASONS)}")
        self.finish_reason = reason


def build_trajectory(
    sample: SampleProgress,
    *,
    group_id: str,
    sample_index: int,
    group_size: int,
    score: float,
    data_source: str = "",
    prompt_index: int = -1,
    reward_metrics: dict[str, float] | None = None,
    timings: dict[str, float] | None = None,
    temperature: float = 1.0,
    reward_error: str = "",
    episode: str = "",
) -> Trajectory:
    """The wire message for one finished sample (raises ValueError if it is unfinished).

    ``reward_error`` (non-empty: the sample's reward failed) is cut to its first
    ``REWARD_ERROR_CHARS`` characters: it is a diagnosis, not a payload. ``episode``
    names the agent episode a branch came from."""
    if not sample.finished:
        raise ValueError(
            f"sample {group_id}/{sample_index} is unfinished ({sample.finish_reason or 'no pieces'})"
        )
    traj = Trajectory(
        uid=f"{group_id}/{sample_index}",
        group_id=group_id,
        group_size=group_size,
        prompt_ids=Array.of(sample.prompt_ids, "int32"),
        response_ids=Array.of(sample.output_ids, "int32"),
        behavior_logprobs=Array.of(sample.logprobs, "float32"),
        token_versions=Array.of(sample.token_versions, "int32"),
        score=float(score),
        finish_reason=sample.final_finish_reason,
        data_source=data_source,
        engine_id=_engine_label(sample.engines),
        prompt_index=prompt_index,
        reward_metrics=dict(reward_metrics or {}),
        timings=dict(timings or {}),
        temperature=float(temperature),
        loss_mask=Array.of(sample.loss_mask, "uint8") if sample.num_env_tokens else None,
        reward_error=reward_error[:REWARD_ERROR_CHARS],
        episode=episode,
    )
    traj.validate()
    return traj


def _engine_label(engines: list[str]) -> str:
    """One engine name, or ``a+b`` when pieces came from several (failover)."""
    return "+".join(dict.fromkeys(e for e in engines if e))
