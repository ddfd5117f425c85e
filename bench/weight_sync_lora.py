"""LoRA adapter sync beside the full sync, on the demo model's shape (a row of ``bench.weight_sync``).

The model is the CPU demo's (``configs/demo_cpu.yaml`` ``model.tiny``: Qwen2, 2
layers, hidden 64), built with ``fleetrl.models.tiny``; the adapter is peft's
LoRA of ``LORA_RANK`` on every linear layer (``all-linear``, the learner's
default). One reference engine (``weight_sync.reference_engine``, started on the
model folder) receives both, measured in alternation:

- ``full``: ``WeightSender.publish`` of the model as the learner publishes it
  (``flattened_bucket`` over gloo/NCCL);
- ``lora``: ``AdapterSender.publish`` of the adapter (the folder written, then
  ``/load_lora_adapter`` by path and ``/update_weight_version``).

Reported per variant: bytes (tensor data sent) and seconds (median of the whole
publish); the summary gives ``full_vs_lora_bytes`` and ``full_vs_lora_seconds``
(full ÷ LoRA). Seconds on so small a model are mostly HTTP round trips.

Left out: larger models (``fleetrl plan`` computes adapter sizes; the byte
ratio grows with the hidden size, as rank x (in + out) against in x out).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.common import Progress, alternate

LORA_RANK = 8
LORA_ALPHA = 16.0
DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo_cpu.yaml"


def demo_tiny_shape() -> dict[str, Any]:
    """``model.tiny`` of the demo config (the shape the demo trains)."""
    import yaml

    tiny = dict(yaml.safe_load(DEMO_CONFIG.read_text())["model"]["tiny"])
    tiny.pop("seed", None)
    return tiny


def measure_lora_sync(reps: int, device: str, progress: Progress) -> dict[str, Any]:
    """Full vs adapter publish of the demo model to one reference engine (module docstring)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from bench.weight_sync import Receiver
    from fleetrl.models.tiny import make_tiny_model
    from weight_sync.adapter_sender import AdapterSender
    from weight_sync.config import WeightSyncConfig
    from weight_sync.sender import EngineEndpoint, WeightSender
    from weight_sync.sources import module_named_tensors

    shape = demo_tiny_shape()
    with tempfile.TemporaryDirectory(prefix="bench-ws-lora-") as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", seed=0, **shape)
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        full = [(n, t.detach().clone()) for n, t in module_named_tensors(base)]
        lora_model = get_peft_model(
            base, LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules="all-linear")
        )
        adapter = list(get_peft_model_state_dict(lora_model).items())
        adapter_config = lora_model.peft_config["default"].to_dict()
        receiver = Receiver(["--model", str(model_dir)], Path(tmp), device)
        config = WeightSyncConfig(verify=False, timeout_s=300, group_name="bench-lora-full")
        full_sender = WeightSender(config, device=device)
        lora_sender = AdapterSender(
            config, adapter_dir=Path(tmp) / "adapters", adapter_config=adapter_config
        )
        try:
            url = receiver.url()
            full_sender.connect([EngineEndpoint("receiver", url, None)])
            lora_sender.connect([EngineEndpoint("receiver", url, None)])
            version = iter(range(1 << 30))
            sizes: dict[str, int] = {}

            def timed(name: str, sender: Any, stream: list) -> float:
                metrics = sender.publish(stream, next(version))
                sizes[name] = metrics.bytes
                return metrics.total_s

            seconds = alternate(
                {
                    "full": lambda: timed("full", full_sender, full),
                    "lora": lambda: timed("lora", lora_sender, adapter),
                },
                reps,
                progress=progress,
                label=f"demo model, LoRA rank {LORA_RANK} (seconds)",
            )
        finally:
            full_sender.close()
            lora_sender.close()
            receiver.stop()
    return {
        "model": shape,
        "lora_rank": LORA_RANK,
        "target_modules": "all-linear",
        "bytes": sizes,
        "seconds": seconds,
        "full_vs_lora_bytes": sizes["full"] / sizes["lora"],
        "full_vs_lora_seconds": seconds["full"]["median"] / seconds["lora"]["median"],
    }
