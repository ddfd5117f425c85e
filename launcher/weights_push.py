"""``fleetrl weights push``: load a model folder or a learner checkpoint into running engines.

    fleetrl weights push --model DIR --engine URL [--engine URL ...]
                         [--backend gloo|nccl] [--version V] [--api-key KEY]

The same ``WeightSender`` that training uses, so the same SGLang 0.5.23
protocol: pause, form the group (each engine with its TP size in ranks, read
from its ``/get_server_info`` unless ``--tp-size`` says), begin, buckets, end,
flush (unless ``--pause-mode in_place``), continue, then verify through
``/model_info`` and ``/get_weights_by_name``. Works against SGLang servers and
the embedded engine alike: load a checkpoint into a serving fleet, or roll back.

``--model`` is a Hugging Face folder (its ``config.json`` dtype is kept) or a
learner checkpoint (a ``step_<N>`` folder or a checkpoint root: the latest
complete one). ``--version`` defaults to the checkpoint's policy version, else 0.
Exit 0 when every engine serves the version; 1 with one line naming the engine
that failed; 2 for bad arguments.

The group's store listens on ``--master-address`` (default: the local address
that reaches the first engine; 127.0.0.1 for engines on loopback).

A LoRA checkpoint is pushed merged into full weights by default. With
``--adapter-dir DIR`` it is pushed as what a LoRA run publishes instead: the
adapter is written as a PEFT folder under DIR (a folder every engine can read:
shared storage on a cluster) and loaded with ``/load_lora_adapter`` under the
version's name, then ``/update_weight_version`` (``AdapterSender``, the LoRA
run's publisher); the engines must serve LoRA (SGLang ``--enable-lora`` with a
``--max-lora-rank`` at least the adapter's), and requests name the adapter
(``fleetrl-policy-v<V>``) in ``lora_path``.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from fleetrl.log import get_logger

log = get_logger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face folder or learner checkpoint")
    p.add_argument("--engine", action="append", required=True, help="engine URL (repeatable)")
    p.add_argument(
        "--backend",
        choices=["gloo", "nccl"],
        default="gloo",
        help="broadcast backend: gloo (CPU, default) or nccl (GPUs)",
    )
    p.add_argument("--version", type=int, default=None, help="policy version to publish as")
    p.add_argument("--api-key", default=None, help="the engines' bearer key")
    p.add_argument("--tp-size", type=int, default=None, help="ranks per engine (default: ask)")
    p.add_argument(
        "--pause-mode",
        choices=["abort", "retract", "in_place"],
        default="retract",
        help="how engines pause their requests during the push (default retract)",
    )
    p.add_argument(
        "--bucket-mb", type=float, default=512.0, help="size of one broadcast bucket (default 512)"
    )
    p.add_argument(
        "--timeout-s", type=float, default=120.0, help="longest wait for one engine (default 120)"
    )
    p.add_argument(
        "--master-address",
        default=None,
        help="address the group's store listens on (default: the one that reaches the engine)",
    )
    p.add_argument(
        "--adapter-dir",
        default=None,
        help="LoRA checkpoint: push its adapter (not merged weights) as a PEFT folder under"
        " this folder, which every engine must be able to read, via /load_lora_adapter",
    )


def load_source(path: str) -> tuple[list[tuple[str, Any]], int]:
    """The tensors to publish from a HF folder or a learner checkpoint, and its version."""
    from learner.checkpoint import read_meta
    from learner.export import load_policy
    from weight_sync.sources import module_named_tensors

    source = Path(path)
    if not source.exists():
        raise FileNotFoundError(f"--model: {path} does not exist")
    if (source / "config.json").is_file():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(source), dtype="auto")
        return module_named_tensors(model), 0
    model, step_dir = load_policy(source)
    version = int(read_meta(step_dir).get("policy_version", 0) or 0)
    return module_named_tensors(model), version


def engine_tp_size(url: str, api_key: str | None) -> int:
    """An engine's tensor-parallel size from ``GET /get_server_info`` (1 when it does not say)."""
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        info = requests.get(url.rstrip("/") + "/get_server_info", headers=headers, timeout=10)
        return max(1, int(info.json().get("tp_size", 1))) if info.ok else 1
    except (requests.RequestException, ValueError, TypeError, AttributeError):
        return 1


def master_address_for(url: str) -> str:
    """The local address that reaches the engine at ``url`` (no packet is sent)."""
    host = urlparse(url).hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


def _endpoints(args: argparse.Namespace) -> list[Any]:
    from weight_sync.engine_client import EngineEndpoint

    return [
        EngineEndpoint(
            name=url,
            url=url,
            api_key=args.api_key,
            world_size=args.tp_size or engine_tp_size(url, args.api_key),
        )
        for url in args.engine
    ]


def _version(args: argparse.Namespace, checkpoint_version: int) -> int:
    version = checkpoint_version if args.version is None else args.version
    if version < 0:
        raise ValueError(f"--version must be >= 0, got {version}")
    return version


def push_adapter(args: argparse.Namespace) -> tuple[Any, str]:
    """Publish a LoRA checkpoint's adapter to the engines (``--adapter-dir``)."""
    from learner import lora
    from learner.checkpoint import read_meta
    from learner.export import load_lora_policy
    from weight_sync.adapter_sender import AdapterSender
    from weight_sync.config import WeightSyncConfig

    if (Path(args.model) / "config.json").is_file():
        raise ValueError(
            f"--adapter-dir pushes a LoRA learner checkpoint's adapter; {args.model} is a"
            " Hugging Face folder (push it without --adapter-dir)"
        )
    model, step_dir = load_lora_policy(args.model, with_base=False)
    version = _version(args, int(read_meta(step_dir).get("policy_version", 0) or 0))
    config = WeightSyncConfig(timeout_s=args.timeout_s, verify=True)
    with AdapterSender(
        config, adapter_dir=args.adapter_dir, adapter_config=lora.adapter_config(model)
    ) as sender:
        sender.connect(_endpoints(args))
        metrics = sender.publish(lora.named_adapter_tensors(model), version)
    return metrics, f"adapter version {version} (from {step_dir})"


def push(args: argparse.Namespace) -> tuple[Any, str]:
    """Publish a model folder's or a checkpoint's full weights to the engines."""
    from weight_sync.config import WeightSyncConfig
    from weight_sync.sender import WeightSender

    tensors, checkpoint_version = load_source(args.model)
    version = _version(args, checkpoint_version)
    config = WeightSyncConfig(
        backend=args.backend,
        bucket_mb=args.bucket_mb,
        pause_mode=args.pause_mode,
        timeout_s=args.timeout_s,
        verify=True,
    )
    device = "cuda" if args.backend == "nccl" else "cpu"
    master = args.master_address or master_address_for(args.engine[0])
    with WeightSender(config, master_address=master, device=device) as sender:
        sender.connect(_endpoints(args))
        metrics = sender.publish(((n, t.to(device)) for n, t in tensors), version)
    return metrics, f"version {version}"


def main(args: argparse.Namespace) -> int:
    """Handler of ``fleetrl weights push``."""
    from weight_sync.errors import WeightSyncError

    try:
        metrics, what = (push_adapter if args.adapter_dir else push)(args)
    except WeightSyncError as err:
        print(f"fleetrl: weights push failed: {err}", file=sys.stderr)
        return 1
    log.info("%s", metrics.summary())
    print(
        f"pushed {what} ({metrics.bytes / 1e6:.2f} MB) to {len(args.engine)} engine(s): "
        + ", ".join(args.engine)
    )
    return 0
