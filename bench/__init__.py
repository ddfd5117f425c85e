"""The throughput harness behind ``fleetrl bench``.

Each suite measures one stage of the system beside the baseline a peer system
uses for that stage, in the same process and the same run, alternating the two
so machine noise lands on both, and reports the ratio:

- ``transport``   ZeroMQ + msgspec trajectories vs a Ray actor queue of
                  cloudpickled samples, and vs raw ZeroMQ bytes of the same payload.
- ``weight-sync`` bucketed broadcast vs one raw broadcast of the same bytes, and
                  vs one broadcast per parameter.
- ``rollout``     the embedded engine vs ``transformers`` ``generate``.
- ``learner``     packed vs padded micro-batches.
- ``e2e``         the whole training loop at staleness bound η = 1, 2, 4 vs η = 0.
- ``accuracy``    held-out score over time at η = 0, 2, 4, 8 (and the bypass loss
                  at 8) over seeds: does async learn as well as sync, and sooner?

``bench.cli`` runs suites and writes ``DIR/<suite>.json``; ``bench.report``
renders the Markdown table and plots; ``bench.common`` holds machine facts,
repetition and JSON helpers. A benchmark is never a test: nothing here asserts
a speed.
"""
