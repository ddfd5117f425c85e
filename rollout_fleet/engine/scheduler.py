"""The scheduler thread: continuous batching, pause modes, aborts and weight loads.

One dedicated thread owns the model runner. Its loop::

    while running:
        run queued commands (submit, abort, pause, continue, flush, load weights)
        if paused or idle: wait
        on an idle engine, let a burst of submissions finish arriving (a few ms at most)
        admit waiting sequences up to max_running_requests -> prefill, sample 1st token
        drop finished rows and splice new ones into the batch cache (one rebuild)
        decode one token for every running row, sample, check stop conditions

Everything that changes engine state runs as a command *between* steps, so a
pause or a weight load never lands in the middle of a forward pass, and tokens
decoded after a load carry the new version (``Sequence.versions``).

Pause modes (SGLang ``/pause_generation``): ``abort`` finishes every running
and waiting sequence now with ``finish_reason abort`` and its partial output;
``retract`` moves running sequences back to the head of the queue and frees
their KV, re-prefilling prompt + generated-so-far after ``continue``;
``in_place`` stops between steps keeping the KV (a weight update then continues
the same sequences on new weights, as PipelineRL does). All three pause until
``continue``; requests arriving meanwhile wait in the queue. While memory is
released (``memory_saver``, co-located engines) nothing runs either.

Completion and streaming are reported through ``Sequence.on_event(seq, done)``,
called from this thread. Events are collected while one batch of tokens is
recorded (or one command runs) and delivered together after it, then every
``add_delivery_hook`` callback runs once: the HTTP layer queues events without waking its loop and wakes it once per
burst, so its thread does not contend for the GIL with the rest of the step.

Prefill sharing: sequences with the same known tokens (the n samples of a GRPO
group, which rollout workers send as n requests) are prefilled once, in one step
or across steps through ``kv_cache.PrefillCache``; ``stats["prefill_tokens"]``
counts the tokens actually run through prefill forwards.

LoRA: the engine serves one adapter at a time, merged into the weights
(``ModelRunner.apply_adapter``). ``switch_adapter`` merges a new one and
finishes with ``abort`` every sequence that named another (they are resubmitted
under the new name, as after an abort pause), so every token of a sequence comes
from the adapter it named; ``submit(..., adapter=)`` does the same for a request
that raced a switch. ``ANY_ADAPTER`` marks a probe (``/health_generate``) that
any weights may serve.

Left out: priority scheduling, chunked prefill, preemption under memory pressure,
several adapters in one batch.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from fleetrl.log import get_logger
from rollout_fleet.engine.kv_cache import PrefillCache, PrefillEntry
from rollout_fleet.engine.runner import ModelRunner
from rollout_fleet.engine.sampling import BatchSampling, RowSampling, Sampled, sample_tokens
from rollout_fleet.protocol import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    INITIAL_WEIGHT_VERSION,
    finish_reason_json,
    policy_version_of,
)

log = get_logger(__name__)

# The scheduler thread wakes at least this often while idle (to notice stop()).
IDLE_WAIT_S = 0.5
# An idle engine waits this long after a submission for the next one of a burst ...
ADMISSION_WINDOW_S = 0.001
# ... and at most this many windows in all.
BURST_WINDOWS = 5
# Prefilled prompts kept for the rest of their group (least recently used out first).
DEFAULT_PREFILL_CACHE_BYTES = 64 << 20
# Sequence.adapter of a probe that any weights may serve (not a valid adapter name).
ANY_ADAPTER = "*"


@dataclass
class Sequence:
    """One sample being generated (one element of a /generate response)."""

    rid: str
    parent_rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: RowSampling
    stop_token_ids: frozenset[int]
    stop_strings: list[str]
    on_event: Callable[[Sequence, bool], None]
    stream: bool = False
    submitted_at: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    # per output token, when ``sampling.top_logprobs``: (logprobs, token ids), highest first
    top_logprobs: list[tuple[list[float], list[int]]] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    cached_tokens: int = 0
    retractions: int = 0
    adapter: str | None = None  # the LoRA adapter the request named (None: base weights)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def known_tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class Scheduler:
    """Owns the runner in one thread; every public method is thread-safe."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_running_requests: int = 64,
        weight_version: str = INITIAL_WEIGHT_VERSION,
        name: str = "engine",
        share_prefill: bool = True,
        prefill_cache_bytes: int = DEFAULT_PREFILL_CACHE_BYTES,
        admission_window_s: float = ADMISSION_WINDOW_S,
    ) -> None:
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
        self.runner = runner
        self.max_running_requests = max_running_requests
        self.weight_version = weight_version
        self._version_int = policy_version_of(weight_version)
        self.name = name
        self.share_prefill = share_prefill
        self.admission_window_s = admission_window_s
        self.prefill_cache = PrefillCache(prefill_cache_bytes if share_prefill else 0)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.paused_mode: str | None = None
        # memory released (/release_memory_occupation): nothing runs until all is resumed
        self.memory_released = False
        self.adapter: str | None = None  # the LoRA adapter merged into the weights
        self._commands: deque[tuple[Callable[[], Any], Future]] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._next_tokens = torch.zeros(0, dtype=torch.long, device=runner.device)
        self._batch_sampling: BatchSampling | None = None
        self._outbox: list[tuple[Sequence, bool]] = []
        self._delivery_hooks: list[Callable[[], None]] = []
        self.stats = {
            "decode_steps": 0,
            "prefills": 0,  # prefill forwards
            "prefill_tokens": 0,  # tokens run through them
            "prefill_cache_hits": 0,  # sequences whose tokens were prefilled in an earlier step
            "generated_tokens": 0,
            "step_errors": 0,
            "event_errors": 0,
        }
        self.last_step_at = time.monotonic()

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._loop, name=f"{self.name}-scheduler", daemon=True
        )
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def add_delivery_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` on the scheduler thread after each burst of ``on_event`` calls."""
        self._delivery_hooks.append(hook)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- thread-safe API (each returns a Future completed by the scheduler thread) ----------

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the scheduler thread between steps."""
        future: Future = Future()
        with self._cond:
            self._commands.append((fn, future))
            self._cond.notify_all()
        return future

    def submit(self, seqs: list[Sequence]) -> Future:
        return self.call(lambda: self._submit(seqs))

    def switch_adapter(self, name: str, weights: Any) -> Future:
        """Serve LoRA adapter ``name`` (``weights``: ``weight_sync.adapters.LoraWeights``)."""
        return self.call(lambda: self._switch_adapter(name, weights))

    def remove_adapter(self, name: str) -> Future:
        return self.call(lambda: self._remove_adapter(name))

    def abort(self, rid: str = "", abort_all: bool = False, message: str = "aborted") -> Future:
        return self.call(lambda: self._abort(rid, abort_all, message))

    def pause(self, mode: str) -> Future:
        return self.call(lambda: self._pause(mode))

    def resume(self) -> Future:
        return self.call(self._resume)

    def flush_cache(self) -> Future:
        return self.call(self._flush)

    def load_weights(self, named_tensors: list, weight_version: str | None) -> Future:
        return self.call(lambda: self._load(named_tensors, weight_version))

    def set_weight_version(self, weight_version: str) -> Future:
        return self.call(lambda: self._set_version(weight_version))

    def load(self) -> dict[str, Any]:
        """A racy but harmless snapshot of queue sizes for /get_server_info."""
        return {
            "num_running_reqs": sum(not s.finished for s in self.running),
            "num_waiting_reqs": len(self.waiting),
            "paused": self.paused_mode,
            "kv_cache_bytes": self.runner.kv.nbytes(),
            "prefill_cache_bytes": self.prefill_cache.nbytes(),
            **self.stats,
        }

    # -- commands (scheduler thread) --------------------------------------------------------

    def _submit(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.adapter not in (self.adapter, ANY_ADAPTER):  # raced an adapter switch
                seq.finish_reason = finish_reason_json(
                    FINISH_ABORT, message=f"adapter {seq.adapter} was replaced by {self.adapter}"
                )
                self._emit(seq, True)
            else:
                self.waiting.append(seq)

    def _switch_adapter(self, name: str, weights: Any) -> int:
        changed = self.runner.apply_adapter(weights)
        self._abort_adapter_users(lambda a: a != name, f"adapter replaced by {name}")
        self.adapter = name
        self.prefill_cache.clear()  # its KV was computed with the old weights
        return changed

    def _remove_adapter(self, name: str) -> None:
        if self.adapter != name:
            return
        self.runner.remove_adapter()
        self._abort_adapter_users(lambda a: a == name, f"adapter {name} unloaded")
        self.adapter = None
        self.prefill_cache.clear()

    def _abort_adapter_users(self, matches: Callable[[str | None], bool], message: str) -> None:
        for seq in [*self.running, *self.waiting]:
            if not seq.finished and seq.adapter != ANY_ADAPTER and matches(seq.adapter):
                seq.finish_reason = finish_reason_json(FINISH_ABORT, message=message)
                self._emit(seq, True)
        self.waiting = deque(s for s in self.waiting if not s.finished)
        self._splice([])

    def _abort(self, rid: str, abort_all: bool, message: str) -> int:
        count = 0
        for seq in [*self.running, *self.waiting]:
            if seq.finished or not (abort_all or rid in (seq.rid, seq.parent_rid)):
                continue
            seq.finish_reason = finish_reason_json(FINISH_ABORT, message=message)
            count += 1
            self._emit(seq, True)
        self.waiting = deque(s for s in self.waiting if not s.finished)
        self._splice([])
        return count

    def _pause(self, mode: str) -> int:
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode {mode!r}; accepted: abort, retract, in_place")
        self.paused_mode = mode
        if mode == "abort":
            return self._abort("", True, "aborted by pause_generation(mode=abort)")
        if mode == "retract":
            live = [s for s in self.running if not s.finished]
            for seq in live:
                seq.retractions += 1
            self.waiting.extendleft(reversed(live))
            self.running = []
            self.runner.kv.clear()
            self._set_rows()
            return len(live)
        return len(self.running)

    def _resume(self) -> None:
        self.paused_mode = None

    def _flush(self) -> bool:
        self.prefill_cache.clear()
        self._splice([])
        if self.running or (self.waiting and self.paused_mode is None):
            return False
        self.runner.kv.clear()
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        return True

    def flush_now(self) -> bool:
        """``flush_cache``'s work, for a caller already on the scheduler thread."""
        return self._flush()

    def _load(self, named_tensors: list, weight_version: str | None) -> int:
        self.prefill_cache.clear()  # its KV was computed with the old weights
        count = self.runner.load_weights(named_tensors)
        if weight_version is not None:
            self._set_version(weight_version)
        return count

    def _set_version(self, weight_version: str) -> None:
        self.prefill_cache.clear()
        self.weight_version = weight_version
        self._version_int = policy_version_of(weight_version)

    # -- the loop ----------------------------------------------------------------------------

    def _run_commands(self) -> None:
        while True:
            with self._cond:
                if not self._commands:
                    return
                fn, future = self._commands.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except Exception as err:  # handed to the caller through the future
                self._deliver()
                future.set_exception(err)
            else:
                # Events first: when the caller sees the result, callbacks have run.
                self._deliver()
                future.set_result(result)

    def _emit(self, seq: Sequence, done: bool) -> None:
        self._outbox.append((seq, done))

    def _deliver(self) -> None:
        """Run the collected ``on_event`` callbacks in order, then the delivery hooks."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, []
        for seq, done in outbox:
            try:
                seq.on_event(seq, done)
            except Exception:  # a consumer's bug must not stop the engine: count and log
                self.stats["event_errors"] += 1
                log.exception("%s: on_event failed for %s", self.name, seq.rid)
        for hook in self._delivery_hooks:
            try:
                hook()
            except Exception:  # as above
                self.stats["event_errors"] += 1
                log.exception("%s: delivery hook %r failed", self.name, hook)

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not self._stop and not self._commands and not self._has_work():
                    self._cond.wait(IDLE_WAIT_S)
                if self._stop:
                    break
            self._run_commands()
            if not self._has_work():
                continue
            if not self.running and self.admission_window_s > 0:
                self._gather_burst()
                if not self._has_work():
                    continue
            try:
                self._step()
            except Exception as err:  # service boundary: fail the batch, keep serving
                self.stats["step_errors"] += 1
                log.exception(
                    "%s: step failed; aborting %d running sequences", self.name, len(self.running)
                )
                for seq in self.running:
                    if not seq.finished:
                        seq.finish_reason = finish_reason_json(
                            FINISH_ABORT, message=f"engine error: {err}"
                        )
                        self._emit(seq, True)
                self.running = []
                self.runner.kv.clear()
                self.prefill_cache.clear()
                self._set_rows()
            self._deliver()
        for seq in [*self.running, *self.waiting]:
            if not seq.finished:
                seq.finish_reason = finish_reason_json(FINISH_ABORT, message="engine stopped")
                self._emit(seq, True)
        self._deliver()

    def _gather_burst(self) -> None:
        """On an idle engine, let a burst of requests (a batch of groups, one request per
        sample) finish arriving before the first prefill: one prefill and one KV rebuild
        for the burst, not one per trickle. Waits while submissions keep coming, at most
        ``admission_window_s`` between two and ``BURST_WINDOWS`` windows in all."""
        deadline = time.monotonic() + BURST_WINDOWS * self.admission_window_s
        while len(self.waiting) < self.max_running_requests:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            with self._cond:
                if not self._commands and not self._stop:
                    self._cond.wait(min(self.admission_window_s, remaining))
                if self._stop or not self._commands:
                    return
            self._run_commands()

    def _has_work(self) -> bool:
        if self.paused_mode is not None or self.memory_released:
            return False
        return bool(self.running or self.waiting)

    def _step(self) -> None:
        admitted = self._admit()
        self._splice(self._prefill(admitted) if admitted else [])
        if self.running:
            self._decode()

    def _splice(self, new_kv: list[tuple[list[Sequence], list, list]]) -> None:
        """Drop finished rows and append newly prefilled ones (one cache rebuild, if any)."""
        keep = [i for i, s in enumerate(self.running) if not s.finished]
        if not new_kv and len(keep) == len(self.running):
            return
        new_rows = [s for seqs, _, _ in new_kv for s in seqs]
        if not keep and not new_rows:
            self.runner.kv.clear()
        else:
            self.runner.kv.rebuild(keep, [(k, v) for _, k, v in new_kv])
        self.running = [self.running[i] for i in keep] + new_rows
        self._set_rows()

    def _set_rows(self) -> None:
        self._next_tokens = torch.tensor(
            [s.output_ids[-1] for s in self.running], dtype=torch.long, device=self.runner.device
        )
        self._batch_sampling = (
            BatchSampling([s.sampling for s in self.running], self.runner.device)
            if self.running
            else None
        )

    def _admit(self) -> list[Sequence]:
        free = self.max_running_requests - len([s for s in self.running if not s.finished])
        admitted = []
        while self.waiting and free > 0:
            admitted.append(self.waiting.popleft())
            free -= 1
        return admitted

    def _prefill(self, seqs: list[Sequence]) -> list[tuple[list[Sequence], list, list]]:
        """Prefill admitted sequences; returns (sequences, keys, values) for those still live.

        With prefill sharing on, sequences with the same known tokens (a GRPO group's n
        samples, whether sent as one request or n) run them through the model once: in
        this step, or earlier while the entry is in ``prefill_cache``. Every sample then
        samples its first token from the shared logits with its own sampler, and gets its
        own copy of the KV rows, so decoding stays independent.
        """
        unique: dict[tuple[int, ...], list[Sequence]] = {}
        if self.share_prefill:
            for seq in seqs:
                unique.setdefault(tuple(seq.known_tokens()), []).append(seq)
        else:  # one row per sequence, as if every request stood alone
            unique = {(i, *seq.known_tokens()): [seq] for i, seq in enumerate(seqs)}
        entries: list[tuple[list[Sequence], Any]] = []
        missing: dict[int, list[tuple[tuple[int, ...], list[Sequence]]]] = {}
        for tokens, group in unique.items():
            hit = self.prefill_cache.get(tokens) if self.share_prefill else None
            if hit is not None:
                entries.append((group, hit))
                self.stats["prefill_cache_hits"] += len(group)
                for seq in group:
                    seq.cached_tokens = len(seq.prompt_ids)
            else:
                key_len = len(group[0].known_tokens())
                missing.setdefault(key_len, []).append((tokens, group))
        # Equal lengths share one forward (no padding).
        for length, batch in missing.items():
            prompts = torch.tensor(
                [group[0].known_tokens() for _, group in batch], dtype=torch.long
            )
            logits, keys, values = self.runner.prefill(prompts)
            self.stats["prefills"] += 1
            self.stats["prefill_tokens"] += length * len(batch)
            for row, (tokens, group) in enumerate(batch):
                entry = PrefillEntry(
                    logits[row : row + 1],
                    [k[row : row + 1] for k in keys],
                    [v[row : row + 1] for v in values],
                )
                if self.share_prefill:  # (unshared keys are not token tuples: never cached)
                    entry = self.prefill_cache.put(tokens, entry.logits, entry.keys, entry.values)
                entries.append((group, entry))
                for j, seq in enumerate(group):
                    seq.cached_tokens = len(seq.prompt_ids) if j > 0 else 0
        flat = [s for group, _ in entries for s in group]
        counts = torch.tensor([len(g) for g, _ in entries], device=self.runner.device)
        row_logits = torch.cat([e.logits for _, e in entries]).repeat_interleave(counts, dim=0)
        sampled = sample_tokens(
            row_logits, BatchSampling([s.sampling for s in flat], self.runner.device)
        )
        self._record(flat, sampled)
        result = []
        for group, entry in entries:
            live = [s for s in group if not s.finished]
            if live:
                # Views: ``rebuild`` copies the shared rows into each sample's own row.
                shape = (len(live), -1, -1, -1)
                result.append(
                    (
                        live,
                        [k.expand(*shape) for k in entry.keys],
                        [v.expand(*shape) for v in entry.values],
                    )
                )
        return result

    def _decode(self) -> None:
        assert self._batch_sampling is not None
        logits = self.runner.decode(self._next_tokens)
        sampled = sample_tokens(logits, self._batch_sampling)
        self._next_tokens = sampled.tokens
        self.stats["decode_steps"] += 1
        self.last_step_at = time.monotonic()
        self._record(self.running, sampled)

    def _record(self, seqs: list[Sequence], sampled: Sampled) -> None:
        """Append one sampled token to each sequence and finish those that should stop."""
        version = self._version_int
        max_context = self.runner.max_context
        tokens = sampled.tokens.tolist()
        if sampled.top_values is not None and sampled.top_ids is not None:
            top_values, top_ids = sampled.top_values.tolist(), sampled.top_ids.tolist()
            for row, seq in enumerate(seqs):
                if k := seq.sampling.top_logprobs:
                    seq.top_logprobs.append((top_values[row][:k], top_ids[row][:k]))
        for seq, token, logprob in zip(seqs, tokens, sampled.logprobs.tolist(), strict=True):
            seq.output_ids.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(version)
            n_out = len(seq.output_ids)
            if token in seq.stop_token_ids:
                seq.finish_reason = finish_reason_json(FINISH_STOP, matched=token)
            elif seq.stop_strings and (matched := self._matched_stop(seq)) is not None:
                seq.finish_reason = finish_reason_json(FINISH_STOP, matched=matched)
            elif n_out >= seq.max_new_tokens or len(seq.prompt_ids) + n_out >= max_context:
                seq.finish_reason = finish_reason_json(FINISH_LENGTH, length=seq.max_new_tokens)
            if seq.finished:
                self._emit(seq, True)
            elif seq.stream:
                self._emit(seq, False)
        self.stats["generated_tokens"] += len(tokens)
        # Now, not at the end of the step: a streamed chunk must show exactly this token.
        self._deliver()

    def _matched_stop(self, seq: Sequence) -> str | None:
        window = max(len(s) for s in seq.stop_strings) + 1
        tail = self.runner.tokenizer.decode(seq.output_ids[-window:], skip_special_tokens=False)
        for stop in seq.stop_strings:
            if stop in tail:
                return stop
        return None
