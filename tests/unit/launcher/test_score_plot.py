"""The end-of-run score curve: drawn in a thread while the roles shut down, or at the end."""

from __future__ import annotations

import json
import threading

import pytest

from launcher import train


def _metrics(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "critic/score/mean": s / 4, "val/score/mean": s / 5} for s in range(1, 5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_started_it_draws_in_its_own_thread_and_finish_waits_for_the_png(tmp_path, monkeypatch):
    drawn_in = []
    real = train.write_score_plot
    monkeypatch.setattr(
        train, "write_score_plot",
        lambda *a: (drawn_in.append(threading.current_thread().name), real(*a))[1],
    )  # fmt: skip
    plot = train.ScorePlot(_metrics(tmp_path), tmp_path / "curve.png", "t")
    plot.start()
    assert plot.finish() == tmp_path / "curve.png"
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn_in == ["score-plot"]


def test_never_started_it_draws_at_the_end_and_a_failure_surfaces_there(tmp_path, monkeypatch):
    plot = train.ScorePlot(_metrics(tmp_path), tmp_path / "curve.png", "t")
    assert plot.finish().stat().st_size > 0
    monkeypatch.setattr(train, "write_score_plot", lambda *a: 1 / 0)
    failing = train.ScorePlot(_metrics(tmp_path), tmp_path / "other.png", "t")
    failing.start()
    with pytest.raises(ZeroDivisionError):
        failing.finish()
