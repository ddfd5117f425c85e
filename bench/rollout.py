"""Rollout throughput: the embedded engine against transformers ``generate``, on GRPO groups.

The workload is what a GRPO rollout generates: ``batch`` prompts, ``group_size``
samples of each (``rollout.n``), prompts about as long as the responses (math
RL: a templated question of a few hundred tokens, an answer of a few hundred).
Both sides decode every sample for exactly ``max_new_tokens`` tokens (EOS
ignored, so lengths are equal), at temperature 1, on the same device and thread
count, in alternation (as ``bench.common.alternate`` does); figures are output
tokens per second, medians over ``reps``.

- engine: an in-process ``EmbeddedEngine`` behind its HTTP server, driven the
  way rollout workers drive it: one ``/generate`` request per *sample* (its own
  rid; the engine shares the prompt's prefill across them), all concurrent,
  through one long-lived ``EngineClient`` (so HTTP, JSON and scheduling costs
  are included; client, server and scheduler share this process and its GIL);
- remote client: the same requests from a client in a child process, as in a
  real run (engine and rollout workers are separate Ray actors), so the
  client's own Python work does not share the engine's GIL;
- scheduler: the same engine's scheduler fed the same samples in-process (no
  HTTP), to separate engine speed from serving overhead; ``scheduler_unshared``
  the same with prefill sharing off (every sample prefills its prompt);
- baseline: one ``model.generate(do_sample=True, num_return_sequences=n)`` call
  on the prompts (equal lengths, so no padding), with the HF model the engine
  serves: the naive rollout (TRL's GRPO trainer generates this way), which runs
  each prompt through the model n times.

The engine's prefill cache is flushed before every engine round (outside the
timed part), so no round reuses a prompt prefilled by an earlier one.

Headline: ``summary.vs_hf_generate`` = engine (over HTTP, client in-process)
tokens/s / generate tokens/s; ``summary.remote_client_vs_hf_generate`` with the
client in its own process; ``summary.scheduler_vs_hf_generate`` without HTTP;
``summary.prefill_sharing_speedup`` = scheduler / scheduler_unshared. The
``paired_*`` figures are medians of per-round ratios, steadier on a shared machine.

Run: ``python -m bench.rollout --out DIR [--quick] [--group-size N] [--prompt-tokens P]``
or ``fleetrl bench rollout --out DIR``.
Left out: SGLang (GPU nodes only), varying lengths within a round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.common import (
    Progress,
    alternate_rounds,
    median,
    ratio,
    stats,
    write_suite,
)
from fleetrl.log import get_logger, setup_logging

log = get_logger(__name__)

REMOTE_CLIENT_FLAG = "--remote-client"  # internal: run as _RemoteClient's child
# batch = prompts per round; every prompt is sampled group_size times (n = 8 as in
# configs/demo_cpu.yaml). --quick measures the same sizes with fewer repetitions: the
# ratio depends on the sizes (at 64 + 64 tokens and hidden 64 a round is 2,048 tokens in
# about 60 ms, and the few ms a burst of 32 HTTP requests takes to arrive decide it), so a
# quick figure at smaller sizes would answer a different question.
FULL = {
    "batch": 8,
    "group_size": 8,
    "prompt_tokens": 256,
    "max_new_tokens": 256,
    "hidden": 256,
    "layers": 4,
    "reps": 7,
}
QUICK = {**FULL, "reps": 3}


def _samples(prompts: list[list[int]], group_size: int) -> list[list[int]]:
    """One entry per sample, prompt-major (the order of ``num_return_sequences``)."""
    return [prompt for prompt in prompts for _ in range(group_size)]


def _scheduler_round(
    scheduler: Any, samples: list[list[int]], max_new_tokens: int, share_prefill: bool
) -> float:
    """Output tokens/s of the engine's scheduler driven in-process (no HTTP, no JSON)."""
    from rollout_fleet.engine.sampling import RowSampling
    from rollout_fleet.engine.scheduler import Sequence as EngineSequence

    remaining = threading.Semaphore(0)

    def on_event(seq: EngineSequence, done: bool) -> None:
        if done:
            remaining.release()

    seqs = [
        EngineSequence(
            rid=f"bench-{i}",
            parent_rid=f"bench-{i}",
            prompt_ids=prompt,
            max_new_tokens=max_new_tokens,
            sampling=RowSampling(temperature=1.0),
            stop_token_ids=frozenset(),
            stop_strings=[],
            on_event=on_event,
        )
        for i, prompt in enumerate(samples)
    ]
    scheduler.flush_cache().result()
    scheduler.share_prefill = share_prefill  # read by the scheduler thread, now idle
    t0 = time.perf_counter()
    scheduler.submit(seqs).result()
    for _ in seqs:
        remaining.acquire()
    wall = time.perf_counter() - t0
    scheduler.share_prefill = True
    tokens = sum(len(s.output_ids) for s in seqs)
    if tokens != len(samples) * max_new_tokens:
        raise RuntimeError(f"scheduler produced {tokens} tokens, expected the full length")
    return tokens / wall


def _alternate_paired(
    measures: dict[str, Callable[[], float]],
    reps: int,
    *,
    progress: Progress,
    baseline: str = "hf_generate_tokens_per_s",
    deadline: float | None = None,
) -> tuple[dict[str, dict[str, Any]], dict[str, list[float]]]:
    """Like ``bench.common.alternate`` (one warm-up round, then ``reps`` rounds in an order
    reversed every other round), also returning each round's ratio to ``baseline``. With
    ``deadline`` (``time.monotonic()``) rounds stop once it has passed, after at least one."""
    figures = alternate_rounds(
        measures, reps, progress=progress, label="engine vs generate", deadline=deadline
    )
    paired = {
        name: [a / b for a, b in zip(figures[name], figures[baseline], strict=True)]
        for name in figures
        if name != baseline
    }
    return {name: stats(values) for name, values in figures.items()}, paired


class _RemoteClient:
    """A rollout-worker stand-in in its own process (as ``EngineActor`` and the workers are
    separate Ray actors): each ``round()`` sends every prompt as one concurrent ``/generate``
    and returns the output tokens/s the child measured."""

    def __init__(self, url: str, prompts: list[list[int]], params: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.rollout", REMOTE_CLIENT_FLAG],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"url": url, "prompts": prompts, "params": params}) + "\n")
        self.proc.stdin.flush()

    def round(self) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"remote client exited with status {self.proc.wait()}")
        return float(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # our own child, by its handle
            self.proc.wait()


def _remote_client_main() -> int:
    """Child side of ``_RemoteClient``: a JSON config line, then one round per ``go`` line."""
    from rollout_fleet.client import EngineClient

    config = json.loads(sys.stdin.readline())
    prompts, params = config["prompts"], config["params"]
    expected = len(prompts) * params["max_new_tokens"]
    client = EngineClient(config["url"], timeout_s=600)

    async def one_round() -> float:
        return await _generate_rate(client, prompts, params, expected)

    loop = asyncio.new_event_loop()
    try:
        for line in sys.stdin:
            if line.strip() != "go":
                break
            sys.stdout.write(f"{loop.run_until_complete(one_round())}\n")
            sys.stdout.flush()
    finally:
        loop.run_until_complete(client.close())
        loop.close()
    return 0


async def _generate_rate(
    client: Any, prompts: list[list[int]], params: dict[str, Any], expected_tokens: int
) -> float:
    """Output tokens/s of one batch of concurrent ``generate`` requests (all must finish)."""
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(client.generate(p, params) for p in prompts))
    wall = time.perf_counter() - t0
    tokens = sum(len(o["output_ids"]) for o in outs)
    if tokens != expected_tokens:
        raise RuntimeError(f"engine produced {tokens} tokens, expected {expected_tokens}")
    return tokens / wall


def _first(value: int | Sequence[int] | None) -> int | None:
    if value is None or isinstance(value, int):
        return value
    return int(value[0]) if len(value) else None


def run(
    out_dir: str | Path,
    quick: bool = False,
    reps: int | None = None,
    batch: int | None = None,
    max_new_tokens: int | None = None,
    hidden: int | Sequence[int] | None = None,
    layers: int | None = None,
    device: str = "cpu",
    group_size: int | None = None,
    prompt_tokens: int | None = None,
    *,
    heads: int | None = None,
    dtype: str = "float32",
    deadline: float | None = None,
) -> dict[str, Any]:
    """Measure every side; write ``out_dir/rollout.json``; return the suite dict.

    ``heads`` defaults to one per 32 hidden units; ``dtype`` is the engine's (and so the
    baseline's: both run the same model); ``deadline`` bounds the repetitions (at least one)."""
    import torch

    from fleetrl.models.tiny import make_tiny_model
    from rollout_fleet.engine.server import EmbeddedEngine

    config = _config(
        QUICK if quick else FULL,
        batch=batch,
        group_size=group_size,
        prompt_tokens=prompt_tokens,
        max_new_tokens=max_new_tokens,
        hidden=_first(hidden),
        layers=layers,
        reps=reps,
        device=device,
        dtype=dtype,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    progress = Progress("rollout")
    started = time.monotonic()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        heads = heads or max(1, config["hidden"] // 32)
        model_dir = make_tiny_model(
            Path(tmp) / "model",
            layers=config["layers"],
            hidden=config["hidden"],
            heads=heads,
            max_positions=config["prompt_tokens"] + config["max_new_tokens"] + 8,
        )
        engine = EmbeddedEngine(
            model_dir, engine_id="bench", device=device, max_running_requests=config["rows"],
            num_threads=1, dtype=dtype,
        )  # fmt: skip
        figures, paired, engine_stats = _measure(engine, config, progress, deadline)
    summary = _summary(figures, paired)
    results = {**figures, "paired_ratios": paired, "engine_scheduler": engine_stats}
    record = write_suite(
        out_dir, "rollout", config=config, results=results, summary=summary, started=started
    )
    log.info(
        "rollout: engine %.0f tok/s, generate %.0f tok/s, ratio %s",
        summary["engine_tokens_per_s"],
        summary["hf_generate_tokens_per_s"],
        summary["vs_hf_generate"],
    )
    return record


def _config(
    defaults: dict[str, int],
    *,
    batch: int | None,
    group_size: int | None,
    prompt_tokens: int | None,
    max_new_tokens: int | None,
    hidden: int | None,
    layers: int | None,
    reps: int | None,
    device: str,
    dtype: str,
) -> dict[str, Any]:
    """The suite's sizes: each one given, else the default of its mode (quick or full)."""
    batch = batch or defaults["batch"]
    group_size = group_size or defaults["group_size"]
    return {
        "batch": batch,
        "group_size": group_size,
        "rows": batch * group_size,
        "prompt_tokens": prompt_tokens or defaults["prompt_tokens"],
        "max_new_tokens": max_new_tokens or defaults["max_new_tokens"],
        "hidden": hidden or defaults["hidden"],
        "layers": layers or defaults["layers"],
        "reps": reps or defaults["reps"],
        "device": device,
        "dtype": dtype,
        "torch_threads": 1,
    }


def _measure(
    engine: Any, config: dict[str, Any], progress: Progress, deadline: float | None
) -> tuple[dict[str, dict[str, Any]], dict[str, list[float]], dict[str, Any]]:
    """Serve the engine and alternate the five sides' rounds; the engine is stopped after."""
    from rollout_fleet.client import EngineClient

    # One long-lived client on one event loop, as a rollout worker holds it.
    loop = asyncio.new_event_loop()
    client: EngineClient | None = None
    remote: _RemoteClient | None = None
    try:
        url = engine.start_server()
        client = EngineClient(url, timeout_s=600)
        vocab = engine.runner.vocab_size
        rng = random.Random(0)
        prompts = [
            [rng.randrange(6, vocab) for _ in range(config["prompt_tokens"])]
            for _ in range(config["batch"])
        ]
        samples = _samples(prompts, config["group_size"])
        params = {
            "temperature": 1.0,
            "max_new_tokens": config["max_new_tokens"],
            "ignore_eos": True,
        }
        remote = _RemoteClient(url, samples, params)
        figures, paired = _alternate_paired(
            _rounds(engine, client, loop, remote, prompts, params, config),
            config["reps"],
            progress=progress,
            deadline=deadline,
        )
        return figures, paired, engine.scheduler.load()
    finally:
        if remote is not None:
            remote.close()
        if client is not None:
            loop.run_until_complete(client.close())
        loop.close()
        engine.stop()


def _rounds(
    engine: Any,
    client: Any,
    loop: asyncio.AbstractEventLoop,
    remote: _RemoteClient,
    prompts: list[list[int]],
    params: dict[str, Any],
    config: dict[str, Any],
) -> dict[str, Callable[[], float]]:
    """One round (tokens/s of one batch) per side: engine over HTTP, generate, scheduler..."""
    import torch

    max_new_tokens, group_size = config["max_new_tokens"], config["group_size"]
    samples = _samples(prompts, group_size)
    model = engine.runner.model
    hf_input = torch.tensor(prompts, device=engine.runner.device)
    expected_tokens = config["rows"] * max_new_tokens

    def flush() -> None:  # no round reuses prompts prefilled by an earlier one
        engine.scheduler.flush_cache().result()

    def engine_round() -> float:
        flush()
        return loop.run_until_complete(_generate_rate(client, samples, params, expected_tokens))

    def remote_round() -> float:
        flush()
        return remote.round()

    def scheduler_round() -> float:
        return _scheduler_round(engine.scheduler, samples, max_new_tokens, True)

    def scheduler_unshared_round() -> float:
        return _scheduler_round(engine.scheduler, samples, max_new_tokens, False)

    def hf_round() -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(
                hf_input,
                attention_mask=torch.ones_like(hf_input),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=max_new_tokens,
                num_return_sequences=group_size,
                eos_token_id=10**9,
                pad_token_id=0,
            )
            wall = time.perf_counter() - t0
        return (out.shape[1] - config["prompt_tokens"]) * out.shape[0] / wall

    return {
        "engine_tokens_per_s": engine_round,
        "hf_generate_tokens_per_s": hf_round,
        "scheduler_tokens_per_s": scheduler_round,
        "scheduler_unshared_tokens_per_s": scheduler_unshared_round,
        "remote_client_tokens_per_s": remote_round,
    }


def _summary(figures: dict[str, dict[str, Any]], paired: dict[str, list[float]]) -> dict[str, Any]:
    """The headline ratios: each side's median rate against generate's, and the paired medians."""
    rate = {name: f["median"] for name, f in figures.items()}
    hf_rate = rate["hf_generate_tokens_per_s"]
    return {
        "vs_hf_generate": ratio(rate["engine_tokens_per_s"], hf_rate),
        "engine_tokens_per_s": rate["engine_tokens_per_s"],
        "hf_generate_tokens_per_s": hf_rate,
        "scheduler_vs_hf_generate": ratio(rate["scheduler_tokens_per_s"], hf_rate),
        "scheduler_tokens_per_s": rate["scheduler_tokens_per_s"],
        "scheduler_unshared_vs_hf_generate": ratio(
            rate["scheduler_unshared_tokens_per_s"], hf_rate
        ),
        "prefill_sharing_speedup": ratio(
            rate["scheduler_tokens_per_s"], rate["scheduler_unshared_tokens_per_s"]
        ),
        "remote_client_vs_hf_generate": ratio(rate["remote_client_tokens_per_s"], hf_rate),
        "remote_client_tokens_per_s": rate["remote_client_tokens_per_s"],
        # Medians of per-round ratios (each against the generate run next to it):
        # steadier than a ratio of medians on a machine shared with other work.
        "paired_vs_hf_generate": median(paired["engine_tokens_per_s"]),
        "paired_vs_hf_generate_min": min(paired["engine_tokens_per_s"]),
        "paired_vs_hf_generate_max": max(paired["engine_tokens_per_s"]),
        "paired_scheduler_vs_hf_generate": median(paired["scheduler_tokens_per_s"]),
        "paired_remote_client_vs_hf_generate": median(paired["remote_client_tokens_per_s"]),
    }


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv)[:1] == [REMOTE_CLIENT_FLAG]:
        return _remote_client_main()
    parser = argparse.ArgumentParser(
        prog="python -m bench.rollout", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None, help="prompts per round")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--group-size", type=int, default=None, help="samples per prompt (n)")
    parser.add_argument("--prompt-tokens", type=int, default=None)
    args = parser.parse_args(argv)
    setup_logging("bench")
    result = run(
        args.out,
        args.quick,
        args.reps,
        args.batch,
        args.max_new_tokens,
        args.hidden,
        args.layers,
        args.device,
        args.group_size,
        args.prompt_tokens,
    )
    print(json.dumps(result["summary"], indent=2))  # CLI output, not library logging
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
