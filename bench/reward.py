"""Reward-model scoring: batched ``/classify`` against one request per sample, same server.

One reward server (the embedded engine serving a random reward model, in a process of its
own, as a reward fleet runs it) scores the same samples (prompt + response token lists of
the CPU demo's shape: lognormal lengths around 32 tokens, at most 64) two ways, alternated
over ``reps`` rounds, for each model size (``hidden_sizes``; quick: the demo's 64, full:
64 and 256; ``layers`` 2):

- ``batched``: ``RewardModelClient`` with ``batch_size`` inputs per ``/classify`` request,
  the batches of a round in flight together (what the rollout worker does per group);
- ``per_sample``: one ``/classify`` request per sample, all in flight together: verl's
  reward loop (``RewardLoopManager.run_single`` per sample, each its own HTTP request to
  the reward router). The server merges waiting requests into shared forwards in both
  arms (as SGLang's scheduler does), so the gap is the cost of a request per sample:
  HTTP, JSON, scheduling, not fewer forwards alone.

Figures are samples/s. ``summary.batched_vs_per_sample`` is the median of the per-round
ratios (batched ÷ per-sample, the same round) at the first size, with min and max;
``batched_vs_per_sample_hidden<H>`` the same at the other sizes (the larger the model,
the more of the time is the forward both arms share); ``forwards_*`` count the server's
forwards per round (``/get_server_info``), and ``scores_agree`` checks that both arms read
the same scores. A benchmark, not a test: nothing is asserted.

Then the end-to-end half (``run``'s ``e2e`` hook, by default ``served_e2e``):
``bench.reward_e2e.run_served`` starts a reward server of its own for a reward model with
the RL workload's tokenizer, trains a rule-only arm against a rule + model arm (model
weight 0: same policy, scoring on top) alternated, stops the server, and its figures join
``summary``: ``model_vs_rule`` (samples/s with model scoring ÷ rule-only, paired per
repetition), ``model_scoring_overhead`` (= 1 / model_vs_rule − 1, goal <= 0.10),
``group_latency_s``, ``server_scored_items``; every run is in ``DIR/reward_e2e.json``.
``e2e=None`` measures batching alone.

Run: ``python -m bench.reward --out DIR [--quick] [--reps N] [--hidden H] [--layers L]
[--batch B] [--no-e2e]`` (writes ``DIR/reward.json``); ``fleetrl bench reward`` calls ``run``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench import reward_e2e
from bench.common import Progress, alternate
from bench.reward_server import RewardServer
from fleetrl.log import get_logger

log = get_logger(__name__)

E2EHook = Callable[[Path, bool], dict[str, Any]]

# The CPU demo's shape: prompts of ~23 tokens, responses of at most 4, rendered with the
# reward model's chat template (a few tokens more).
MEDIAN_TOKENS, MAX_TOKENS = 32, 64


def _samples(count: int, vocab: int, median: int, cap: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), 0.6, size=count), 4, cap).astype(int)
    return [rng.integers(7, vocab, size=int(n)).tolist() for n in lengths]


def _measure_size(
    hidden: int,
    layers: int,
    batch_size: int,
    samples_count: int,
    reps: int,
    progress: Progress,
) -> dict[str, Any]:
    """Both arms, alternated, on one server of a reward model of ``hidden`` × ``layers``."""
    from fleetrl.models.tiny import make_tiny_model
    from rollout_fleet.rewards.model_client import RewardModelClient

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(
            Path(tmp) / "rm", layers=layers, hidden=hidden, heads=4,
            max_positions=MAX_TOKENS + 64, reward_model=True,
        )  # fmt: skip
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        samples = _samples(samples_count, vocab, MEDIAN_TOKENS, MAX_TOKENS, seed=0)
        server = RewardServer(model_dir, max_running_requests=batch_size)
        loop = asyncio.new_event_loop()
        try:
            server.wait()
            clients = {
                name: RewardModelClient(
                    {"bench": server.url}, api_key=server.api_key, batch_size=size,
                    request_timeout_s=300, max_attempts=1, retry_backoff_s=0,
                )
                for name, size in (("batched", batch_size), ("per_sample", 1))
            }  # fmt: skip
            scores: dict[str, list[float]] = {}
            forwards: dict[str, list[int]] = {name: [] for name in clients}

            def measure(name: str) -> Callable[[], float]:
                def once() -> float:
                    before = server.forwards()
                    started = time.perf_counter()
                    scores[name] = loop.run_until_complete(clients[name].score(samples))
                    elapsed = time.perf_counter() - started
                    forwards[name].append(server.forwards() - before)
                    return len(samples) / elapsed

                return once

            figures = alternate(
                {name: measure(name) for name in clients},
                reps,
                progress=progress,
                label=f"hidden {hidden}",
            )
            stats = {name: client.stats() for name, client in clients.items()}
            for client in clients.values():
                loop.run_until_complete(client.aclose())
        finally:
            loop.close()
            server.stop()
    paired = [b / p for b, p in zip(figures["batched"]["reps"], figures["per_sample"]["reps"], strict=True)]  # fmt: skip
    return {
        "hidden": hidden,
        "samples_per_s": figures,
        "paired_ratios": paired,
        "ratio": statistics.median(paired),
        # the warm-up round is the first; each arm's forwards per round after it
        "forwards_per_round": {name: f[1:] for name, f in forwards.items()},
        "scores_agree": bool(np.allclose(scores["batched"], scores["per_sample"], atol=1e-4)),
        "client_stats": stats,
    }


def served_e2e(out_dir: Path, quick: bool) -> dict[str, Any]:
    """The e2e half's summary: both arms on a reward server started (and stopped) for them."""
    return reward_e2e.run_served(out_dir, quick)["summary"]


def run(
    out_dir: str | Path,
    quick: bool = False,
    reps: int | None = None,
    hidden_sizes: list[int] | None = None,
    layers: int | None = None,
    batch_size: int | None = None,
    e2e: E2EHook | None = served_e2e,
) -> dict[str, Any]:
    reps = reps or (5 if quick else 9)
    sizes = list(hidden_sizes or ([64] if quick else [64, 256]))
    layers = layers or 2
    batch_size = batch_size or 64
    count = 256 if quick else 1024
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    progress = Progress("reward")
    measured = [_measure_size(h, layers, batch_size, count, reps, progress) for h in sizes]
    head = measured[0]
    paired = head["paired_ratios"]
    summary: dict[str, Any] = {
        "batched_vs_per_sample": head["ratio"],
        "batched_vs_per_sample_min": min(paired),
        "batched_vs_per_sample_max": max(paired),
        "batched_samples_per_s": head["samples_per_s"]["batched"]["median"],
        "per_sample_samples_per_s": head["samples_per_s"]["per_sample"]["median"],
        "forwards_batched": statistics.median(head["forwards_per_round"]["batched"]),
        "forwards_per_sample": statistics.median(head["forwards_per_round"]["per_sample"]),
        "scores_agree": all(m["scores_agree"] for m in measured),
        "reps": reps,
    }
    for m in measured[1:]:
        summary[f"batched_vs_per_sample_hidden{m['hidden']}"] = m["ratio"]
    error = None
    if e2e is not None:
        try:
            summary.update(e2e(out_dir, quick))
        except Exception as err:  # the batched figures above are kept; the suite fails
            log.exception("bench reward: the e2e half failed")
            error = f"the e2e half failed: {type(err).__name__}: {err}"
    result = {
        "suite": "reward",
        "config": {
            "hidden_sizes": sizes,
            "layers": layers,
            "batch_size": batch_size,
            "samples": count,
            "median_tokens": MEDIAN_TOKENS,
            "max_tokens": MAX_TOKENS,
            "reps": reps,
            "server": "embedded reward engine, own process, 1 torch thread",
        },
        "results": {"sizes": measured},
        "summary": summary,
        "sweep": {
            "x": "hidden",
            "unit": "samples/s",
            "rows": [
                {
                    "x": m["hidden"],
                    "series": {
                        "batched /classify": m["samples_per_s"]["batched"]["median"],
                        "one request per sample": m["samples_per_s"]["per_sample"]["median"],
                    },
                }
                for m in measured
            ],
        },
    }
    if error is not None:
        result["error"] = error
    (out_dir / "reward.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--hidden", type=int, nargs="*", default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--no-e2e", action="store_true", help="batched vs per-sample alone")
    args = parser.parse_args(argv)
    from fleetrl.log import setup_logging

    setup_logging("bench")
    e2e = None if args.no_e2e else served_e2e
    result = run(args.out, args.quick, args.reps, args.hidden, args.layers, args.batch, e2e)
    json.dump(result["summary"], sys.stdout)  # entry point: the headline on stdout
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
