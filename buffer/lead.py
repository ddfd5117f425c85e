"""How far ahead of the learner the fleet generates: the fewest versions that keep it fed.

The admission rule (``buffer.admission``) lets generation run up to η versions
ahead of the learner, and a fleet that generates faster than the learner trains
always runs that far: every sample is then trained at staleness exactly η
(the CPU demo at η = 2: ``staleness/mean`` 2.0 at every step), although one
version of lead already keeps the learner from waiting. Staleness costs samples
(the demo needed 2,560 samples to held-out 0.9 at η = 2, 2,304 at η = 1 and
1,792 at η = 0, the same as TRL's on-policy trainer, seed 0), so generating
earlier than needed costs samples and buys nothing.

``AdmissionLead`` keeps a lead ℓ, 1 ≤ ℓ ≤ η, that the admission window uses in
place of η (``StalenessAdmission.window_end``):

- the learner asked for a batch and waited for it longer than ``WAIT_SHARE`` of
  a step (the time between hand-outs): the fleet is behind, ℓ + 1;
- a whole version's groups were already complete beyond the batch handed out,
  ``LOWER_AFTER`` hand-outs in a row: the fleet is a version further ahead than
  it needs, ℓ − 1.

The first ``WARMUP`` hand-outs only measure (the fleet starts from nothing), and
the hand-out after a raise does not raise again (the fleet is catching up). η is
the bound either way: ℓ never exceeds it, and the buffer's hand-out check is
unchanged. ``buffer.admission_lead: bound``, the default, keeps ℓ = η (every
group starts as early as the bound allows, so existing runs' results stay as
they were); ``adaptive`` is opt-in. The lead restarts at 1 when the buffer does; it is
pacing, not state. η = 0 and η = 1 have nothing to adapt.

Left out: leads measured in fractions of a version (a lead of one version whose
last groups straggle waits; the next raise takes a whole version).
"""

from __future__ import annotations

from typing import Literal

WAIT_SHARE = 0.05  # a wait longer than this share of a step is the fleet falling behind
LOWER_AFTER = 3  # hand-outs in a row with a version's surplus before the lead comes down
WARMUP = 2  # hand-outs that only measure: the first batches always wait for the fleet
STEP_SMOOTHING = 0.5  # weight of the newest hand-out interval in the step estimate

LeadMode = Literal["adaptive", "bound"]


class AdmissionLead:
    """The lead the admission window uses, updated at every hand-out (module docstring)."""

    def __init__(self, max_staleness: int, groups_per_version: int, mode: LeadMode) -> None:
        self.bound = max_staleness
        self.groups_per_version = groups_per_version
        self.adaptive = mode == "adaptive" and max_staleness > 1
        self.lead = 1 if self.adaptive else max_staleness
        self.raised = 0
        self.lowered = 0
        self._waiting_since: float | None = None
        self._last_handout: float | None = None
        self._step_s: float | None = None
        self._handouts = 0
        self._surplus_streak = 0
        self._just_raised = False

    def waiting(self, now: float) -> None:
        """A request for a batch found fewer groups ready than it asked for."""
        if self._waiting_since is None:
            self._waiting_since = now

    def handed_out(self, now: float, ready_after: int) -> None:
        """A batch was handed out at ``now``; ``ready_after`` groups are complete beyond it."""
        waited = now - self._waiting_since if self._waiting_since is not None else 0.0
        self._waiting_since = None
        if self._last_handout is not None:
            interval = now - self._last_handout
            self._step_s = (
                interval
                if self._step_s is None
                else STEP_SMOOTHING * interval + (1 - STEP_SMOOTHING) * self._step_s
            )
        self._last_handout = now
        self._handouts += 1
        if not self.adaptive or self._handouts <= WARMUP:
            return
        starved = self._step_s is not None and waited > WAIT_SHARE * self._step_s
        if starved and not self._just_raised and self.lead < self.bound:
            self.lead += 1
            self.raised += 1
            self._surplus_streak = 0
            self._just_raised = True
            return
        self._just_raised = False
        if ready_after >= self.groups_per_version and not starved:
            self._surplus_streak += 1
            if self._surplus_streak >= LOWER_AFTER and self.lead > 1:
                self.lead -= 1
                self.lowered += 1
                self._surplus_streak = 0
        else:
            self._surplus_streak = 0
