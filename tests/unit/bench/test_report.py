"""bench.report: the Markdown table shows every headline (or the suite's error) and plots are written."""

from __future__ import annotations

from bench.common import suite_json_path, suite_record, write_json
from bench.report import headline_rows, markdown, write_report


def _ok(suite: str, summary: dict, **extra) -> dict:
    return suite_record(suite, config={}, summary=summary, **extra)


def test_headline_rows_show_values_errors_and_suites_not_run():
    records = {
        "transport": _ok("transport", {"vs_ray_queue": 4.0, "vs_raw_zmq": 0.8}),
        "rollout": suite_record("rollout", config={}, error="suite unavailable: no module"),
        "learner": _ok("learner", {}),
    }
    rows = {(r["suite"], r["ratio"]): r for r in headline_rows(records)}
    assert rows[("transport", "vs_ray_queue")]["value"] == 4.0
    assert rows[("rollout", "vs_hf_generate")]["status"] == "suite unavailable: no module"
    assert (
        rows[("learner", "packed_vs_padded")]["status"] == "ratio missing from the suite's summary"
    )
    assert rows[("e2e", "async_vs_sync")]["status"] == "not run"
    text = markdown(records)
    assert "suite unavailable: no module" in text
    assert "| transport | `vs_ray_queue` | 4.000 |" in text


def test_write_report_writes_table_summary_sweep_and_e2e_plots(tmp_path):
    sweep = {
        "x": "hidden",
        "unit": "tokens/s",
        "rows": [
            {"x": 64, "series": {"fleetrl": 100.0, "hf generate": 40.0}},
            {"x": 128, "series": {"fleetrl": 60.0, "hf generate": 30.0}},
        ],
    }
    write_json(
        suite_json_path(tmp_path, "rollout"),
        _ok("rollout", {"vs_hf_generate": 2.5}, sweep=sweep),
    )
    e2e = _ok(
        "e2e",
        {"async_vs_sync": 1.5},
        results={
            "runs": [
                {
                    "label": "η=0",
                    "eta": 0,
                    "correction": "decoupled",
                    "curve": [[0, 0.1], [5, 0.4]],
                },
                {
                    "label": "η=4 bypass",
                    "eta": 4,
                    "correction": "bypass",
                    "curve": [[0, 0.1], [3, 0.2]],
                },
            ]
        },
    )
    write_json(suite_json_path(tmp_path, "e2e"), e2e)
    written = write_report(tmp_path)
    assert set(written) == {"report.md", "summary.png", "rollout_throughput.png", "e2e_score.png"}
    for path in written.values():
        assert path.stat().st_size > 0
    assert (tmp_path / "summary.png").read_bytes()[:4] == b"\x89PNG"
    assert "η=4 bypass" in (tmp_path / "report.md").read_text()


def test_an_unreadable_suite_json_becomes_an_error_row(tmp_path):
    suite_json_path(tmp_path, "learner").write_text("{not json")
    write_report(tmp_path)
    assert "unreadable" in (tmp_path / "report.md").read_text()
