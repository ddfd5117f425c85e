"""The SGLang stages: what only a machine with SGLang's CUDA engine proves.

They run in one process (they share one server) and report five results; the driver skips
them with one line where SGLang or a GPU is missing (``bench.gpu.plan.sglang_skip_reason``):
the GPU machine the check targets (one H200, no package registry) cannot have SGLang's
CUDA kernels.

- ``sglang_engine``: a random-init Qwen2-shaped folder (~0.45 B parameters) served by a real
  SGLang server started by ``rollout_fleet.sglang_launcher.SGLangServer`` (``--load-format
  auto``, bf16; on cuda:1 when there are two GPUs); ``/model_info`` reports version 0;
- ``sglang_logprobs``: ``/generate`` with ``return_logprob`` (greedy, and sampled at T=0.7)
  against the learner's forward (transformers on CUDA + ``learner.logits_ops.
  logprobs_from_logits`` at the same temperature; greedy logprobs are SGLang's T=1 ones);
  the largest difference must be within ``LOGPROB_TOL``;
- ``sglang_throughput``: output tokens/s of one timed ``/generate`` batch;
- ``sglang_weight_sync``: ``weight_sync.sender.WeightSender`` pushes a perturbed copy of the
  weights as version 1 (NCCL from cuda:0 to the server on cuda:1 with two GPUs, gloo with
  one); ``/model_info`` must say version 1 and greedy output must change and match the
  learner's forward of the new weights; GB/s of the bucketed path vs a raw broadcast of the
  same bytes between two helper processes vs ``load_format=per_tensor``;
- ``sglang_demo``: the demo stage's 5 steps with ``rollout.backend=sglang``.

Left out: multi-node, TP > 1 engines, any speed threshold (figures are for a person).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.gpu.report import StageResult, first_line
from bench.gpu.stage import CheckFailed, StageContext, StageSkipped, write_results

LOGPROB_TOL = 0.1  # bf16 engine kernels vs bf16 transformers forward
SAMPLE_TEMPERATURE = 0.7
PROMPTS = ["12+34=", "The cat sat on", "What is 7*8?", "abc abc abc"]
NEW_TOKENS = 16
SYNC_REPEATS = 3
PERTURB_SCALE = 0.2  # of each tensor's std: enough to move a random model's greedy output
MODEL = {"layers": 12, "hidden": 1536, "heads": 12}
SERVER_START_S = 150
HEADLINES = {
    "sglang_engine": ("url", "gpu", "weight_version"),
    "sglang_logprobs": ("greedy_max_abs_diff", "sampled_max_abs_diff", "tolerance"),
    "sglang_throughput": ("tokens_per_s", "batch", "tokens"),
    "sglang_weight_sync": ("backend", "bucket_gbps", "raw_broadcast_gbps", "per_tensor_gbps",
                           "bucket_vs_raw", "version_after_push"),
    "sglang_demo": ("steps", "step_s_median", "wall_s"),
}  # fmt: skip


def logprob_figures(engine: list[list[float]], learner: list[list[float]]) -> dict[str, float]:
    """Max and mean abs difference of per-token logprobs (lists per prompt, equal lengths)."""
    diffs = []
    for e_row, l_row in zip(engine, learner, strict=True):
        if len(e_row) != len(l_row):
            raise ValueError(f"engine gave {len(e_row)} logprobs, learner {len(l_row)}")
        diffs += [abs(a - b) for a, b in zip(e_row, l_row, strict=True)]
    if not diffs:
        raise ValueError("no tokens to compare")
    return {"max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / len(diffs),
            "tokens": len(diffs)}  # fmt: skip


def sync_figures(
    bucket_gbps: list[float], raw_gbps: list[float], per_tensor_gbps: list[float]
) -> dict[str, float | None]:
    """Median GB/s per path and the bucket path's ratios to the raw broadcast and per-tensor."""
    from bench.common import ratio

    def median(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    bucket, raw, per_tensor = median(bucket_gbps), median(raw_gbps), median(per_tensor_gbps)
    return {
        "bucket_gbps": bucket,
        "raw_broadcast_gbps": raw,
        "per_tensor_gbps": per_tensor,
        "bucket_vs_raw": ratio(bucket, raw),
        "bucket_vs_per_tensor": ratio(bucket, per_tensor),
    }


def check_pushed(version: str, changed: bool, max_abs_diff: float) -> None:
    """After pushing version 1: the server says 1, greedy output changed, and its logprobs match
    the learner's forward of the pushed weights."""
    if not (version == "1" and changed and max_abs_diff <= LOGPROB_TOL):
        raise CheckFailed(f"after the push: version {version}, output changed {changed}, "
                          f"logprob diff {max_abs_diff:.3g}")  # fmt: skip


def _post(url: str, route: str, body: dict[str, Any], timeout_s: float = 60.0) -> Any:
    import requests

    response = requests.post(f"{url}{route}", json=body, timeout=timeout_s)
    response.raise_for_status()
    return response.json()


def _get(url: str, route: str, timeout_s: float = 30.0) -> Any:
    import requests

    response = requests.get(f"{url}{route}", timeout=timeout_s)
    response.raise_for_status()
    return response.json()


def generate(url: str, prompt_ids: list[list[int]], temperature: float) -> list[dict]:
    """One batched /generate; per prompt: output token ids and their logprobs."""
    sampling = {"temperature": temperature, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    body = {"input_ids": prompt_ids, "sampling_params": sampling, "return_logprob": True}
    out = []
    for reply in _post(url, "/generate", body):
        triples = reply["meta_info"]["output_token_logprobs"]  # [logprob, token_id, text]
        out.append({"ids": [int(t[1]) for t in triples],
                    "logprobs": [float(t[0]) for t in triples]})  # fmt: skip
    return out


def learner_logprobs(model: Any, prompt_ids: list[int], output_ids: list[int],
                     temperature: float) -> list[float]:  # fmt: skip
    """The learner's logprobs of ``output_ids`` after ``prompt_ids`` (temperature as sampled)."""
    import torch

    from learner.logits_ops import logprobs_from_logits

    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + output_ids], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]
        labels = ids[0, len(prompt_ids) :]
        return logprobs_from_logits(logits, labels, temperature).float().cpu().tolist()


def compare_logprobs(url: str, model: Any, prompt_ids: list[list[int]],
                     temperature: float) -> dict[str, Any]:  # fmt: skip
    outputs = generate(url, prompt_ids, temperature)
    learner_t = 1.0 if temperature == 0 else temperature  # SGLang's greedy logprobs are T=1
    learner = [learner_logprobs(model, p, o["ids"], learner_t)
               for p, o in zip(prompt_ids, outputs, strict=True)]  # fmt: skip
    figures: dict[str, Any] = logprob_figures([o["logprobs"] for o in outputs], learner)
    figures["output_ids"] = [o["ids"] for o in outputs]
    return figures


def publish(url: str, named_tensors: list[tuple[str, Any]], version: int, *, backend: str,
            load_format: str, device: str) -> float:  # fmt: skip
    """Push one version through fleetrl's sender (the one place that knows its API); GB/s."""
    from weight_sync.config import WeightSyncConfig
    from weight_sync.sender import EngineEndpoint, WeightSender

    config = WeightSyncConfig(backend=backend, bucket_mb=256, pause_mode="in_place",
                              verify=False,  # the digest route is the embedded engine's
                              load_format=load_format, timeout_s=60)  # fmt: skip
    with WeightSender(config, master_address="127.0.0.1", device=device) as sender:
        sender.connect([EngineEndpoint("gpu-check", url, None, world_size=1)])
        return float(sender.publish(named_tensors, version).gbps)


def _raw_broadcast_rank(rank: int, port: int, backend: str, device: str, nbytes: int,
                        repeats: int, result_path: str) -> None:  # fmt: skip
    import torch
    import torch.distributed as dist

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    try:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dist.broadcast(buf, src=0)  # warm-up (connection setup)
        gbps = []
        for _ in range(repeats):
            torch.cuda.synchronize() if cuda else None
            dist.barrier()
            t0 = time.perf_counter()
            dist.broadcast(buf, src=0)
            torch.cuda.synchronize() if cuda else None
            gbps.append(nbytes / (time.perf_counter() - t0) / 1e9)
        if rank == 0:
            Path(result_path).write_text(json.dumps(gbps))
    finally:
        dist.destroy_process_group()


def raw_broadcast_gbps(nbytes: int, backend: str, devices: tuple[str, str], repeats: int,
                       work: Path) -> list[float]:  # fmt: skip
    """GB/s of a plain broadcast of ``nbytes`` between two helper processes (the line rate)."""
    from rollout_fleet.sglang_launcher import free_port

    spawn = mp.get_context("spawn")
    port, result = free_port(), work / "raw_broadcast.json"
    procs = [spawn.Process(target=_raw_broadcast_rank, args=(rank, port, backend, devices[rank],
                                                             nbytes, repeats, str(result)))
             for rank in (0, 1)]  # fmt: skip
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=90)
        if proc.is_alive():
            proc.kill()  # ours, by object
    if not result.is_file():
        raise RuntimeError(f"the raw {backend} broadcast between two processes reported nothing")
    return list(json.loads(result.read_text()))


class SGLangCheck:
    """The SGLang stages, sharing the model folder, the server and the learner's model."""

    def __init__(self, ctx: StageContext, gpus: int):
        self.ctx = ctx
        self.gpus = gpus
        self.server_gpu = 1 if gpus >= 2 else 0
        self.sync_backend = "nccl" if gpus >= 2 else "gloo"
        self.model_dir = ctx.work / "model"
        self.server: Any = None
        self.url = ""
        self.model: Any = None
        self.prompt_ids: list[list[int]] = []

    def engine(self, figures: dict[str, Any]) -> None:
        from fleetrl.models.loading import load_tokenizer
        from fleetrl.models.tiny import make_tiny_model
        from rollout_fleet.sglang_launcher import SGLangServer, SGLangServerSpec

        make_tiny_model(self.model_dir, seed=0, **MODEL)
        tokenizer = load_tokenizer(self.model_dir)
        self.prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
        spec = SGLangServerSpec(
            model_path=str(self.model_dir), load_format="auto", dtype="bfloat16",
            mem_fraction_static=0.3, base_gpu_id=self.server_gpu,
            disable_radix_cache=True,  # in_place pause (the weight_sync stage uses it)
            random_seed=0,
        )  # fmt: skip
        self.server = SGLangServer(spec, startup_timeout_s=SERVER_START_S, max_restarts=0,
                                   log_path=self.ctx.work / "sglang.log")  # fmt: skip
        self.url = self.server.start()
        figures.update(MODEL, url=self.url, gpu=self.server_gpu, weight_version=self.version())
        if figures["weight_version"] != "0":
            raise CheckFailed(f"a fresh server reports weight version {figures['weight_version']}")

    def version(self) -> str:
        return str(_get(self.url, "/model_info")["weight_version"])

    def learner_model(self, state: dict[str, Any] | None = None) -> Any:
        import torch

        from fleetrl.models.loading import load_causal_lm

        if self.model is None:
            self.model = load_causal_lm(self.model_dir, dtype="bfloat16").to("cuda:0").eval()
        if state is not None:
            with torch.no_grad():
                for name, param in self.model.named_parameters():
                    param.copy_(state[name])
        return self.model

    def logprobs(self, figures: dict[str, Any]) -> None:
        model = self.learner_model()
        greedy = compare_logprobs(self.url, model, self.prompt_ids, 0.0)
        sampled = compare_logprobs(self.url, model, self.prompt_ids, SAMPLE_TEMPERATURE)
        figures.update(greedy_max_abs_diff=greedy["max_abs_diff"],
                       sampled_max_abs_diff=sampled["max_abs_diff"],
                       sampled_temperature=SAMPLE_TEMPERATURE,
                       tokens=greedy["tokens"] + sampled["tokens"],
                       tolerance=LOGPROB_TOL)  # fmt: skip
        if max(greedy["max_abs_diff"], sampled["max_abs_diff"]) > LOGPROB_TOL:
            raise CheckFailed(f"engine and learner logprobs differ by more than {LOGPROB_TOL}")

    def throughput(self, figures: dict[str, Any]) -> None:
        batch, new_tokens = 64, 128
        prompts = [self.prompt_ids[i % len(self.prompt_ids)] for i in range(batch)]
        sampling = {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}
        body = {"input_ids": prompts, "sampling_params": sampling}
        _post(self.url, "/generate", {**body, "input_ids": prompts[:4]})  # warm-up
        t0 = time.perf_counter()
        replies = _post(self.url, "/generate", body, timeout_s=120)
        wall = time.perf_counter() - t0
        tokens = sum(int(r["meta_info"]["completion_tokens"]) for r in replies)
        figures.update(
            batch=batch, tokens=tokens, wall_s=round(wall, 3), tokens_per_s=tokens / wall
        )
        if tokens != batch * new_tokens:
            raise CheckFailed(f"{tokens} tokens generated, not {batch * new_tokens}")

    def weight_sync(self, figures: dict[str, Any]) -> None:
        import torch

        model = self.learner_model()
        torch.manual_seed(1)
        perturbed = {name: p.detach() + PERTURB_SCALE * torch.randn_like(p)
                     * p.detach().float().std().to(p.dtype)
                     for name, p in model.named_parameters()}  # fmt: skip
        tensors = list(perturbed.items())
        before = [o["ids"] for o in generate(self.url, self.prompt_ids, 0.0)]
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        push = dict(backend=self.sync_backend, device="cuda:0")
        bucket = [publish(self.url, tensors, 1, load_format="flattened_bucket", **push)]
        version = self.version()
        self.learner_model(perturbed)  # the learner's forward now holds version 1
        after = compare_logprobs(self.url, model, self.prompt_ids, 0.0)
        changed = after["output_ids"] != before
        bucket += [publish(self.url, tensors, 1, load_format="flattened_bucket", **push)
                   for _ in range(SYNC_REPEATS - 1)]  # fmt: skip
        per_tensor = [publish(self.url, tensors, 1, load_format="per_tensor", **push)
                      for _ in range(SYNC_REPEATS)]  # fmt: skip
        devices = ("cuda:0", "cuda:1") if self.gpus >= 2 else ("cuda:0", "cuda:0")
        raw = raw_broadcast_gbps(nbytes, self.sync_backend, devices, SYNC_REPEATS, self.ctx.work)
        figures.update(backend=self.sync_backend, bytes=nbytes, version_after_push=version,
                       greedy_output_changed=changed,
                       max_abs_diff_after_push=after["max_abs_diff"],
                       **sync_figures(bucket, raw, per_tensor))  # fmt: skip
        check_pushed(version, changed, after["max_abs_diff"])

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.model = None


def sub_stage(name: str, fn: Callable[[dict[str, Any]], None]) -> StageResult:
    """One of several stages sharing a process: ``fn(figures)``, its result, never raising."""
    result = StageResult(name, "ok")
    started = time.monotonic()
    try:
        fn(result.figures)
    except CheckFailed as err:
        result.status, result.why = "failed", first_line(str(err))
    except StageSkipped as err:
        result.status, result.why = "skipped", first_line(str(err))
    except Exception as err:  # one sub-stage's error is its result; the next ones still run
        result.status, result.why = "failed", f"{type(err).__name__}: {first_line(str(err))}"
    result.seconds = round(time.monotonic() - started, 2)
    return result


def server_stages(ctx: StageContext, server: str, stages: list[tuple[str, Any]]) -> list[StageResult]:  # fmt: skip
    """The first of ``stages`` (name, fn) starts the ``server``; the others run only if it did.
    Each result is written as it comes (a time-out keeps what finished)."""
    results: list[StageResult] = []
    for name, fn in stages:
        if results and results[0].status != "ok":
            results.append(StageResult(name, "skipped", f"the {server} server did not start"))
            continue
        results.append(sub_stage(name, fn))
        write_results(ctx.result_path, results)
    return results


def run(ctx: StageContext) -> list[StageResult]:
    import torch

    from bench.gpu.demo import train_demo

    check = SGLangCheck(ctx, torch.cuda.device_count())
    try:
        results = server_stages(ctx, "SGLang", [
            ("sglang_engine", check.engine), ("sglang_logprobs", check.logprobs),
            ("sglang_throughput", check.throughput), ("sglang_weight_sync", check.weight_sync),
        ])  # fmt: skip
    finally:
        check.close()
        torch.cuda.empty_cache()
    half = "1" if check.gpus >= 2 else "0.5"  # one GPU: learner and engine share it
    extra = ["rollout.backend=sglang", f"rollout.gpus_per_engine={half}",
             f"learner.gpus_per_rank={half}", "rollout.mem_fraction_static=0.3",
             "weight_sync.verify=false", f"weight_sync.backend={check.sync_backend}"]  # fmt: skip
    results.append(sub_stage(
        "sglang_demo",
        lambda figures: train_demo(ctx.work / "demo", "cuda", ctx.seconds_left(), extra, figures),
    ))  # fmt: skip
    return results
