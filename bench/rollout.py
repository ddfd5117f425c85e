"""Rollout throughput: the embedded engine against transformers ``generate``.

Both sides decode the same ``batch`` prompts for exactly ``max_new_tokens``
tokens (EOS ignored, so lengths are equal), at temperature 1, on the same
device and thread count, in alternation (``bench.common.alternate``); figures
are output tokens per second, medians over ``reps``.

- engine: an in-process ``EmbeddedEngine`` behind its HTTP server, driven the
  way rollout workers drive it: ``batch`` concurrent ``/generate`` requests
  through ``EngineClient`` (so HTTP, JSON and scheduling costs are included);
- baseline: one ``model.generate(do_sample=True)`` call on the padded batch.

Headline: ``summary.vs_hf_generate`` = engine tokens/s / generate tokens/s.

Run: ``python -m bench.rollout --out DIR [--quick]`` or ``fleetrl bench rollout --out DIR``.
Left out: SGLang (GPU nodes only), prefill-heavy workloads, varying lengths.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import Progress, alternate, ratio, suite_json_path, suite_record, write_json
from fleetrl.log import get_logger, setup_logging

log = get_logger(__name__)

PROMPT_TOKENS = 16
QUICK = {"batch": 16, "max_new_tokens": 48, "hidden": 64, "layers": 2, "reps": 3}
FULL = {"batch": 32, "max_new_tokens": 128, "hidden": 256, "layers": 4, "reps": 5}


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
) -> dict[str, Any]:
    """Measure both sides; write ``out_dir/rollout.json``; return the suite dict."""
    import torch

    from fleetrl.models.tiny import make_tiny_model
    from rollout_fleet.client import EngineClient
    from rollout_fleet.engine.server import EmbeddedEngine

    defaults = QUICK if quick else FULL
    batch = batch or defaults["batch"]
    max_new_tokens = max_new_tokens or defaults["max_new_tokens"]
    hidden = _first(hidden) or defaults["hidden"]
    layers = layers or defaults["layers"]
    reps = reps or defaults["reps"]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    progress = Progress("rollout")
    config = {
        "batch": batch,
        "max_new_tokens": max_new_tokens,
        "hidden": hidden,
        "layers": layers,
        "reps": reps,
        "device": device,
        "prompt_tokens": PROMPT_TOKENS,
        "torch_threads": 1,
    }
    started = time.monotonic()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        heads = max(1, hidden // 32)
        model_dir = make_tiny_model(
            Path(tmp) / "model",
            layers=layers,
            hidden=hidden,
            heads=heads,
            max_positions=PROMPT_TOKENS + max_new_tokens + 8,
        )
        engine = EmbeddedEngine(
            model_dir, engine_id="bench", device=device, max_running_requests=batch, num_threads=1
        )
        try:
            url = engine.start_server()
            vocab = engine.runner.vocab_size
            rng = random.Random(0)
            prompts = [
                [rng.randrange(6, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(batch)
            ]
            params = {"temperature": 1.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
            model = engine.runner.model
            hf_input = torch.tensor(prompts, device=engine.runner.device)

            async def engine_round() -> float:
                async with EngineClient(url, timeout_s=600) as client:
                    t0 = time.perf_counter()
                    outs = await asyncio.gather(*(client.generate(p, params) for p in prompts))
                    wall = time.perf_counter() - t0
                tokens = sum(len(o["output_ids"]) for o in outs)
                if tokens != batch * max_new_tokens:
                    raise RuntimeError(
                        f"engine produced {tokens} tokens, expected {batch * max_new_tokens}"
                    )
                return tokens / wall

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
                        eos_token_id=10**9,
                        pad_token_id=0,
                    )
                    wall = time.perf_counter() - t0
                return (out.shape[1] - PROMPT_TOKENS) * batch / wall

            figures = alternate(
                {
                    "engine_tokens_per_s": lambda: asyncio.run(engine_round()),
                    "hf_generate_tokens_per_s": hf_round,
                },
                reps,
                progress=progress,
                label="engine vs generate",
            )
            engine_stats = engine.scheduler.load()
        finally:
            engine.stop()
    engine_rate = figures["engine_tokens_per_s"]["median"]
    hf_rate = figures["hf_generate_tokens_per_s"]["median"]
    summary = {
        "vs_hf_generate": ratio(engine_rate, hf_rate),
        "engine_tokens_per_s": engine_rate,
        "hf_generate_tokens_per_s": hf_rate,
    }
    results = {**figures, "engine_scheduler": engine_stats}
    write_json(
        suite_json_path(out_dir, "rollout"),
        suite_record(
            "rollout",
            config=config,
            results=results,
            summary=summary,
            wall_s=time.monotonic() - started,
        ),
    )
    log.info(
        "rollout: engine %.0f tok/s, generate %.0f tok/s, ratio %s",
        engine_rate,
        hf_rate,
        summary["vs_hf_generate"],
    )
    return {"config": config, "results": results, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.rollout", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--device", default="cpu")
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
    )
    print(json.dumps(result["summary"], indent=2))  # CLI output, not library logging
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
