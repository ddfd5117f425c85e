"""One co-located cycle on one device, learner and engine in two processes: the GPU check.

``check_colocated(out_dir, figures, device="cuda")`` is the stage ``scripts/gpu_check.py``
calls on a GPU machine (the CPU tiers run the same function with ``device="cpu"``:
tests/integration/bench/test_colocated_check.py). It starts an embedded engine with the
memory saver on ``device`` as a process of its own (``rollout_fleet.engine.cli``, ended
by its pid), builds the learner's weights in this process on the same device, and runs
the cycle through the routes a co-located run uses:

    pause (abort) -> release every tag -> what the device got back -> resume weights ->
    push version 1 by handle (CUDA IPC on GPU, shared memory on CPU; verified through
    /get_weights_by_name) -> resume the KV cache -> continue -> /generate on version 1

then moves an FSDP2-wrapped copy of the learner (one rank) off the device and back
(``learner.offload``) and checks that its forward is unchanged.

What only a GPU shows, and this reports there (``figures``): that CUDA IPC handles from
the learner load in the engine (``push_gbps``), that the engine's release returns device
memory to the driver (``device_bytes_freed``, from ``torch.cuda.mem_get_info`` in this
process), and that the learner's offload frees its device memory (``learner_bytes_freed``).
On CPU the same figures are the engine's RSS drop and 0 for the offload (nothing moves).
Returns True when every check held (``problems``: the ones that did not).
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests
import torch

# ~17 M parameters (68 MB in fp32): figures above noise
MODEL = {"layers": 4, "hidden": 512, "heads": 8}
STARTUP_S = 240.0
# the engine requires a key, as every server fleetrl starts does; made per check
API_KEY = secrets.token_urlsafe(32)
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, route: str, body: Any = None) -> Any:
    reply = requests.post(f"{url}{route}", json=body, headers=AUTH, timeout=120)
    reply.raise_for_status()
    return reply.json() if reply.content else None


def _device_free_bytes(device: torch.device, pid: int) -> int:
    """Free memory the engine's release can raise: the device's, or (CPU) minus its RSS."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return -int(line.split()[1]) * 1024
    return 0


def _start_engine(model_dir: Path, device: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    log = open(log_path, "wb")  # noqa: SIM115 - the engine process writes it until it ends
    cmd = [
        sys.executable, "-m", "rollout_fleet.engine.cli", "--model", str(model_dir),
        "--device", device, "--port", str(port), "--enable-memory-saver",
    ]  # fmt: skip
    env = {**os.environ, "FLEETRL_API_KEY": API_KEY}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the engine exited with {proc.returncode} (see {log_path})")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"the engine did not serve within {STARTUP_S:.0f}s (see {log_path})")


def _cycle(url: str, pid: int, model, device: torch.device, figures: dict[str, Any]) -> None:
    from weight_sync.config import WeightSyncConfig
    from weight_sync.engine_client import EngineEndpoint
    from weight_sync.tensor_push import TensorSender

    _post(url, "/generate", {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 8}})
    info = requests.get(f"{url}/server_info", headers=AUTH, timeout=30).json()["internal_states"][0]
    figures["bytes_reported"] = int(
        (info["memory_usage"]["weight"] + info["memory_usage"]["kvcache"]) * 2**30
    )
    _post(url, "/pause_generation", {"mode": "abort"})
    before = _device_free_bytes(device, pid)
    t = time.perf_counter()
    _post(url, "/release_memory_occupation", {"tags": None})
    figures["release_s"] = time.perf_counter() - t
    time.sleep(0.5)  # the engine returns memory after answering
    figures["device_bytes_freed"] = _device_free_bytes(device, pid) - before
    t = time.perf_counter()
    _post(url, "/resume_memory_occupation", {"tags": ["cuda_graph", "weights"]})
    figures["resume_weights_s"] = time.perf_counter() - t
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.01)
    config = WeightSyncConfig(verify_tensors=16, verify_rows=4, timeout_s=120)
    with TensorSender(config, device=device) as sender:
        sender.set_members([EngineEndpoint("engine", url, api_key=API_KEY)])
        stream = ((n, p.detach()) for n, p in model.named_parameters())
        metrics = sender.publish(stream, version=1)
    figures.update(push_s=metrics.total_s, push_gbps=metrics.gbps, push_bytes=metrics.bytes)
    t = time.perf_counter()
    _post(url, "/resume_memory_occupation", {"tags": ["kv_cache"]})
    _post(url, "/continue_generation", {})
    figures["resume_kv_s"] = time.perf_counter() - t
    out = _post(
        url, "/generate", {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 8}}
    )
    figures["served_version"] = out["meta_info"]["weight_version"]


def _offload(model_dir: Path, device: torch.device, figures: dict[str, Any]) -> None:
    """An FSDP2 learner (one rank) off the device and back; its forward is unchanged."""
    from fleetrl.models.loading import load_causal_lm
    from learner import dist as ldist
    from learner.fsdp import build_optimizer, shard_model
    from learner.offload import DeviceResidency

    ldist.init_group(
        master_addr="127.0.0.1", master_port=_free_port(), rank=0, world_size=1, device=device
    )
    try:
        model = shard_model(load_causal_lm(model_dir).to(device), bf16=False, cpu_offload=False)
        from learner.config import OptimConfig

        optimizer = build_optimizer(model.parameters(), OptimConfig())
        ids = torch.tensor([[3, 4, 5, 6]], device=device)
        model(input_ids=ids).logits.sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            expected = model(input_ids=ids).logits
        residency = DeviceResidency(device, [model], [optimizer], enabled=True)
        held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        figures["offload_s"] = residency.offload()
        left = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        figures["learner_bytes_freed"] = held - left
        figures["onload_s"] = residency.onload()
        with torch.no_grad():
            same = torch.equal(model(input_ids=ids).logits, expected)
        figures["forward_unchanged"] = same
    finally:
        ldist.close_group()


def problems(figures: dict[str, Any], device: str) -> list[str]:
    """What did not hold in ``figures`` (``check_colocated``'s), one line each; [] when all did.

    The engine serves the pushed version; its release gave back at least 80 % of the pushed
    weights' bytes (the KV cache and the weights are released, so a working release frees
    more than the weights); the learner's forward is unchanged after its offload and onload;
    on CUDA the offload freed device memory (on CPU nothing moves)."""
    out = []
    if figures.get("served_version") != "1":
        out.append(f"the engine serves version {figures.get('served_version')!r}, not '1'")
    freed, pushed = figures.get("device_bytes_freed"), figures.get("push_bytes")
    if freed is None or not pushed or freed < 0.8 * pushed:
        out.append(f"the release gave back {freed} bytes, under 80 % of the {pushed} pushed")
    if figures.get("forward_unchanged") is not True:
        out.append("the learner's forward changed across its offload and onload")
    if device == "cuda" and not figures.get("learner_bytes_freed", 0) > 0:
        out.append(f"the learner's offload freed {figures.get('learner_bytes_freed')} bytes")
    return out


def check_colocated(out_dir: str | Path, figures: dict[str, Any], device: str = "cuda") -> bool:
    """Run the cycle and the offload on ``device``; fill ``figures``; True when every check
    held (``problems`` says which did not)."""
    from fleetrl.models.loading import load_causal_lm
    from fleetrl.models.tiny import make_tiny_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = out / "colocated_model"
    if not (model_dir / "config.json").is_file():
        make_tiny_model(model_dir, seed=0, **MODEL)
    where = torch.device(device)
    proc, url = _start_engine(model_dir, device, out / "colocated_engine.log")
    try:
        model = load_causal_lm(model_dir).to(where)
        _cycle(url, proc.pid, model, where, figures)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    figures["device"] = device
    _offload(model_dir, where, figures)
    return not problems(figures, device)
