"""Launch, watch and stop one vLLM server (`vllm serve`), the other GPU rollout engine.

``build_command(spec)`` turns a ``VllmServerSpec`` into the ``vllm serve`` argument list
(names as in vLLM 0.34's own parser, which the conformance tier runs on every command
line built here): ``--tensor-parallel-size``, ``--gpu-memory-utilization``,
``--load-format``, ``--dtype``, ``--max-num-seqs``, ``--weight-transfer-config
{"backend": "nccl"}`` (the trainer-to-worker group weight sync joins),
``--logprobs-mode processed_logprobs`` (a sampled token's logprob after temperature, as
SGLang's and the learner's; vLLM's default is the raw T = 1 one, and with top_p / top_k
set, vLLM's are over the kept tokens, renormalised), and
``--middleware rollout_fleet.vllm_auth.RequireBearerKey`` (vLLM's own key check skips
every route outside ``/v1``; see ``vllm_auth``). ``server_env(spec)`` is the environment
beside it: ``VLLM_API_KEY`` (the key never goes on the command line, where any local user
reads it in ``ps``), ``VLLM_SERVER_DEV_MODE=1`` (vLLM registers its weight-transfer,
pause and sleep routes only then) and, with LoRA, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``.

``VllmServer`` is ``SGLangServer``'s process handling (own process group, health wait
with a deadline, bounded restarts, stop by group id) with this command; once healthy it
sets the served weight version to ``"0"`` (vLLM starts at ``"default"``, and fleetrl tags
tokens with integer versions): SGLang's ``--weight-version 0``.

Flags that follow the run: ``--no-enable-prefix-caching`` when weight sync pauses
``in_place`` (vLLM's ``keep`` pause leaves requests running, so a prefix cached under the
old weights would be reused under the new version tag: the radix-cache rule of SGLang),
``--enable-sleep-mode`` for engines that release memory (``/sleep``, ``/wake_up``),
``--enable-lora --max-lora-rank r --max-loras 3`` under LoRA weight sync.

A vLLM release other than ``TESTED_VLLM`` is refused with one line before anything
starts (``check_available``; ``fleetrl check`` says the same). A user who set
``VLLM_SERVER_DEV_MODE`` to something else keeps it, and ``fleetrl check`` refuses the
run (``dev_mode_problem``). Left out: multi-node tensor parallel, data parallel inside one
server (use more engines).
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from fleetrl.log import get_logger
from rollout_fleet.sglang_launcher import LORA_SLOTS, SGLangServer, SGLangUnavailable
from rollout_fleet.sglang_version import installed_version, tested_release_problem

log = get_logger(__name__)

TESTED_VLLM = "==0.34.0"
INSTALL_HINT = 'pip install "vllm==0.34.0" (or ".[vllm]" in fleetrl\'s checkout)'
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
KEY_ENV = "VLLM_API_KEY"
LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
AUTH_MIDDLEWARE = "rollout_fleet.vllm_auth.RequireBearerKey"
INITIAL_WEIGHT_VERSION = "0"
SERVED_MODEL_NAME = "fleetrl-policy"  # requests name it as `model` (rollout_fleet.vllm_client)


class VllmUnavailable(SGLangUnavailable):
    """vLLM cannot run here (not the tested release, no CUDA device, dev mode turned off)."""


@dataclass
class VllmServerSpec:
    """Everything that goes on the ``vllm serve`` command line and into its environment."""

    model_path: str
    api_key: str
    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port at launch
    tp_size: int = 1
    gpu_memory_utilization: float = 0.9
    load_format: Literal["dummy", "auto"] = "dummy"
    dtype: str = "auto"
    max_num_seqs: int | None = None
    seed: int | None = None
    enable_prefix_caching: bool = True
    enable_sleep_mode: bool = False
    lora_rank: int = 0
    log_level: str = "warning"
    extra_args: list[str] = field(default_factory=list)
    python: str = sys.executable

    def validate(self) -> None:
        if not self.model_path:
            raise ValueError("VllmServerSpec.model_path is empty")
        if not self.api_key:
            raise ValueError(
                "a vLLM server needs the run's api_key: its dev-mode routes (weight updates, "
                "/collective_rpc) are open without fleetrl's bearer-key middleware"
            )
        if self.tp_size < 1:
            raise ValueError(f"VllmServerSpec.tp_size must be >= 1, got {self.tp_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"VllmServerSpec.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.load_format not in ("dummy", "auto"):
            raise ValueError(
                f"VllmServerSpec.load_format {self.load_format!r}; accepted: dummy, auto"
            )
        if not 0 <= self.port < 65536:
            raise ValueError(f"VllmServerSpec.port {self.port} is not a TCP port")
        if any(arg.startswith("--api-key") for arg in self.extra_args):
            raise ValueError("the API key goes to vLLM in VLLM_API_KEY, never on its command line")


def build_command(spec: VllmServerSpec) -> list[str]:
    """The ``vllm serve`` argument list of ``spec`` (port must already be chosen)."""
    spec.validate()
    if spec.port == 0:
        raise ValueError("build_command: choose a port first")
    cmd = [
        spec.python, "-m", "vllm.entrypoints.cli.main", "serve", spec.model_path,
        "--host", spec.host,
        "--port", str(spec.port),
        "--served-model-name", SERVED_MODEL_NAME,
        "--tensor-parallel-size", str(spec.tp_size),
        "--gpu-memory-utilization", str(spec.gpu_memory_utilization),
        "--load-format", spec.load_format,
        "--dtype", spec.dtype,
        "--weight-transfer-config", json.dumps({"backend": "nccl"}),
        "--logprobs-mode", "processed_logprobs",
        "--middleware", AUTH_MIDDLEWARE,
        "--uvicorn-log-level", spec.log_level,
    ]  # fmt: skip
    if spec.max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(spec.max_num_seqs)]
    if spec.seed is not None:
        cmd += ["--seed", str(spec.seed)]
    if not spec.enable_prefix_caching:
        cmd += ["--no-enable-prefix-caching"]
    if spec.enable_sleep_mode:
        cmd += ["--enable-sleep-mode"]
    if spec.lora_rank:
        cmd += ["--enable-lora", "--max-lora-rank", str(spec.lora_rank)]
        cmd += ["--max-loras", str(LORA_SLOTS)]
    return cmd + list(spec.extra_args)


def server_env(spec: VllmServerSpec, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables the server starts with beside ``base`` (default: this process's):
    the key, dev mode (unless ``base`` sets it: ``fleetrl check`` refuses that), LoRA."""
    base = os.environ if base is None else base
    env = {KEY_ENV: spec.api_key, DEV_MODE_ENV: base.get(DEV_MODE_ENV, "1")}
    if spec.lora_rank:
        env[LORA_ENV] = "True"
    return env


def dev_mode_problem(environ: Mapping[str, str] | None = None) -> str:
    """Why vLLM would start without its weight-transfer routes here (one line), or ""."""
    value = (os.environ if environ is None else environ).get(DEV_MODE_ENV)
    if value is None or value.strip().lower() in ("1", "true"):
        return ""
    return (
        f"{DEV_MODE_ENV}={value} in this environment: vLLM then has no /pause, "
        "/init_weight_transfer_engine or /update_weights routes; unset it (fleetrl sets it to 1)"
    )


def version_problem(lookup: Callable[[], str | None] | None = None) -> str:
    """Why the installed vLLM is not the tested release (one line), or ""."""
    version = (lookup or (lambda: installed_version("vllm")))()
    return tested_release_problem("vllm", version, TESTED_VLLM, INSTALL_HINT)


def preflight_problems(
    version: str | None, environ: Mapping[str, str], instead: str
) -> list[tuple[str, str]]:
    """What ``fleetrl check`` says of the installed vLLM and the environment
    (``rollout_fleet.engine_kinds``): (problem, fix) pairs."""
    out = []
    release = version_problem(lambda: version)
    if release:
        out.append((release, f"{INSTALL_HINT} on the machines that run the engines, or {instead}"))
    dev_mode = dev_mode_problem(environ)
    if dev_mode:
        out.append((dev_mode, f"unset {DEV_MODE_ENV} (or set it to 1)"))
    return out


def check_available(lookup: Callable[[], str | None] | None = None) -> None:
    """Raise VllmUnavailable unless the tested vLLM, dev mode and a CUDA device are here."""
    problem = version_problem(lookup) or dev_mode_problem()
    if problem:
        raise VllmUnavailable(f"rollout.backend=vllm: {problem}")
    import torch

    if not torch.cuda.is_available():
        raise VllmUnavailable(
            "rollout.backend=vllm needs a CUDA GPU on the engine's node, and none is visible; "
            "use rollout.backend=embedded for CPU runs"
        )


class VllmServer(SGLangServer):
    """One ``vllm serve`` subprocess: start, wait healthy, set version 0, restart, stop."""

    NAME = "vLLM"

    def __init__(self, spec: VllmServerSpec, **kwargs) -> None:
        env = {**(kwargs.pop("env", None) or {}), **server_env(spec)}
        super().__init__(spec, env=env, **kwargs)  # type: ignore[arg-type]

    def _check_available(self) -> None:
        check_available()

    def _command(self) -> list[str]:
        return build_command(self.spec)  # type: ignore[arg-type]

    def wait_healthy(self, timeout_s: float) -> None:
        super().wait_healthy(timeout_s)
        set_initial_version(self.url, self.spec.api_key)  # type: ignore[attr-defined]


def set_initial_version(url: str, api_key: str) -> None:
    """Make a fresh server report version ``"0"`` (vLLM starts at ``"default"``)."""
    body = json.dumps({"new_version": INITIAL_WEIGHT_VERSION}).encode()
    request = urllib.request.Request(f"{url}/update_weight_version", data=body, method="POST")
    request.add_header("Content-Type", "application/json")
    request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()
    log.info("vLLM server at %s serves weight version %s", url, INITIAL_WEIGHT_VERSION)
