"""The end-to-end tier's order: its longest tests first.

``make test`` runs this tier on several workers (pytest-xdist); each worker starts on its
share of the tests in order and then takes tests from the others' queues. The docs test
alone runs for a third of the tier: started last, it would run on one worker with nothing
left for the other. A test's ``timeout`` marker is the measure it gives of its length, so
the tier's tests run by that, longest first (ties keep the order they were collected in).
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def _timeout_s(item) -> float:
    marker = item.get_closest_marker("timeout")
    return float(marker.args[0]) if marker and marker.args else 0.0


def pytest_collection_modifyitems(config, items):
    at = [i for i, item in enumerate(items) if HERE in Path(str(item.path)).resolve().parents]
    ordered = sorted((items[i] for i in at), key=lambda item: -_timeout_s(item))
    for i, item in zip(at, ordered, strict=True):
        items[i] = item
