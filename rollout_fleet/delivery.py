"""Rollout-side delivery ledger: every group from its first prompt to durable acceptance.

ZeroMQ PUSH has no acknowledgement: trajectories in a socket buffer or in the
buffer's receive queue when the buffer dies are gone. The buffer defines the
acknowledgement instead (bank.py: a sample is accepted once it is flushed to
its rollout bank, and ``QueryGroups`` reports per group how many samples it
accepted). ``DeliveryLedger`` is the one record of "sent, not yet acknowledged"
on the rollout side. It sits between the prompt reader, the rollout worker and
the trajectory sender and keeps, per group (``group_id_for``: ``p<prompt index>``):

- the prompt, from the moment the worker takes it (``prompts()``);
- the encoded trajectories sent for it (``send``, called on the worker's
  sender thread);

until ``reconcile()`` sees the buffer report the whole group accepted. Its readers:

- the worker's admission: a group sent whole but not yet counted by the buffer is
  in neither the buffer's ``accepted`` nor the worker's own running groups, so
  ``sent_unconfirmed()`` counts it as running (else admission would run ahead of
  the staleness bound by the groups in ZeroMQ transit); the worker settles those
  with ``reconcile(sent_only=True)`` before each admission decision;
- ``resend_unconfirmed()`` (after a buffer restart) sends every held
  trajectory again; the buffer drops the uids it already holds (bank reload +
  uid dedupe), so re-sending is idempotent: nothing lost, nothing twice;
- ``state_dict()`` (taken with each learner checkpoint) lists the prompts
  started but not yet accepted, and ``load_state_dict`` puts them first in
  line on resume: groups that were in flight when the checkpoint was taken
  are generated again instead of being skipped by the reader's cursor. Their
  group ids are the same, so samples the buffer already holds are dropped as
  duplicates and partial groups are completed.

Thread safety: one lock guards the ledger; the sender is used from the worker's
sender thread (and after a buffer restart, when the worker waits), the control
client from the admission thread and the periodic reconcile (``BufferClient``
serialises its own calls; ZeroMQ sockets are not thread-safe).

Left out: bounding the memory of held trajectories (they are held from send
until the next reconcile, a few seconds in a healthy run).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from buffer.wire import Trajectory, encode
from fleetrl.data.reader import PromptItem, PromptReader
from fleetrl.log import get_logger

log = get_logger(__name__)

STATE_VERSION = 1
RECONCILE_CHUNK = 512  # group ids per QueryGroups request


class PayloadSender(Protocol):
    def send_payload(self, payload: bytes, timeout_s: float | None = None) -> None: ...


class GroupStatusSource(Protocol):
    def group_status(self, group_ids: list[str]) -> list[int]: ...


def group_id_for(prompt: PromptItem) -> str:
    """The id of the group of ``prompt`` (the rollout worker's, the buffer's, the ledger's)."""
    return group_id_for_index(prompt.index)


def group_id_for_index(index: int) -> str:
    """The group id of the prompt at global reader position ``index``: the one place it is
    written (checkpoints list unfinished prompts by position; the buffer retains by id)."""
    return f"p{index}"


@dataclass
class _Held:
    prompt_index: int
    payloads: dict[str, bytes] = field(default_factory=dict)  # uid -> encoded trajectory
    group_size: int = 0

    @property
    def sent_whole(self) -> bool:
        return bool(self.group_size) and len(self.payloads) >= self.group_size


class DeliveryLedger:
    """See the module docstring. ``prompts()`` feeds the worker; ``send`` is its sink."""

    def __init__(
        self,
        reader: PromptReader,
        sender: PayloadSender,
        control: GroupStatusSource,
        group_size: int,
    ) -> None:
        self.reader = reader
        self.sender = sender
        self.control = control
        self.group_size = group_size
        self._held: dict[str, _Held] = {}
        self._requeued: list[int] = []
        self._lock = threading.Lock()
        self.confirmed_groups = 0
        self.resent_samples = 0
        self.requeued_prompts = 0

    # ---- prompts ----------------------------------------------------------------------
    def prompts(self) -> Iterator[PromptItem]:
        """Re-queued prompts first, then the reader; every prompt handed out is held."""
        while True:
            with self._lock:
                index = self._requeued.pop(0) if self._requeued else None
            item = self._prompt_at(index) if index is not None else next(self.reader, None)
            if item is None:
                return
            with self._lock:
                self._held.setdefault(group_id_for(item), _Held(item.index))
            yield item

    def _prompt_at(self, index: int) -> PromptItem:
        """The reader's item at global position ``index``, leaving its cursor where it was."""
        saved = self.reader.state_dict()
        self.reader.seek(index)
        item = next(self.reader)
        self.reader.load_state_dict(saved)
        return item

    # ---- trajectories -----------------------------------------------------------------
    def send(self, traj: Trajectory, timeout_s: float | None = None) -> None:
        payload = encode(traj)
        with self._lock:
            held = self._held.get(traj.group_id)
            if held is None:  # a group this tracker did not start (validation never sends)
                held = self._held[traj.group_id] = _Held(traj.prompt_index)
            held.payloads[traj.uid] = payload
            held.group_size = traj.group_size
        self.sender.send_payload(payload, timeout_s)

    def forget(self, group_id: str) -> None:
        """The worker dropped this group for good (a sample ran out of attempts, counted
        there): nothing of it will be sent, so it is neither awaited nor regenerated."""
        with self._lock:
            self._held.pop(group_id, None)

    # ---- acknowledgement --------------------------------------------------------------
    def sent_unconfirmed(self) -> int:
        """Groups sent whole that the buffer has not yet been seen to hold."""
        with self._lock:
            return sum(held.sent_whole for held in self._held.values())

    def reconcile(self, *, sent_only: bool = False) -> int:
        """Forget groups the buffer holds whole (``sent_only``: ask about groups sent whole
        only, the cheap check before each admission); returns how many are still held."""
        with self._lock:
            ids = [g for g, held in self._held.items() if held.sent_whole or not sent_only]
        for start in range(0, len(ids), RECONCILE_CHUNK):
            chunk = ids[start : start + RECONCILE_CHUNK]
            counts = self.control.group_status(chunk)
            with self._lock:
                for gid, accepted in zip(chunk, counts, strict=True):
                    held = self._held.get(gid)
                    if held is not None and accepted >= (held.group_size or self.group_size):
                        del self._held[gid]
                        self.confirmed_groups += 1
        with self._lock:
            return len(self._held)

    def resend_unconfirmed(self) -> int:
        """After a buffer restart: send again every trajectory not yet accepted; returns count."""
        self.reconcile()
        with self._lock:
            payloads = [p for held in self._held.values() for p in held.payloads.values()]
        for payload in payloads:
            self.sender.send_payload(payload)
        self.resent_samples += len(payloads)
        if payloads:
            log.warning("re-sent %d trajectories the buffer had not accepted", len(payloads))
        return len(payloads)

    # ---- checkpoints ------------------------------------------------------------------
    def unfinished_prompts(self) -> list[int]:
        with self._lock:
            return sorted({h.prompt_index for h in self._held.values()} | set(self._requeued))

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "prompt_reader": self.reader.state_dict(),
            "unfinished_prompts": self.unfinished_prompts(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the cursor and re-queue the prompts that were unfinished at the checkpoint."""
        if "prompt_reader" not in state:  # a checkpoint from before this ledger: cursor only
            self.reader.load_state_dict(state)
            return
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"delivery state version {state.get('version')!r} != {STATE_VERSION}")
        self.reader.load_state_dict(state["prompt_reader"])
        unfinished = [int(i) for i in state.get("unfinished_prompts", [])]
        with self._lock:
            self._requeued = unfinished + [i for i in self._requeued if i not in unfinished]
        self.requeued_prompts += len(unfinished)
        if unfinished:
            log.info(
                "%d prompts were in flight at the checkpoint: generating them again first",
                len(unfinished),
            )

    def metrics(self) -> dict[str, float]:
        with self._lock:
            held = len(self._held)
        return {
            "delivery/unconfirmed_groups": float(held),
            "delivery/confirmed_groups": float(self.confirmed_groups),
            "delivery/resent_samples": float(self.resent_samples),
            "delivery/requeued_prompts": float(self.requeued_prompts),
        }
