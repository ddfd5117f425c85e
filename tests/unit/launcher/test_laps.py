"""launcher/laps.py: each phase's seconds, ended by the next, named in one line."""

from __future__ import annotations

import re

from launcher import laps as laps_module
from launcher.laps import Laps


def test_each_phase_is_timed_until_the_next_and_the_summary_ends_the_last(monkeypatch):
    clock = iter([10.0, 12.5, 13.0, 16.0])
    monkeypatch.setattr(laps_module.time, "monotonic", lambda: next(clock))
    laps = Laps()
    laps.enter("starting Ray")
    laps.enter("the buffer")
    laps.enter("the learner")
    line = laps.summary()
    assert laps.seconds == {"starting Ray": 2.5, "the buffer": 0.5, "the learner": 3.0}
    assert line == "6.0s: starting Ray 2.50s, the buffer 0.50s, the learner 3.00s"
    assert laps.current is None


def test_a_summary_before_any_phase_names_none():
    assert re.fullmatch(r"0\.0s: ", Laps().summary())
