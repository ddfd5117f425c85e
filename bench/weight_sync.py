"""Weight-sync throughput: bucketed publish vs the transport's limit vs one broadcast per parameter.

For each model size (a flat parameter list shaped like a decoder-only
transformer of the given hidden size and layer count) one receiver process
(``weight_sync.reference_engine``, HTTP + ``WeightReceiver``) is started, and
three ``WeightSender``s, each with its own group to it, are measured in
alternation (A B C, C B A, ...):

- ``bucketed``: fleetrl's publish (``flattened_bucket``, ``bucket_mb`` buckets:
  512 MiB on CUDA, gloo's default on CPU; packing overlapped with broadcasting;
  on CPU, tensors of at least ``ZERO_COPY_MB`` sent uncopied, one broadcast
  each, beside the buckets of the smaller ones);
- ``raw_broadcast``: one broadcast of one flat tensor of the same total bytes
  (the transport's limit through the same HTTP/receiver path);
- ``per_param``: one broadcast per parameter without buckets, all metadata in
  one request (PipelineRL's pattern; OpenRLHF also sends one broadcast per
  parameter).

Each figure is GB/s (1e9 bytes) over the whole publish (pause, group traffic,
engine loads, continue); the summary gives ``vs_raw_broadcast`` and
``vs_per_param`` as ratios of medians. Beside them, ``bench.weight_sync_lora``
measures a LoRA adapter sync against the full sync of the demo model (bytes,
seconds, ``full_vs_lora_bytes``, ``full_vs_lora_seconds``). ``device="cuda"`` uses NCCL with bf16
parameters, ``cpu`` gloo with fp32. Writes ``out_dir/weight_sync.json``.

Run:  python -m bench.weight_sync --out DIR [--quick] [--device cuda]
Left out: several engines per size (the broadcast is a tree; one receiver
isolates per-byte cost), and verification (it has its own cost, reported by
``SyncMetrics.verify_s``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import Progress, alternate, ratio, suite_record, write_json
from bench.weight_sync_lora import LORA_RANK, measure_lora_sync
from fleetrl.log import get_logger, setup_logging

log = get_logger(__name__)

RAW_NAME = "__raw_broadcast__"
QUICK = {"hidden_sizes": [256, 512], "layers": 4, "vocab": 8192, "reps": 15}
FULL = {"hidden_sizes": [512, 1024, 2048], "layers": 8, "vocab": 32000, "reps": 5}


def transformer_param_shapes(hidden: int, layers: int, vocab: int) -> list[tuple[str, list[int]]]:
    """Parameter names and shapes of a Llama/Qwen-like decoder (untied head, SwiGLU MLP)."""
    inter = max(8, int(8 * hidden / 3) // 8 * 8)
    shapes = [("model.embed_tokens.weight", [vocab, hidden])]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", [hidden]),
            (p + "self_attn.q_proj.weight", [hidden, hidden]),
            (p + "self_attn.k_proj.weight", [hidden, hidden]),
            (p + "self_attn.v_proj.weight", [hidden, hidden]),
            (p + "self_attn.o_proj.weight", [hidden, hidden]),
            (p + "post_attention_layernorm.weight", [hidden]),
            (p + "mlp.gate_proj.weight", [inter, hidden]),
            (p + "mlp.up_proj.weight", [inter, hidden]),
            (p + "mlp.down_proj.weight", [hidden, inter]),
        ]
    shapes += [("model.norm.weight", [hidden]), ("lm_head.weight", [vocab, hidden])]
    return shapes


class Receiver:
    """A reference engine subprocess; ``source`` is its ``--spec FILE`` or ``--model DIR``."""

    def __init__(self, source: list[str], workdir: Path, device: str) -> None:
        self.port_file = workdir / "receiver.port"
        self.log_path = workdir / "receiver.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "weight_sync.reference_engine",
                *source,
                "--device",
                device,
                "--port-file",
                str(self.port_file),
            ],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def url(self, timeout_s: float = 120.0) -> str:
        deadline = time.monotonic() + timeout_s
        while not self.port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"receiver did not start: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port_file.read_text().strip()}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


def measure_size(
    hidden: int,
    layers: int,
    vocab: int,
    reps: int,
    device: str,
    bucket_mb: float,
    progress: Progress,
    *,
    backend: str = "auto",
    deadline: float | None = None,
) -> dict[str, Any]:
    """One size's three publish variants against a receiver process (the module docstring).

    ``backend`` is the group's (``auto``: NCCL with CUDA; one GPU needs ``gloo``, since
    NCCL refuses two ranks on one device); ``deadline`` bounds the repetitions."""
    from weight_sync.config import WeightSyncConfig
    from weight_sync.sender import EngineEndpoint, WeightSender

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    shapes = transformer_param_shapes(hidden, layers, vocab)
    gen = torch.Generator().manual_seed(hidden)
    params = [(n, torch.randn(s, generator=gen).to(dtype).to(device)) for n, s in shapes]
    total_bytes = sum(t.numel() * t.element_size() for _, t in params)
    raw = torch.randint(0, 255, (total_bytes,), dtype=torch.uint8).to(device)
    dtype_name = str(dtype).removeprefix("torch.")
    spec = [[n, dtype_name, s] for n, s in shapes] + [[RAW_NAME, "uint8", [total_bytes]]]
    with tempfile.TemporaryDirectory(prefix="bench-ws-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        receiver = Receiver(["--spec", str(spec_path)], Path(tmp), device)
        senders: dict[str, WeightSender] = {}
        try:
            url = receiver.url()
            variants = {
                "bucketed": ("flattened_bucket", bucket_mb),
                "raw_broadcast": ("per_tensor", bucket_mb),
                "per_param": ("per_tensor", 1e9),  # all metadata in one request
            }
            for name, (load_format, mb) in variants.items():
                config = WeightSyncConfig(
                    backend=backend,
                    bucket_mb=mb,
                    load_format=load_format,
                    verify=False,
                    timeout_s=300,
                    group_name=f"bench-{name}",
                )
                senders[name] = WeightSender(config, device=device)
                senders[name].connect([EngineEndpoint("receiver", url, None)])
            version = iter(range(1 << 30))

            def timed(name: str, stream: list) -> float:
                metrics = senders[name].publish(stream, next(version))
                return metrics.bytes / metrics.total_s / 1e9

            measures = {
                "bucketed": lambda: timed("bucketed", params),
                "raw_broadcast": lambda: timed("raw_broadcast", [(RAW_NAME, raw)]),
                "per_param": lambda: timed("per_param", params),
            }
            figures = alternate(
                measures, reps, progress=progress, label=f"hidden={hidden}", deadline=deadline
            )
        finally:
            for sender in senders.values():
                sender.close()
            receiver.stop()
    return {
        "hidden": hidden,
        "layers": layers,
        "vocab": vocab,
        "backend": backend,
        "num_params": len(params),
        "bytes": total_bytes,
        "dtype": dtype_name,
        "gbps": figures,
    }


def run(
    out_dir: str | Path,
    quick: bool = False,
    reps: int | None = None,
    hidden_sizes: list[int] | None = None,
    layers: int | None = None,
    device: str = "cpu",
    bucket_mb: float | None = None,
) -> dict[str, Any]:
    """Measure every size; write and return the suite record (see the module docstring)."""
    preset = QUICK if quick else FULL
    hidden_sizes = list(hidden_sizes or preset["hidden_sizes"])
    layers = int(layers or preset["layers"])
    reps = int(reps or preset["reps"])
    if bucket_mb is None:
        from weight_sync.config import DEFAULT_BUCKET_MB

        # GPU: the size peers use; CPU: the gloo default a run gets (``bucket_mb_for``).
        bucket_mb = 512.0 if device.startswith("cuda") else DEFAULT_BUCKET_MB["gloo"]
    progress = Progress("weight-sync")
    started = time.monotonic()
    rows = []
    for hidden in hidden_sizes:
        progress.note(f"hidden={hidden} layers={layers} on {device}")
        rows.append(
            measure_size(hidden, layers, preset["vocab"], reps, device, bucket_mb, progress)
        )
    progress.note(f"LoRA rank {LORA_RANK} adapter sync vs full sync, demo model, on {device}")
    lora = measure_lora_sync(reps, device, progress)
    vs_raw = [
        ratio(r["gbps"]["bucketed"]["median"], r["gbps"]["raw_broadcast"]["median"]) for r in rows
    ]
    vs_per_param = [
        ratio(r["gbps"]["bucketed"]["median"], r["gbps"]["per_param"]["median"]) for r in rows
    ]
    largest = rows[-1]
    summary = {
        # the largest size decides the headline (small models are dominated by HTTP latency)
        "vs_raw_broadcast": vs_raw[-1],
        "vs_per_param": vs_per_param[-1],
        "bucketed_gbps": largest["gbps"]["bucketed"]["median"],
        "raw_broadcast_gbps": largest["gbps"]["raw_broadcast"]["median"],
        "per_param_gbps": largest["gbps"]["per_param"]["median"],
        "largest_bytes": largest["bytes"],
        # LoRA: adapter-only sync of the demo model beside its full sync
        "full_vs_lora_bytes": lora["full_vs_lora_bytes"],
        "full_vs_lora_seconds": lora["full_vs_lora_seconds"],
        "demo_full_bytes": lora["bytes"]["full"],
        "demo_lora_bytes": lora["bytes"]["lora"],
        "demo_full_s": lora["seconds"]["full"]["median"],
        "demo_lora_s": lora["seconds"]["lora"]["median"],
    }
    record = suite_record(
        "weight-sync",
        config={
            "quick": quick,
            "reps": reps,
            "hidden_sizes": hidden_sizes,
            "layers": layers,
            "device": device,
            "bucket_mb": bucket_mb,
            "backend": "nccl" if device.startswith("cuda") else "gloo",
            "lora_rank": LORA_RANK,
        },
        results={
            "sizes": rows,
            "lora": lora,
            "vs_raw_broadcast_by_size": vs_raw,
            "vs_per_param_by_size": vs_per_param,
        },
        summary=summary,
        sweep={
            "x": "hidden",
            "unit": "GB/s",
            "rows": [
                {"x": r["hidden"], "series": {k: v["median"] for k, v in r["gbps"].items()}}
                for r in rows
            ],
        },
        wall_s=time.monotonic() - started,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "weight_sync.json", record)
    progress.note(
        "bucketed/raw = "
        + ", ".join(f"{v:.2f}" if v is not None and math.isfinite(v) else "n/a" for v in vs_raw)
        + "; bucketed/per-param = "
        + ", ".join(
            f"{v:.2f}" if v is not None and math.isfinite(v) else "n/a" for v in vs_per_param
        )
    )
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--hidden", type=int, nargs="*", default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bucket-mb", type=float, default=None)
    args = parser.parse_args(argv)
    setup_logging(role="bench")
    torch.set_num_threads(1)
    record = run(
        args.out,
        quick=args.quick,
        reps=args.reps,
        hidden_sizes=args.hidden,
        layers=args.layers,
        device=args.device,
        bucket_mb=args.bucket_mb,
    )
    sys.stdout.write(json.dumps(record["summary"], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
