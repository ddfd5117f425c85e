"""The vLLM stages: what only a machine with vLLM 0.34 and a GPU proves.

They run in one process (they share one server) and report four results; the driver skips
them with one line where vLLM or a GPU is missing (``bench.gpu.plan.vllm_skip_reason``).
The GPU machine the check targets (one H200, torch 2.11, no package registry) cannot have
vLLM 0.34, which pins torch 2.14: they run where a user installed fleetrl's ``vllm`` extra.

- ``vllm_engine``: a random-init Qwen2-shaped folder (~0.45 B parameters) served by a real
  ``vllm serve`` started by ``rollout_fleet.vllm_launcher.VllmServer`` on the command line
  fleetrl builds (``--load-format auto``, bf16, ``--gpu-memory-utilization 0.3``, on the
  second GPU when there are two); ``/weight_info`` reports version 0;
- ``vllm_logprobs``: samples through fleetrl's own client (``VllmEngineClient.
  generate_sample``: ``/v1/completions`` with token ids), greedy and at T=0.7, against the
  learner's forward (transformers + ``learner.logits_ops.logprobs_from_logits`` at the
  same temperature; greedy logprobs are T=1 ones); the largest difference must be within
  ``LOGPROB_TOL``: this is what ``--logprobs-mode processed_logprobs`` is for;
- ``vllm_throughput``: output tokens/s of one batch of concurrent samples through the client;
- ``vllm_weight_sync``: ``weight_sync.sender.WeightSender`` pushes a perturbed copy of the
  weights as version 1 through vLLM's weight-transfer routes, NCCL from cuda:0 to the
  server on cuda:1; ``/weight_info`` must say 1, and greedy output must change and match
  the learner's forward of the new weights. With one GPU it is skipped in one line: vLLM's
  workers receive over NCCL only, which refuses two ranks on one device.

On ``--device cpu`` with ``--vllm-server MODULE:FUNCTION`` (a function of the server's
``VllmServerSpec`` and a scratch folder returning something with ``url`` and ``stop()``),
the same code runs at tiny sizes against the server that function starts, the weight push
over gloo: the CPU proof (tests/e2e/test_gpu_check_cpu.py) runs it on vLLM's own app and
weight-transfer engine (tests/conformance/vllm/harness.py).

Left out: the demo on vLLM engines, TP > 1 engines, any speed threshold.
"""

from __future__ import annotations

import asyncio
import importlib
import secrets
import time
from pathlib import Path
from typing import Any

from bench.gpu.report import StageResult
from bench.gpu.sglang_stages import (
    LOGPROB_TOL,
    MODEL,
    NEW_TOKENS,
    PERTURB_SCALE,
    PROMPTS,
    SAMPLE_TEMPERATURE,
    check_pushed,
    learner_logprobs,
    logprob_figures,
    server_stages,
)
from bench.gpu.stage import CheckFailed, StageContext, StageSkipped

SERVER_START_S = 240
SIZES = {
    "cuda": {"model": MODEL, "batch": 64, "new_tokens": 128, "dtype": "bfloat16", "bucket_mb": 256},
    "cpu": {"model": {"layers": 2, "hidden": 64, "heads": 4}, "batch": 8, "new_tokens": 8,
            "dtype": "float32", "bucket_mb": 1},
}  # fmt: skip
HEADLINES = {
    "vllm_engine": ("url", "gpu", "weight_version"),
    "vllm_logprobs": ("greedy_max_abs_diff", "sampled_max_abs_diff", "tolerance"),
    "vllm_throughput": ("tokens_per_s", "batch", "tokens"),
    "vllm_weight_sync": ("backend", "gbps", "version_after_push", "greedy_output_changed"),
}
STAGE_NAMES = tuple(HEADLINES)


def start_vllm_serve(spec: Any, work: Path, gpu: int = 0) -> Any:
    """A real ``vllm serve`` of ``spec`` on GPU ``gpu`` (the default server of the stages)."""
    from rollout_fleet.vllm_launcher import VllmServer

    server = VllmServer(spec, startup_timeout_s=SERVER_START_S, max_restarts=0,
                        log_path=work / "vllm.log", env={"CUDA_VISIBLE_DEVICES": str(gpu)})  # fmt: skip
    server.start()
    return server


def server_factory(option: str) -> Any:
    """``MODULE:FUNCTION`` of ``--vllm-server`` -> the function (one line naming what is missing)."""
    module, _, function = option.partition(":")
    if not module or not function:
        raise CheckFailed(f"--vllm-server {option!r}: expected MODULE:FUNCTION")
    found = getattr(importlib.import_module(module), function, None)
    if found is None:
        raise CheckFailed(f"--vllm-server {option!r}: {module} has no {function}")
    return found


class VllmCheck:
    """The vLLM stages, sharing the model folder, the server and the learner's model."""

    def __init__(self, ctx: StageContext, gpus: int):
        self.ctx = ctx
        self.sizes = SIZES[ctx.device]
        self.server_gpu = 1 if gpus >= 2 else 0
        self.learner_device = "cuda:0" if ctx.cuda else "cpu"
        self.sync_backend = "nccl" if gpus >= 2 else ("gloo" if not ctx.cuda else "")
        self.model_dir = ctx.work / "model"
        self.key = secrets.token_hex(16)
        self.server: Any = None
        self.url = ""
        self.model: Any = None
        self.prompt_ids: list[list[int]] = []

    def engine(self, figures: dict[str, Any]) -> None:
        from fleetrl.models.loading import load_tokenizer
        from fleetrl.models.tiny import make_tiny_model
        from rollout_fleet.sglang_launcher import free_port
        from rollout_fleet.vllm_launcher import VllmServerSpec

        make_tiny_model(self.model_dir, seed=0, **self.sizes["model"])
        tokenizer = load_tokenizer(self.model_dir)
        self.prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
        spec = VllmServerSpec(
            model_path=str(self.model_dir), api_key=self.key, port=free_port(),
            load_format="auto", dtype=self.sizes["dtype"], gpu_memory_utilization=0.3,
            enable_prefix_caching=False,  # in_place pause (the weight_sync stage uses it)
            seed=0,
        )  # fmt: skip
        option = self.ctx.options.get("vllm_server")
        if option:
            self.server = server_factory(option)(spec, self.ctx.work)
        else:
            self.server = start_vllm_serve(spec, self.ctx.work, self.server_gpu)
        self.url = self.server.url
        figures.update(self.sizes["model"], url=self.url, gpu=self.server_gpu,
                       weight_version=self.run(lambda c: c.get_weight_version()))  # fmt: skip
        if figures["weight_version"] != "0":
            raise CheckFailed(f"a fresh server reports weight version {figures['weight_version']}")

    def run(self, call: Any) -> Any:
        """``call(client)`` on a fresh ``VllmEngineClient`` of the server (its own event loop)."""
        from rollout_fleet.vllm_client import VllmEngineClient

        async def once() -> Any:
            async with VllmEngineClient(self.url, api_key=self.key, timeout_s=300) as client:
                return await call(client)

        return asyncio.run(once())

    def sample(self, prompts: list[list[int]], temperature: float, new_tokens: int) -> list[Any]:
        params = {"temperature": temperature, "max_new_tokens": new_tokens, "ignore_eos": True}
        return self.run(lambda c: asyncio.gather(*(
            c.generate_sample(p, params, rid=f"check-{i}-{time.monotonic_ns()}")
            for i, p in enumerate(prompts)
        )))  # fmt: skip

    def learner_model(self, state: dict[str, Any] | None = None) -> Any:
        import torch

        from fleetrl.models.loading import load_causal_lm

        if self.model is None:
            model = load_causal_lm(self.model_dir, dtype=self.sizes["dtype"])
            self.model = model.to(self.learner_device).eval()
        if state is not None:
            with torch.no_grad():
                for name, param in self.model.named_parameters():
                    param.copy_(state[name])
        return self.model

    def compare(self, temperature: float) -> dict[str, Any]:
        outputs = self.sample(self.prompt_ids, temperature, NEW_TOKENS)
        learner_t = 1.0 if temperature == 0 else temperature  # greedy logprobs are T=1
        model = self.learner_model()
        learner = [learner_logprobs(model, p, o.output_ids, learner_t)
                   for p, o in zip(self.prompt_ids, outputs, strict=True)]  # fmt: skip
        figures: dict[str, Any] = logprob_figures([o.logprobs for o in outputs], learner)
        figures["output_ids"] = [o.output_ids for o in outputs]
        return figures

    def logprobs(self, figures: dict[str, Any]) -> None:
        greedy, sampled = self.compare(0.0), self.compare(SAMPLE_TEMPERATURE)
        figures.update(greedy_max_abs_diff=greedy["max_abs_diff"],
                       sampled_max_abs_diff=sampled["max_abs_diff"],
                       sampled_temperature=SAMPLE_TEMPERATURE,
                       tokens=greedy["tokens"] + sampled["tokens"], tolerance=LOGPROB_TOL)  # fmt: skip
        if max(greedy["max_abs_diff"], sampled["max_abs_diff"]) > LOGPROB_TOL:
            raise CheckFailed(f"engine and learner logprobs differ by more than {LOGPROB_TOL}")

    def throughput(self, figures: dict[str, Any]) -> None:
        batch, new_tokens = self.sizes["batch"], self.sizes["new_tokens"]
        prompts = [self.prompt_ids[i % len(self.prompt_ids)] for i in range(batch)]
        self.sample(prompts[:4], 1.0, new_tokens)  # warm-up
        t0 = time.perf_counter()
        outputs = self.sample(prompts, 1.0, new_tokens)
        wall = time.perf_counter() - t0
        tokens = sum(len(o.output_ids) for o in outputs)
        figures.update(batch=batch, tokens=tokens, wall_s=round(wall, 3), tokens_per_s=tokens / wall)  # fmt: skip
        if tokens != batch * new_tokens:
            raise CheckFailed(f"{tokens} tokens generated, not {batch * new_tokens}")

    def weight_sync(self, figures: dict[str, Any]) -> None:
        import torch

        from weight_sync.config import WeightSyncConfig
        from weight_sync.sender import EngineEndpoint, WeightSender

        if not self.sync_backend:
            raise StageSkipped("vLLM's workers receive weights over NCCL only, which needs the "
                               "learner and the engine on two GPUs; this machine has one")  # fmt: skip
        model = self.learner_model()
        torch.manual_seed(1)
        perturbed = {name: p.detach() + PERTURB_SCALE * torch.randn_like(p)
                     * p.detach().float().std().to(p.dtype)
                     for name, p in model.named_parameters()}  # fmt: skip
        before = [o.output_ids for o in self.sample(self.prompt_ids, 0.0, NEW_TOKENS)]
        config = WeightSyncConfig(backend=self.sync_backend, bucket_mb=self.sizes["bucket_mb"],
                                  pause_mode="in_place", timeout_s=120)  # fmt: skip
        endpoint = EngineEndpoint("gpu-check", self.url, self.key, world_size=1, api="vllm")
        with WeightSender(config, master_address="127.0.0.1", device=self.learner_device) as sender:  # fmt: skip
            sender.connect([endpoint])
            metrics = sender.publish(list(perturbed.items()), 1, verify=True)
        version = self.run(lambda c: c.get_weight_version())
        self.learner_model(perturbed)  # the learner's forward now holds version 1
        after = self.compare(0.0)
        changed = after["output_ids"] != before
        figures.update(backend=self.sync_backend, bytes=metrics.bytes, gbps=metrics.gbps,
                       buckets=metrics.num_buckets, version_after_push=version,
                       greedy_output_changed=changed,
                       max_abs_diff_after_push=after["max_abs_diff"])  # fmt: skip
        check_pushed(version, changed, after["max_abs_diff"])

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.model = None


def run(ctx: StageContext) -> list[StageResult]:
    import torch

    check = VllmCheck(ctx, torch.cuda.device_count() if ctx.cuda else 0)
    try:
        return server_stages(ctx, "vLLM", [
            ("vllm_engine", check.engine), ("vllm_logprobs", check.logprobs),
            ("vllm_throughput", check.throughput), ("vllm_weight_sync", check.weight_sync),
        ])  # fmt: skip
    finally:
        check.close()
        if ctx.cuda:
            torch.cuda.empty_cache()
