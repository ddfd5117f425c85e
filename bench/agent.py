"""Agent suite: what the gateway costs per call, and agent episodes/s at η = 2 against η = 0.

Overhead. One embedded engine serves the agent demo's model (hidden 64, 2 layers,
the tool template) on loopback. Each round sends ``concurrency`` calls of the demo's
first turn (its question and tool list, ``max_tokens`` tokens, EOS ignored so every
call generates exactly that many), alternating:

- direct: ``POST /generate`` with the call's token ids, one ``EngineClient`` request
  per call (what a rollout worker sends for a plain sample);
- gateway: ``POST /v1/chat/completions`` with the call's messages and tools (one
  episode and key per call; an aiohttp client, as the direct side uses), through the
  gateway's session lookup, rendering, ``SampleRunner``, tool-call parsing and OpenAI
  reply (the ``openai`` package's ``ChatCompletion`` parses it), to the same engine
  with the same ids. The agent's own client cost is the agent's, not the gateway's:
  building an ``openai`` client takes ~0.1 s and each call's request and reply models
  a few ms more (docs/agents.md).

Both sides run on one event loop with the engine's own threads, as an async agent
runs in the rollout worker. Headline ``gateway_overhead`` = median over rounds of
gateway time ÷ direct time − 1 (goal ≤ 0.05 at the demo size).

Throughput. The agent demo (``configs/demo_agent_cpu.yaml``, its data and model from
``examples/agents/build_calculator_demo.py``) trains ``steps`` steps at η = 0 and at
η = 2, same resources; episodes/s = agent episodes run per second of wall time after
``warmup_steps``. Headline ``eta2_vs_eta0``.

Run: ``fleetrl bench agent --out DIR [--quick]``.
Left out: SGLang engines (GPU), agents in other processes (their own client cost).
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Progress, median, ratio, stats, suite_json_path, suite_record, write_json
from fleetrl.log import get_logger

log = get_logger(__name__)

SUITE = "agent"
QUESTION = [{"role": "user", "content": "What is 47*86+3?"}]
FULL = {"reps": 9, "concurrency": 8, "max_tokens": 64, "steps": 12, "warmup_steps": 2}
QUICK = {**FULL, "reps": 5, "steps": 8}
REPO = Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO / "configs" / "demo_agent_cpu.yaml"
DEMO_AGENT = REPO / "examples" / "agents" / "calculator_agent.py"
DEMO_BUILD = REPO / "examples" / "agents" / "build_calculator_demo.py"


def _demo_agent() -> Any:
    """The demo's agent module (a file outside the package, as a user's agent is)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("calculator_agent", DEMO_AGENT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def _overhead_rounds(engine_url: str, tokenizer: Any, sizes: dict[str, Any],
                           progress: Progress) -> dict[str, list[float]]:  # fmt: skip
    import aiohttp
    from openai.types.chat import ChatCompletion

    TOOLS = _demo_agent().TOOLS  # noqa: N806 (the agent's constant)
    from rollout_fleet.client import EngineClient
    from rollout_fleet.gateway.calls import CallRunner
    from rollout_fleet.gateway.episodes import SessionTable
    from rollout_fleet.gateway.rendering import ChatRenderer
    from rollout_fleet.gateway.server import AgentGateway
    from rollout_fleet.router import Router
    from rollout_fleet.sample_runner import SampleRunner

    router = Router()
    router.membership.launch("e0", engine_url)
    router.membership.weights_loaded("e0", 0)
    engine = EngineClient(engine_url, timeout_s=120)
    runner = SampleRunner(router, {"e0": engine})
    renderer = ChatRenderer(tokenizer)
    sessions = SessionTable()
    calls = CallRunner(runner, renderer, tool_format="hermes", max_prompt_tokens=512,
                       vocab_size=len(tokenizer))  # fmt: skip
    gateway = AgentGateway(sessions, calls, model_name="policy", token_text=lambda t: "")
    base_url = await gateway.start()
    ids = renderer.prompt_ids(QUESTION, TOOLS)
    k, count = sizes["max_tokens"], sizes["concurrency"]
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": k,
                "ignore_eos": True}  # fmt: skip

    async def direct() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(engine.generate(ids, sampling, rid=secrets.token_hex(8))
                               for _ in range(count)))  # fmt: skip
        return time.perf_counter() - t0

    body = {"model": "policy", "messages": QUESTION, "tools": TOOLS, "max_tokens": k}
    http = aiohttp.ClientSession()

    async def one_call(key: str) -> dict:
        headers = {"Authorization": f"Bearer {key}"}
        async with http.post(f"{base_url}/chat/completions", json=body, headers=headers) as resp:
            resp.raise_for_status()
            return await resp.json()

    async def through_gateway() -> float:
        keys = [
            sessions.open(f"b/e{i}", f"b{secrets.token_hex(4)}", sampling)[1] for i in range(count)
        ]
        t0 = time.perf_counter()
        replies = await asyncio.gather(*(one_call(key) for key in keys))
        wall = time.perf_counter() - t0
        ChatCompletion.model_validate(replies[0])  # the openai package's own type parses it
        return wall

    figures: dict[str, list[float]] = {"direct_s": [], "gateway_s": []}
    try:
        await direct(), await through_gateway()  # warm-up
        for rep in range(sizes["reps"]):
            order = [("direct_s", direct), ("gateway_s", through_gateway)]
            for name, measure in order if rep % 2 == 0 else order[::-1]:
                figures[name].append(await measure())
            progress.note(f"agent overhead rep {rep + 1}: direct {figures['direct_s'][-1]:.3f} s, "
                          f"gateway {figures['gateway_s'][-1]:.3f} s")  # fmt: skip
    finally:
        await http.close()
        await gateway.stop()
        await runner.aclose()
    return figures


def measure_overhead(sizes: dict[str, Any], progress: Progress) -> dict[str, Any]:
    from fleetrl.models.chat_templates import TOOLS_TEMPLATE, set_chat_template
    from fleetrl.models.loading import load_tokenizer
    from fleetrl.models.tiny import make_tiny_model
    from rollout_fleet.engine.server import EmbeddedEngine

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(
            Path(tmp) / "model", layers=2, hidden=64, heads=4, max_positions=256
        )
        set_chat_template(model, TOOLS_TEMPLATE)
        engine = EmbeddedEngine(model, engine_id="e0", max_running_requests=64)
        engine.start_server()
        try:
            figures = asyncio.run(
                _overhead_rounds(engine.base_url, load_tokenizer(model), sizes, progress)
            )
        finally:
            engine.stop()
    per_round = [
        g / d - 1.0 for g, d in zip(figures["gateway_s"], figures["direct_s"], strict=True)
    ]
    calls = sizes["concurrency"]
    return {
        "direct_s_per_round": stats(figures["direct_s"]),
        "gateway_s_per_round": stats(figures["gateway_s"]),
        "overhead_per_round": stats(per_round),
        "gateway_overhead": median(per_round),
        "gateway_ms_per_call": 1000
        * (median(figures["gateway_s"]) - median(figures["direct_s"]))
        / calls,
    }


def measure_eta(sizes: dict[str, Any], out_dir: Path, progress: Progress) -> dict[str, Any]:
    """Episodes/s of the agent demo at η = 0 and η = 2 (the demo's data and model must exist)."""
    from bench.e2e import ELAPSED_KEYS, default_train_fn, first_number, train_once

    demo = out_dir / "agent_demo"  # data and warm-started model, built once per folder
    progress.note(f"building the agent demo's data and model in {demo} (once)")
    subprocess.run([sys.executable, str(DEMO_BUILD), "--out", str(demo)], check=True, cwd=REPO)
    train = default_train_fn()
    per_eta: dict[str, Any] = {}
    for eta in (0, 2):
        run_dir = out_dir / "agent_runs" / f"eta{eta}"
        overrides = [f"trainer.output_dir={run_dir}", f"trainer.total_steps={sizes['steps']}",
                     "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.resume=disable",
                     f"buffer.max_staleness={eta}", "logging.wandb=false",
                     f"model.path={demo / 'model'}", f"data.train_files=[{demo / 'data/train.parquet'}]",
                     f"data.val_files=[{demo / 'data/test.parquet'}]"]  # fmt: skip
        progress.note(f"agent demo at eta={eta}: {sizes['steps']} steps")
        _, rows = train_once(train, DEMO_CONFIG, overrides, run_dir)
        steps = [r for r in rows if "agent/episodes" in r and first_number(r, ELAPSED_KEYS)]
        start, end = steps[sizes["warmup_steps"]], steps[-1]
        episodes = end["agent/episodes"] - start["agent/episodes"]
        wall = first_number(end, ELAPSED_KEYS) - first_number(start, ELAPSED_KEYS)
        per_eta[f"eta{eta}"] = {"episodes": episodes, "wall_s": wall,
                                "episodes_per_s": episodes / wall if wall > 0 else None}  # fmt: skip
    return {**per_eta, "eta2_vs_eta0": ratio(per_eta["eta2"]["episodes_per_s"],
                                            per_eta["eta0"]["episodes_per_s"])}  # fmt: skip


def run(out_dir: str | Path, quick: bool = False, reps: int | None = None) -> dict[str, Any]:
    out = Path(out_dir)
    sizes = dict(QUICK if quick else FULL)
    if reps is not None:
        sizes["reps"] = reps
    progress = Progress(SUITE)
    started = time.time()
    overhead = measure_overhead(sizes, progress)
    throughput = measure_eta(sizes, out, progress)
    summary = {"gateway_overhead": overhead["gateway_overhead"],
               "gateway_ms_per_call": overhead["gateway_ms_per_call"],
               "eta2_vs_eta0": throughput["eta2_vs_eta0"]}  # fmt: skip
    record = suite_record(SUITE, config=sizes, results={"overhead": overhead, "eta": throughput},
                          summary=summary, wall_s=time.time() - started)  # fmt: skip
    write_json(suite_json_path(out, SUITE), record)
    return record
