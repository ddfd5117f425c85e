"""A real vLLM 0.34 HTTP server on CPU in which only the engine's token loop is ours.

Run as ``python -m tests.conformance.vllm.harness READY_FILE -- <vllm serve argv>`` with
``.venv/vllm-overlay`` first on ``PYTHONPATH`` (``launch.py`` does it). The argv is the one
fleetrl's launcher builds (``rollout_fleet.vllm_launcher.build_command``), parsed by vLLM's
own ``serve`` parser and checked by ``validate_parsed_serve_args``:

    test ──HTTP──> vLLM's FastAPI app (build_app: dev-mode RL routes, fleetrl's
                   --middleware), its OpenAIServingCompletion etc. (init_app_state), over
                   HarnessEngine: vLLM's EngineClient interface, generate() ours
                     │ pipes (collective_rpc of a real AsyncLLM)
            ┌────────┴────────┐
       [TP rank 0]       [TP rank 1]    vLLM's NCCLWeightTransferEngine: its init-info and
        next token                       update-info dataclasses, StatelessProcessGroup
                                         rendezvous, packed-chunk receive; gloo where its
                                         PyNcclCommunicator would run (no NCCL on a CPU)

Where it differs from a real vLLM server (none of it is in the protocol): the token loop is
a greedy step of a Hugging Face model on TP rank 0 (each rank holds a full copy), the pause
state machine is the engine core's in miniature, weight-version spans are built as vLLM's
``OutputProcessor.track_weight_version`` builds them, and ``load_weights`` copies by name
(``start_reload``/``finish_reload``, vLLM's layerwise reload inside a worker, are skipped).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from vllm.engine.protocol import EngineClient  # noqa: E402  (after the device is chosen)


def _cpu_stand_ins() -> None:
    """What a CPU lacks for vLLM's receive path: NCCL (gloo instead), CUDA streams (none)."""
    import torch
    import vllm.distributed.device_communicators.pynccl as pynccl
    import vllm.distributed.weight_transfer.nccl_common as nccl_common
    import vllm.distributed.weight_transfer.packed_tensor as packed_tensor

    from weight_sync.vllm_group import gloo_group

    class GlooCommunicator:
        """PyNcclCommunicator's surface over gloo on the StatelessProcessGroup's store."""

        disabled = False

        def __init__(self, group: Any, device: Any = None) -> None:
            self.rank, self.world_size, self.device = (
                group.rank,
                group.world_size,
                torch.device("cpu"),
            )
            self._pg = gloo_group(group.store, group.rank, group.world_size, 120.0)

        def broadcast(self, tensor: Any, src: int, stream: Any = None) -> None:
            import torch.distributed as dist

            opts = dist.BroadcastOptions()
            opts.rootRank = src
            self._pg.broadcast([tensor], opts).wait()

        def destroy(self) -> None:
            self._pg = None

    class NoStream:
        def synchronize(self) -> None: ...

        def wait_event(self, event: Any) -> None: ...

    class NoEvent:
        def record(self, stream: Any = None) -> None: ...

        def synchronize(self) -> None: ...

    pynccl.PyNcclCommunicator = GlooCommunicator
    nccl_common.unpinned_nccl_env = contextlib.nullcontext
    packed_tensor._get_streams = lambda index, n: tuple(NoStream() for _ in range(n))
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *a, **k: NoStream()
    torch.accelerator.current_device_index = lambda: 0
    torch.accelerator.current_stream = lambda *a, **k: NoStream()
    torch.accelerator.synchronize = lambda *a, **k: None
    torch.accelerator.empty_cache = lambda: None
    torch.Event = NoEvent
    torch.Tensor.record_stream = lambda self, stream: None


def rank_main(conn: Any, vllm_config: Any, tp_rank: int, model_dir: str) -> None:
    """One TP rank: vLLM's NCCLWeightTransferEngine over a full copy of the model."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    _cpu_stand_ins()
    torch.set_num_threads(1)
    vllm_config.parallel_config.rank = tp_rank
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = dict(model.named_parameters())

    def load_weights(weights: Any) -> None:
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)

    model.load_weights = load_weights
    engine = NCCLWeightTransferEngine(
        WeightTransferConfig(backend="nccl"), vllm_config, torch.device("cpu"), model
    )
    in_update = False
    while True:
        op, arg = conn.recv()
        try:
            if op == "init_weight_transfer_engine":
                reply: Any = engine.init_transfer_engine(engine.parse_init_info(arg))
            elif op == "start_weight_update":
                if in_update:
                    raise RuntimeError("a weight update is already active")
                in_update, reply = True, None
            elif op == "update_weights":
                if not in_update:
                    raise RuntimeError("start_weight_update must be called before update_weights.")
                reply = engine.receive_weights(engine.parse_update_info(arg))
            elif op == "finish_weight_update":
                if not in_update:
                    raise RuntimeError("finish_weight_update called without a matching start_weight_update.")  # fmt: skip
                in_update, reply = False, None
            elif op == "shutdown_weight_transfer_engine":
                reply = engine.shutdown()
            elif op == "weights":
                reply = {n: p.detach().clone() for n, p in params.items()}
            elif op == "step":
                ids, temperature = arg
                with torch.no_grad():
                    logits = model(torch.tensor([ids])).logits[0, -1].float()
                if vllm_config.model_config.logprobs_mode == "processed_logprobs":
                    logits = logits / (temperature or 1.0)  # greedy: T = 1, as vLLM's
                logprobs = torch.log_softmax(logits, -1)
                token = int(torch.argmax(logprobs))
                reply = (token, float(logprobs[token]))
            elif op == "stop":
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown op {op}")
            conn.send(("ok", reply))
        except Exception as err:  # the reply carries the worker's error to the HTTP side
            conn.send(("error", f"{type(err).__name__}: {err}"))


class HarnessEngine(EngineClient):
    """vLLM's ``EngineClient`` interface: control calls go to the ranks as collective RPCs."""

    def __init__(self, vllm_config: Any, conns: list[Any]) -> None:
        from vllm.renderers import renderer_from_config
        from vllm.v1.engine.input_processor import InputProcessor

        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer_from_config(vllm_config)
        self.input_processor = InputProcessor(vllm_config, self.renderer)
        self.conns = conns
        self.weight_version = "default"
        self.pause_mode: str | None = None
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.aborted: set[str] = set()
        self.running: set[str] = set()
        self.sleep_calls: list[Any] = []
        self.loras: dict[str, str] = {}
        self.log: list[str] = []  # every engine call, in order (GET /harness/log)
        # the tests' gate: with hold_after set, a request stops after that many output tokens
        # (listed in ``held``) until POST /harness/release; lets a test act mid-sequence
        self.hold_after: int | None = None
        self.held: set[str] = set()
        self.released = asyncio.Event()
        self._rpc_lock = asyncio.Lock()

    # -- the ranks ------------------------------------------------------------------------
    async def collective_rpc(self, method: str, timeout: Any = None, args: tuple = (), kwargs: Any = None) -> list[Any]:  # fmt: skip
        arg = next(iter((kwargs or {}).values()), args[0] if args else None)
        async with self._rpc_lock:
            return await asyncio.to_thread(self._rpc, method, arg)

    def _rpc(self, method: str, arg: Any) -> list[Any]:
        for conn in self.conns:
            conn.send((method, arg))
        replies = [conn.recv() for conn in self.conns]
        errors = [r[1] for r in replies if r[0] == "error"]
        if errors:
            raise RuntimeError(errors[0])
        return [r[1] for r in replies]

    def _step(self, step: tuple[list[int], float]) -> tuple[int, float]:
        """The next token and its logprob, from TP rank 0."""
        self.conns[0].send(("step", step))
        status, reply = self.conns[0].recv()
        if status == "error":
            raise RuntimeError(reply)
        return reply

    # -- generation -----------------------------------------------------------------------
    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, **kw: Any):
        from vllm.logprobs import Logprob
        from vllm.outputs import CompletionOutput, RequestOutput, WeightVersionSpan

        self.log.append(f"generate {request_id}")
        if self.pause_mode in ("abort", "wait"):  # the engine core's _reject_add_while_paused
            from vllm.exceptions import RetryableRequestError

            self.log.append(f"rejected {request_id}")
            raise RetryableRequestError("Generation is paused. Please retry after it resumes.")
        ids = list(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else list(prompt.prompt_token_ids)  # fmt: skip
        out_ids: list[int] = []
        logprobs: list[dict[int, Any]] = []
        starts: list[tuple[str, int]] = []
        finish = "length"
        self.running.add(request_id)
        try:
            while len(out_ids) < sampling_params.max_tokens:
                if request_id not in self.aborted:
                    await self.resumed.wait()  # a kept request waits out the pause
                if request_id in self.aborted:
                    finish = "abort"
                    break
                version = self.weight_version
                async with self._rpc_lock:
                    step = (ids + out_ids, sampling_params.temperature)
                    token, logprob = await asyncio.to_thread(self._step, step)
                if request_id in self.aborted:
                    finish = "abort"
                    break
                if not starts or starts[-1][0] != version:  # track_weight_version's rule
                    starts.append((version, len(out_ids)))
                out_ids.append(token)
                logprobs.append({token: Logprob(logprob=logprob, rank=1)})
                if token in (sampling_params.stop_token_ids or []):
                    finish = "stop"
                    break
                if len(out_ids) == self.hold_after:
                    self.held.add(request_id)
                    await self.released.wait()
                    self.held.discard(request_id)
                await asyncio.sleep(0)
        finally:
            self.running.discard(request_id)
        ends = [s for _, s in starts[1:]] + [len(out_ids)]
        spans = [WeightVersionSpan(v, s, e) for (v, s), e in zip(starts, ends, strict=True)]
        output = CompletionOutput(
            index=0, text="", token_ids=out_ids, cumulative_logprob=None,
            logprobs=logprobs if sampling_params.logprobs is not None else None,
            finish_reason=finish, weight_versions=spans or None,
        )  # fmt: skip
        yield RequestOutput(request_id, None, ids, None, [output], finished=True)

    async def abort(self, request_id: Any, internal: bool = False) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.log.append(f"abort {sorted(ids)}")
        self.aborted.update(ids)

    # -- the RL routes' engine calls --------------------------------------------------------
    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.log.append(f"pause {mode}")
        if mode == "abort":
            self.aborted.update(self.running)
        self.pause_mode = mode
        self.resumed.clear()

    async def resume_generation(self) -> None:
        self.log.append("resume")
        self.pause_mode = None
        self.resumed.set()

    async def is_paused(self) -> bool:
        return self.pause_mode is not None

    async def init_weight_transfer_engine(self, request: Any) -> None:
        self.log.append("init_weight_transfer_engine")
        await self.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": request.init_info})  # fmt: skip

    async def shutdown_weight_transfer_engine(self) -> None:
        self.log.append("shutdown_weight_transfer_engine")
        await self.collective_rpc("shutdown_weight_transfer_engine")

    async def start_weight_update(self) -> None:
        self.log.append("start_weight_update")
        await self.collective_rpc("start_weight_update")

    async def update_weights(self, request: Any) -> None:
        self.log.append("update_weights")
        await self.collective_rpc("update_weights", kwargs={"update_info": request.update_info})

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.log.append(f"finish_weight_update {weight_version}")
        await self.collective_rpc("finish_weight_update")
        if weight_version is not None:
            await self.update_weight_version(weight_version)

    async def update_weight_version(self, new_version: str) -> None:
        self.weight_version = new_version

    async def get_weight_version(self) -> str:
        return self.weight_version

    async def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        self.log.append("reset_prefix_cache")
        return True

    async def sleep(self, level: int = 1, mode: str = "abort", reset_connector: bool = True) -> None:  # fmt: skip
        self.sleep_calls.append(["sleep", level, mode])
        self.log.append(f"sleep {level}")

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        self.sleep_calls.append(["wake_up", tags])
        self.log.append(f"wake_up {tags}")
        return True

    async def is_sleeping(self) -> bool:
        return bool(self.sleep_calls) and self.sleep_calls[-1][0] == "sleep"

    async def add_lora(self, lora_request: Any) -> bool:
        self.loras[lora_request.lora_name] = lora_request.lora_path
        self.log.append(f"add_lora {lora_request.lora_name}")
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.log.append("remove_lora")
        return True

    async def list_loras(self) -> set[int]:
        return set()

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    async def check_health(self) -> None: ...

    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None: ...

    is_running, is_stopped, errored, dead_error = True, False, False, RuntimeError("dead")
    should_keep_api_server_alive = False

    def shutdown(self, timeout: Any = None) -> None: ...

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a generate-only engine")

    async def notify_kv_transfer_request_rejected(self, *args: Any, **kwargs: Any) -> None: ...

    async def start_profile(self, *args: Any, **kwargs: Any) -> None: ...

    async def stop_profile(self) -> None: ...

    async def reset_mm_cache(self) -> None: ...

    async def reset_encoder_cache(self) -> None: ...

    async def release_kv_cache_memory(self, reset_connector: bool = True) -> None:
        self.sleep_calls.append(["release_kv_cache_memory"])

    async def checkpoint_prepare(self, mode: Any = "wait") -> None: ...

    async def checkpoint_restore(self) -> None: ...

    async def checkpoint_state(self) -> Any:
        raise NotImplementedError


def _add_harness_routes(app: Any, engine: HarnessEngine) -> None:
    """What the tests read out (the engine's call log, each rank's weights) and the gate."""
    from fastapi.responses import JSONResponse

    @app.get("/harness/log")
    async def harness_log() -> JSONResponse:
        return JSONResponse({"log": engine.log, "sleep": engine.sleep_calls, "loras": engine.loras,
                             "logprobs_mode": engine.model_config.logprobs_mode})  # fmt: skip

    @app.post("/harness/hold")
    async def harness_hold(after: int) -> JSONResponse:
        engine.hold_after = after
        engine.released.clear()
        return JSONResponse({"hold_after": after})

    @app.get("/harness/held")
    async def harness_held() -> JSONResponse:
        return JSONResponse({"held": sorted(engine.held)})

    @app.post("/harness/release")
    async def harness_release() -> JSONResponse:
        engine.hold_after = None
        engine.released.set()
        return JSONResponse({"released": sorted(engine.held)})

    @app.get("/harness/weights")
    async def harness_weights() -> JSONResponse:
        ranks = await engine.collective_rpc("weights")
        return JSONResponse([{n: t.flatten().tolist() for n, t in r.items()} for r in ranks])


def main() -> None:
    ready_file, argv = sys.argv[1], sys.argv[sys.argv.index("--") + 1 :]
    import vllm.triton_utils

    vllm.triton_utils.HAS_TRITON = True  # building VllmConfig on a CPU asks for triton-cpu
    import uvicorn
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.common.cli_args import validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(argv)
    args.model = args.model_tag or args.model
    validate_parsed_serve_args(args)
    vllm_config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    tp = vllm_config.parallel_config.tensor_parallel_size
    ctx = mp.get_context("fork")  # before any thread: the ranks inherit vLLM imported
    conns, procs = [], []
    for rank in range(tp):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=rank_main, args=(child, vllm_config, rank, args.model), daemon=True)  # fmt: skip
        proc.start()
        conns.append(parent)
        procs.append(proc.pid)

    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app

    app = build_app(args, supported_tasks=("generate",), model_config=vllm_config.model_config)
    engine = HarnessEngine(vllm_config, conns)
    _add_harness_routes(app, engine)

    async def serve() -> None:
        await init_app_state(engine, app.state, args, supported_tasks=("generate",))
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
        server = uvicorn.Server(config)
        Path(ready_file).write_text(json.dumps({"pids": procs}))
        await server.serve()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
