"""Sessions: one per agent episode, its API key, and the tree of token sequences it made.

``SessionTable.open(uid, group_id, sampling)`` makes an ``Episode`` and its key
(``secrets.token_urlsafe``, 32 bytes); the table keeps only the key's SHA-256, so
neither a log line nor a memory dump of the table holds a usable key, and a lookup
costs the same for every wrong key. A call is served only for a live episode:
``close`` ends it (its key answers 401 from then on), ``fail_all`` ends every live
one with a reason (the gateway restarted under them).

An episode holds ``Branch``es, each one token sequence as the engines saw it: a
``SampleProgress`` (prompt ids, then generated turns, loss mask 1, and the
template's tokens between them, loss mask 0), with the conversation it renders
(``keys`` to compare with the next call's history, ``template_messages`` to render
the next delta). A call that extends a branch makes a child branch and the parent
stops being a leaf; a call that does not extend any (the agent rewrote or cut its
history, or asked for ``n`` choices and went on with one) starts a branch of its own.
``leaves()`` are the episode's trajectories: each trains with the episode's reward.
"""

from __future__ import annotations

import hashlib
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from rollout_fleet.gateway.errors import unauthorized
from rollout_fleet.trajectory import SampleProgress

KEY_PREFIX = "fleetrl-ep-"
ENDED_KEYS_KEPT = 65536  # ended keys remembered (by digest) to answer "episode ended"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def fork(progress: SampleProgress) -> SampleProgress:
    """An independent copy of ``progress`` (a child branch grows it; the parent stays)."""
    return SampleProgress(
        prompt_ids=list(progress.prompt_ids),
        max_new_tokens=progress.max_new_tokens,
        output_ids=list(progress.output_ids),
        logprobs=list(progress.logprobs),
        token_versions=list(progress.token_versions),
        finish_reason=progress.finish_reason,
        pieces=progress.pieces,
        aborted_pieces=progress.aborted_pieces,
        engines=list(progress.engines),
        loss_mask=None if progress.loss_mask is None else list(progress.loss_mask),
    )


@dataclass
class Branch:
    """One token sequence of an episode and the conversation it renders."""

    progress: SampleProgress
    last_turn_ids: list[int]
    keys: list[tuple] = field(default_factory=list)  # chat branches: message keys, reply last
    template_messages: list[dict[str, Any]] = field(default_factory=list)
    tools_key: str = ""
    chat: bool = True  # False: made by /v1/completions, continued by token prefix
    extended: bool = False

    @property
    def ids(self) -> list[int]:
        return self.progress.resume_input_ids()


@dataclass
class Episode:
    """One run of the agent: its calls, branches, and how it ended."""

    uid: str
    group_id: str
    sampling: dict[str, Any]
    branches: list[Branch] = field(default_factory=list)
    calls: int = 0
    live: bool = True
    failure: str = ""  # why the episode failed ("" = it did not)
    last_reply: str = ""  # content of the latest assistant reply (the reward's input)
    malformed_tool_calls: int = 0
    sampling_overridden: int = 0  # calls whose temperature/top_p the run's replaced

    def next_call_uid(self) -> str:
        self.calls += 1
        return f"{self.uid}/c{self.calls}"

    def fail(self, reason: str) -> None:
        if not self.failure:
            self.failure = reason
        self.live = False

    def chat_parent(self, keys: list[tuple], tools_key: str) -> Branch | None:
        """The longest chat branch whose conversation ``keys`` starts with (same tools)."""
        matches = [
            b
            for b in self.branches
            if b.chat and b.tools_key == tools_key and keys[: len(b.keys)] == b.keys
        ]
        return max(matches, key=lambda b: len(b.keys), default=None)

    def ids_parent(self, ids: list[int]) -> Branch | None:
        """The longest branch whose whole token sequence ``ids`` starts with."""
        matches = [b for b in self.branches if ids[: len(b.ids)] == b.ids]
        return max(matches, key=lambda b: len(b.ids), default=None)

    def add(self, branch: Branch, parent: Branch | None) -> None:
        if parent is not None:
            parent.extended = True
        self.branches.append(branch)

    def leaves(self) -> list[Branch]:
        return [b for b in self.branches if not b.extended]


class SessionTable:
    """Live episodes by key digest (see the module docstring)."""

    def __init__(self) -> None:
        self._by_digest: dict[bytes, Episode] = {}
        self._ended: OrderedDict[bytes, str] = OrderedDict()  # digest -> episode uid

    def open(self, uid: str, group_id: str, sampling: dict[str, Any]) -> tuple[Episode, str]:
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        episode = Episode(uid, group_id, dict(sampling))
        self._by_digest[_digest(key)] = episode
        return episode, key

    def episode(self, key: str | None) -> Episode:
        """The live episode of ``key``; an OpenAI 401 otherwise."""
        if not key:
            raise unauthorized("no API key: send Authorization: Bearer <the episode's key>")
        digest = _digest(key)
        episode = self._by_digest.get(digest)
        if episode is None or not episode.live:
            ended = episode.uid if episode is not None else self._ended.get(digest)
            if ended is None:
                raise unauthorized("unknown API key: each episode is served only with its own key")
            raise unauthorized(
                f"episode {ended} has ended; its key is no longer served", code="episode_ended"
            )
        return episode

    def close(self, episode: Episode) -> None:
        """End ``episode``: its key is answered 401 ``episode_ended`` from now on."""
        episode.live = False
        for digest in [d for d, e in self._by_digest.items() if e is episode]:
            del self._by_digest[digest]
            self._ended[digest] = episode.uid
        while len(self._ended) > ENDED_KEYS_KEPT:
            self._ended.popitem(last=False)

    def fail_all(self, reason: str) -> int:
        """End every live episode as failed (``reason``); how many there were."""
        live = [e for e in self._by_digest.values() if e.live]
        for episode in live:
            episode.fail(reason)
            self.close(episode)
        return len(live)

    def __len__(self) -> int:
        return len(self._by_digest)
