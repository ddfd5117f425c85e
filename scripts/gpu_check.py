"""`make gpu-check`: what a GPU machine proves in minutes that the CPU tiers cannot.

    make gpu-check                       # installs the sglang extra, then runs this
    .venv/bin/python scripts/gpu_check.py [--out runs/gpu_check] [--demo-backend embedded]

Stages (each time-boxed; a failed stage is recorded and the next one runs):
  model      a random-init Qwen2-shaped folder from fleetrl's tiny-model builder, large
             enough (~0.45 B parameters) that weight-sync figures mean something;
  engine     a real SGLang server started by ``rollout_fleet.sglang_launcher.SGLangServer``
             (``--load-format auto``, bf16; on cuda:1 when there are two GPUs);
  logprobs   ``/generate`` with ``return_logprob`` (greedy, and sampled at T=0.7) against
             the learner's forward (transformers on CUDA + ``learner.logits_ops.
             logprobs_from_logits`` at the same temperature; greedy logprobs are SGLang's
             T=1 ones); max abs diff;
  throughput engine tokens/s from one timed ``/generate`` batch;
  weight_sync ``weight_sync.sender.WeightSender`` pushes a perturbed copy of the weights
             as version 1 (NCCL learner cuda:0 -> server cuda:1 with two GPUs, gloo with
             one); ``/model_info`` must report version 1, greedy output must change and
             match the learner's forward of the perturbed weights; GB/s of the flattened
             bucket path vs a raw broadcast of the same bytes (two helper processes) vs
             ``load_format=per_tensor`` (one broadcast per parameter);
  demo       5 GRPO steps of configs/demo_cpu.yaml with the learner on CUDA in bf16 and
             SGLang engines (``--demo-backend embedded`` for the embedded engine).

Writes ``<out>/gpu_check.json`` (every stage: ok, seconds, figures, error) and prints a
table. Exit status: 0 all passed, 1 a stage failed, 2 no CUDA device (one line).
Left out: multi-node, TP > 1 engines, and any speed threshold (figures are for a person).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LOGPROB_TOL = 0.1  # bf16 engine kernels vs bf16 transformers forward
SAMPLE_TEMPERATURE = 0.7
PROMPTS = ["12+34=", "The cat sat on", "What is 7*8?", "abc abc abc"]
NEW_TOKENS = 16
SYNC_REPEATS = 3
PERTURB_SCALE = 0.2  # of each tensor's std: enough to move a random model's greedy output
STAGE_LIMITS_S = {
    "model": 60,
    "engine": 120,
    "logprobs": 45,
    "throughput": 45,
    "weight_sync": 120,
    "demo": 240,
}


# ---------------------------------------------------------------- results and report


@dataclass
class StageResult:
    name: str
    ok: bool = False
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


class StageTimeout(Exception):
    pass


@contextlib.contextmanager
def time_box(seconds: float) -> Iterator[None]:
    """Raise StageTimeout in the main thread after ``seconds`` (between Python bytecodes)."""

    def _expire(_signum: int, _frame: Any) -> None:
        raise StageTimeout(f"over its {seconds:.0f} s limit")

    previous = signal.signal(signal.SIGALRM, _expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_stage(
    name: str, fn: Callable[[dict[str, Any]], bool], limit_s: float, results: list[StageResult]
) -> StageResult:
    """Run ``fn(figures)`` (True = pass) under a time box; record its result, never raise."""
    result = StageResult(name)
    started = time.perf_counter()
    try:
        with time_box(limit_s):
            result.ok = bool(fn(result.figures))
    except Exception as err:  # a failed stage (StageTimeout too) is recorded; the next one runs
        result.error = f"{type(err).__name__}: {err}".splitlines()[0][:500]
    result.seconds = round(time.perf_counter() - started, 2)
    results.append(result)
    print(f"[gpu-check] {name}: {'pass' if result.ok else 'FAIL'} ({result.seconds:.1f} s)"
          + (f" {result.error}" if result.error else ""), flush=True)  # fmt: skip
    return result


def logprob_figures(engine: list[list[float]], learner: list[list[float]]) -> dict[str, float]:
    """Max and mean abs difference of per-token logprobs (lists per prompt, equal lengths)."""
    diffs = []
    for e_row, l_row in zip(engine, learner, strict=True):
        if len(e_row) != len(l_row):
            raise ValueError(f"engine gave {len(e_row)} logprobs, learner {len(l_row)}")
        diffs += [abs(a - b) for a, b in zip(e_row, l_row, strict=True)]
    if not diffs:
        raise ValueError("no tokens to compare")
    return {
        "max_abs_diff": max(diffs),
        "mean_abs_diff": sum(diffs) / len(diffs),
        "tokens": len(diffs),
    }


def sync_figures(
    bucket_gbps: list[float], raw_gbps: list[float], per_tensor_gbps: list[float]
) -> dict[str, float | None]:
    """Median GB/s per path and the bucket path's ratios to the raw broadcast and per-tensor."""

    def median(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    bucket, raw, per_tensor = median(bucket_gbps), median(raw_gbps), median(per_tensor_gbps)
    return {
        "bucket_gbps": bucket,
        "raw_broadcast_gbps": raw,
        "per_tensor_gbps": per_tensor,
        "bucket_vs_raw": ratio(bucket, raw),
        "bucket_vs_per_tensor": ratio(bucket, per_tensor),
    }


def demo_figures(metrics_lines: list[str]) -> dict[str, Any]:
    """Steps, policy losses and per-step seconds from a run's metrics.jsonl lines."""
    records = [json.loads(line) for line in metrics_lines if line.strip()]
    steps = [r for r in records if "actor/pg_loss" in r]
    return {
        "steps": len(steps),
        "pg_losses": [r["actor/pg_loss"] for r in steps],
        "step_s": [round(r.get("timing_s/step", float("nan")), 3) for r in steps],
    }


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return (
            "[" + ", ".join(_fmt(v) for v in value[:8]) + (", ..." if len(value) > 8 else "") + "]"
        )
    return str(value)


def render_table(results: list[StageResult]) -> str:
    """A short fixed-width table: stage, pass/fail, seconds, figures or the error."""
    lines = [f"{'stage':<12} {'result':<6} {'seconds':>8}  figures"]
    for r in results:
        detail = r.error or ", ".join(f"{k}={_fmt(v)}" for k, v in r.figures.items())
        lines.append(f"{r.name:<12} {'pass' if r.ok else 'FAIL':<6} {r.seconds:>8.1f}  {detail}")
    return "\n".join(lines)


def write_report(out: Path, results: list[StageResult], machine: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu_check.json"
    report = {
        "ok": all(r.ok for r in results),
        "machine": machine,
        "stages": [asdict(r) for r in results],
    }
    path.write_text(json.dumps(report, indent=2, default=str))
    return path


# ---------------------------------------------------------------- the engine and the learner


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
    replies = _post(
        url,
        "/generate",
        {"input_ids": prompt_ids, "sampling_params": sampling, "return_logprob": True},
    )
    out = []
    for reply in replies:
        triples = reply["meta_info"]["output_token_logprobs"]  # [logprob, token_id, text]
        out.append(
            {"ids": [int(t[1]) for t in triples], "logprobs": [float(t[0]) for t in triples]}
        )
    return out


def learner_logprobs(
    model: Any, prompt_ids: list[int], output_ids: list[int], temperature: float
) -> list[float]:
    """The learner's logprobs of ``output_ids`` after ``prompt_ids`` (temperature as sampled)."""
    import torch

    from learner.logits_ops import logprobs_from_logits

    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + output_ids], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]
        labels = ids[0, len(prompt_ids) :]
        return logprobs_from_logits(logits, labels, temperature).float().cpu().tolist()


def compare_logprobs(
    url: str, model: Any, prompt_ids: list[list[int]], temperature: float
) -> dict[str, Any]:
    outputs = generate(url, prompt_ids, temperature)
    # SGLang returns T=1 logprobs for greedy requests, logits/T ones otherwise
    learner_t = 1.0 if temperature == 0 else temperature
    learner = [
        learner_logprobs(model, p, o["ids"], learner_t)
        for p, o in zip(prompt_ids, outputs, strict=True)
    ]
    figures = logprob_figures([o["logprobs"] for o in outputs], learner)
    figures["output_ids"] = [o["ids"] for o in outputs]
    return figures


# ---------------------------------------------------------------- weight sync


def publish(
    url: str,
    named_tensors: list[tuple[str, Any]],
    version: int,
    *,
    backend: str,
    load_format: str,
    device: str,
) -> float:
    """Push one version through fleetrl's sender (the one place that knows its API); GB/s."""
    from weight_sync.config import WeightSyncConfig
    from weight_sync.sender import EngineEndpoint, WeightSender

    config = WeightSyncConfig(
        backend=backend,
        bucket_mb=256,
        pause_mode="in_place",
        verify=False,  # the digest route is the embedded engine's; SGLang has none
        load_format=load_format,
        timeout_s=60,
    )
    with WeightSender(config, master_address="127.0.0.1", device=device) as sender:
        sender.connect([EngineEndpoint("gpu-check", url, None, world_size=1)])
        metrics = sender.publish(named_tensors, version)
    return float(metrics.gbps)


def _raw_broadcast_rank(
    rank: int, port: int, backend: str, device: str, nbytes: int, repeats: int, queue: Any
) -> None:
    import torch
    import torch.distributed as dist

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dist.broadcast(buf, src=0)  # warm-up (connection setup)
        gbps = []
        for _ in range(repeats):
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            dist.broadcast(buf, src=0)
            sync()
            gbps.append(nbytes / (time.perf_counter() - t0) / 1e9)
        if rank == 0:
            queue.put(gbps)
    finally:
        dist.destroy_process_group()


def raw_broadcast_gbps(
    nbytes: int, backend: str, devices: tuple[str, str], repeats: int
) -> list[float]:
    """GB/s of a plain broadcast of ``nbytes`` between two helper processes (the line rate)."""
    from rollout_fleet.sglang_launcher import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_raw_broadcast_rank,
            args=(rank, port, backend, devices[rank], nbytes, repeats, queue),
        )
        for rank in (0, 1)
    ]
    for proc in procs:
        proc.start()
    try:
        return list(queue.get(timeout=90))
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()  # ours, by object


# ---------------------------------------------------------------- the check


class Check:
    """The stages, sharing the model folder, the server and the learner's model."""

    def __init__(self, args: argparse.Namespace, gpus: int):
        self.args = args
        self.out = Path(args.out)
        self.gpus = gpus
        self.learner_device = "cuda:0"
        self.server_gpu = 1 if gpus >= 2 else 0
        self.sync_backend = "nccl" if gpus >= 2 else "gloo"
        self.model_dir = self.out / "model"
        self.server: Any = None
        self.url = ""
        self.model: Any = None
        self.prompt_ids: list[list[int]] = []

    def build_model(self, figures: dict[str, Any]) -> bool:
        from fleetrl.models.loading import load_tokenizer
        from fleetrl.models.tiny import make_tiny_model

        a = self.args
        make_tiny_model(self.model_dir, layers=a.layers, hidden=a.hidden, heads=a.heads, seed=0)
        tokenizer = load_tokenizer(self.model_dir)
        self.prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
        figures.update(layers=a.layers, hidden=a.hidden, path=str(self.model_dir))
        return True

    def start_engine(self, figures: dict[str, Any]) -> bool:
        from rollout_fleet.sglang_launcher import SGLangServer, SGLangServerSpec

        spec = SGLangServerSpec(
            model_path=str(self.model_dir),
            load_format="auto",
            dtype="bfloat16",
            mem_fraction_static=0.3,
            base_gpu_id=self.server_gpu,
            disable_radix_cache=True,  # in_place pause (the weight_sync stage uses it)
            random_seed=0,
        )
        self.server = SGLangServer(
            spec, startup_timeout_s=STAGE_LIMITS_S["engine"] - 10, max_restarts=0,
            log_path=self.out / "sglang.log",
        )  # fmt: skip
        self.url = self.server.start()
        figures.update(url=self.url, gpu=self.server_gpu, weight_version=self.weight_version())
        return figures["weight_version"] == "0"

    def weight_version(self) -> str:
        return str(_get(self.url, "/model_info")["weight_version"])

    def load_learner_model(self, state: dict[str, Any] | None = None) -> Any:
        import torch

        from fleetrl.models.loading import load_causal_lm

        if self.model is None:
            self.model = load_causal_lm(self.model_dir, dtype="bfloat16").to(self.learner_device)
            self.model.eval()
        if state is not None:
            with torch.no_grad():
                for name, param in self.model.named_parameters():
                    param.copy_(state[name])
        return self.model

    def check_logprobs(self, figures: dict[str, Any]) -> bool:
        model = self.load_learner_model()
        greedy = compare_logprobs(self.url, model, self.prompt_ids, 0.0)
        sampled = compare_logprobs(self.url, model, self.prompt_ids, SAMPLE_TEMPERATURE)
        figures.update(
            greedy_max_abs_diff=greedy["max_abs_diff"],
            sampled_max_abs_diff=sampled["max_abs_diff"],
            sampled_temperature=SAMPLE_TEMPERATURE,
            tokens=greedy["tokens"] + sampled["tokens"],
            tolerance=LOGPROB_TOL,
        )
        return max(greedy["max_abs_diff"], sampled["max_abs_diff"]) <= LOGPROB_TOL

    def check_throughput(self, figures: dict[str, Any]) -> bool:
        batch, new_tokens = 64, 128
        prompts = [self.prompt_ids[i % len(self.prompt_ids)] for i in range(batch)]
        body = {
            "input_ids": prompts,
            "sampling_params": {
                "temperature": 1.0,
                "max_new_tokens": new_tokens,
                "ignore_eos": True,
            },
        }
        _post(self.url, "/generate", {**body, "input_ids": prompts[:4]})  # warm-up
        t0 = time.perf_counter()
        replies = _post(self.url, "/generate", body, timeout_s=STAGE_LIMITS_S["throughput"])
        wall = time.perf_counter() - t0
        tokens = sum(int(r["meta_info"]["completion_tokens"]) for r in replies)
        figures.update(
            batch=batch, tokens=tokens, wall_s=round(wall, 3), tokens_per_s=tokens / wall
        )
        return tokens == batch * new_tokens

    def check_weight_sync(self, figures: dict[str, Any]) -> bool:
        import torch

        model = self.load_learner_model()
        torch.manual_seed(1)
        perturbed = {
            name: (
                p.detach()
                + PERTURB_SCALE * torch.randn_like(p) * p.detach().float().std().to(p.dtype)
            )
            for name, p in model.named_parameters()
        }
        tensors = list(perturbed.items())
        before = [o["ids"] for o in generate(self.url, self.prompt_ids, 0.0)]
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        push = dict(backend=self.sync_backend, device=self.learner_device)
        bucket = [publish(self.url, tensors, 1, load_format="flattened_bucket", **push)]
        version = self.weight_version()
        self.load_learner_model(perturbed)  # the learner's forward now holds version 1
        after = compare_logprobs(self.url, model, self.prompt_ids, 0.0)
        changed = after["output_ids"] != before
        bucket += [
            publish(self.url, tensors, 1, load_format="flattened_bucket", **push)
            for _ in range(SYNC_REPEATS - 1)
        ]
        per_tensor = [
            publish(self.url, tensors, 1, load_format="per_tensor", **push)
            for _ in range(SYNC_REPEATS)
        ]
        devices = ("cuda:0", "cuda:1") if self.gpus >= 2 else ("cuda:0", "cuda:0")
        raw = raw_broadcast_gbps(nbytes, self.sync_backend, devices, SYNC_REPEATS)
        figures.update(
            backend=self.sync_backend,
            bytes=nbytes,
            version_after_push=version,
            greedy_output_changed=changed,
            max_abs_diff_after_push=after["max_abs_diff"],
            **sync_figures(bucket, raw, per_tensor),
        )
        return version == "1" and changed and after["max_abs_diff"] <= LOGPROB_TOL

    def run_demo(self, figures: dict[str, Any]) -> bool:
        run_dir = self.out / "demo" / "run"
        half = "1" if self.gpus >= 2 else "0.5"  # one GPU: learner and engine share it
        overrides = [
            f"trainer.output_dir={run_dir}",
            "trainer.total_steps=5",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            "trainer.resume=disable",
            "trainer.device=cuda",
            "learner.mixed_precision=bf16",
            "model.dtype=bfloat16",  # engines too: SGLang's attention kernels take no fp32
            f"learner.gpus_per_rank={half}",
            f"rollout.backend={self.args.demo_backend}",
            f"rollout.gpus_per_engine={half}",
            "rollout.mem_fraction_static=0.3",
            "weight_sync.verify=false",
            f"weight_sync.backend={self.sync_backend}",  # NCCL refuses two ranks on one GPU
            # head_dim 64: SGLang's attention kernels do not take the demo's head_dim 16
            f"model.path={self.out / 'demo' / 'model'}",
            "model.tiny.hidden=128",
            "model.tiny.heads=2",
        ]
        cmd = [
            str(Path(sys.executable).parent / "fleetrl"),
            "train",
            "--config",
            "configs/demo_cpu.yaml",
            *overrides,
        ]
        run_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(self.out / "demo.log", "wb") as log_file:
            proc = subprocess.Popen(
                cmd, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                code = proc.wait(timeout=STAGE_LIMITS_S["demo"] - 20)
            finally:
                if proc.poll() is None:
                    os.killpg(
                        proc.pid, signal.SIGTERM
                    )  # its own session: our child and its children
                    try:
                        proc.wait(timeout=15)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
        metrics = run_dir / "metrics.jsonl"
        figures.update(demo_figures(metrics.read_text().splitlines() if metrics.exists() else []))
        figures.update(
            exit_code=code,
            wall_s=round(time.perf_counter() - t0, 1),
            backend=self.args.demo_backend,
        )
        return (
            code == 0
            and figures["steps"] == 5
            and all(math.isfinite(x) for x in figures["pg_losses"])
        )

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/gpu_check")
    parser.add_argument("--demo-backend", choices=["sglang", "embedded"], default="sglang")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=12)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device visible; it needs a machine with a GPU")
        return 2
    gpus = torch.cuda.device_count()
    machine = {"gpus": gpus, "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    check = Check(args, gpus)
    results: list[StageResult] = []
    try:
        if (
            run_stage("model", check.build_model, STAGE_LIMITS_S["model"], results).ok
            and run_stage("engine", check.start_engine, STAGE_LIMITS_S["engine"], results).ok
        ):
            for name, fn in (
                ("logprobs", check.check_logprobs),
                ("throughput", check.check_throughput),
                ("weight_sync", check.check_weight_sync),
            ):
                run_stage(name, fn, STAGE_LIMITS_S[name], results)
    finally:
        check.close()
    check.model = None
    torch.cuda.empty_cache()
    run_stage("demo", check.run_demo, STAGE_LIMITS_S["demo"], results)
    path = write_report(Path(args.out), results, machine)
    print(render_table(results))
    print(f"report: {path}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
