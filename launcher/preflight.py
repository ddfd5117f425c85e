"""Preflight: every precondition of a run, checked before any role starts.

``fleetrl train`` runs these checks first; ``fleetrl check --config C [overrides]
[--address A]`` runs them alone. Each check is a small function of the config and
of ``Probes`` (what this machine or the cluster offers: resources, environment
variables, disk, package versions), returning typed ``Finding``s (key, problem,
fix). Every check runs and every failure is reported at once, one line each
(``fleetrl: preflight error at <key>: <problem> (<fix>)``), exit status 2: a new
user learns all that is missing in one attempt instead of after a model build, a
20-line wandb traceback or an endless wait for GPUs the machine does not have.

What is checked:
- data files, read through the rollout's own validator, and a few prompts rendered with the
  tokenizer as the run will (``launcher.preflight_data``); the model folder (what
  ``launcher.prepare`` cannot make), and the model's family: what cannot train or serve
  (``launcher.preflight_model``);
- the reward section: the custom reward function loads, can be called and scores the
  first rows without raising, the reward
  model folder, a scorer for every data source (``launcher.preflight_rewards``), and
  ``reward.model.urls`` answer (with their key when off this machine);
- resources: the learner group's bundles, the engines and the reward servers the run
  places against what Ray offers,
  per node (a rank or an engine fits on one node or not at all). Locally: the
  instance ``fleetrl train`` would start (this machine's CPUs, the GPUs torch
  sees); on a cluster: ``ray.nodes()``. With ``ray.autoscaling`` a shortfall is a
  warning (nodes may still come) and ``ray.placement_timeout_s`` bounds the wait;
- the rollout and reward backends where engines or reward servers run locally: SGLang
  installed at a tested version, CUDA present; ``trainer.device=cuda`` with CUDA;
- a co-located run on this machine: ``torch_memory_saver`` for SGLang's memory saver,
  and each device (on CPU, the host's share per rank) holds the larger of its two
  phases, generating and training (``launcher.plan_colocated``);
- tracking: wandb logged in, offline, or off;
- the run directory: writable, with free disk for the checkpoints and the bank, and not
  another run's (``launcher.run_folder``);
- the Ray address the run pins: something answers there.

Left out: the SGLang version and torch_memory_saver on remote nodes (on a cluster the
node resources Ray reports stand for them); GPU memory per device of a cluster (only
this machine's devices are measured).
"""

from __future__ import annotations

import argparse
import netrc
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import msgspec

from fleetrl.config import ConfigErrors
from fleetrl.log import get_logger
from launcher.config import RunConfig, load_run_config_named
from launcher.preflight_agent import check_agent
from launcher.preflight_data import check_rendering, data_rows
from launcher.preflight_findings import (
    Finding,
    Node,
    PreflightFailed,
    Probes,
    _count,
    _first_line,
    _gib,
    shown,
)
from launcher.preflight_memo import remembered
from launcher.preflight_model import check_model_family
from launcher.preflight_resources import check_resources, local_node, needs_gpus
from launcher.preflight_rewards import check_rewards
from learner.memory import ModelShape

log = get_logger(__name__)

# The SGLang releases fleetrl is tested against (one definition, shared with the launcher's gate).

CKPT_BYTES_PER_PARAM = 12  # fp32 master weights + AdamW's two fp32 moments (DCP shards)
# the rollout bank, per sample: prompt token ids; per response token an id, a behaviour
# logprob and a version; per sample its metadata, score and metrics (measured ~0.6 KiB)
BANK_BYTES_PER_PROMPT_TOKEN = 4
BANK_BYTES_PER_RESPONSE_TOKEN = 12
BANK_BYTES_PER_SAMPLE = 1024
DISK_HEADROOM = 1.1  # segments, metrics, plots, hf/ copies in checkpoints
WANDB_OFF_MODES = ("offline", "disabled", "dryrun")


# ---- the checks -----------------------------------------------------------------------------


def check_model(cfg: RunConfig) -> list[Finding]:
    """The policy's folder, the critic's own (when it has one) and a checkpoint to resume."""
    out = []
    if not ((Path(cfg.model.path) / "config.json").is_file() or cfg.model.create_tiny):
        out.append(
            Finding(
                key="model.path",
                problem=f"{shown(cfg.model.path)} is not a Hugging Face model folder",
                fix="point it at a local model folder (nothing is downloaded: fetch a hub model "
                "first, e.g. `huggingface-cli download NAME --local-dir DIR`), or set "
                "model.create_tiny=true for a tiny one",
            )
        )
    critic_path = cfg.learner.critic.model_path
    if critic_path and not (Path(critic_path).expanduser() / "config.json").is_file():
        out.append(
            Finding(
                key="learner.critic.model_path",
                problem=f"{shown(critic_path)} is not a Hugging Face model folder",
                fix="point it at a local model folder, or leave it empty to start from model.path",
            )
        )
    if cfg.trainer.resume_from_path:
        from learner.checkpoint import checkpoint_problem

        folder = Path(cfg.trainer.resume_from_path).expanduser()
        problem = checkpoint_problem(folder)
        if problem is not None:
            out.append(
                Finding(
                    key="trainer.resume_from_path",
                    problem=f"{shown(folder)} is not a complete fleetrl checkpoint ({problem})",
                    fix="give a <run dir>/checkpoints/step_N folder, or leave it empty",
                )
            )
    return out


def check_backend(cfg: RunConfig, probes: Probes, *, local: bool) -> list[Finding]:
    """The engines' and reward servers' server package at a tested release (and what its
    kind needs of the environment), CUDA, and a tensor-parallel size one node holds, where
    they run on this machine; ``trainer.device=cuda`` with CUDA."""
    if not local:
        return []
    from rollout_fleet.engine_kinds import engine_kind
    from rollout_fleet.rewards.fleet import reward_backend

    servers = []  # (key, kind, its tensor-parallel size, its key, what runs instead on a CPU)
    rollout = engine_kind(cfg.rollout.backend)
    if rollout.gpu_server:
        servers.append(("rollout.backend", rollout, cfg.rollout.tp_size, "rollout.gpus_per_engine",
                        f"{rollout.label} engines", "rollout.backend=embedded"))  # fmt: skip
    if cfg.reward.places_fleet:
        reward = engine_kind(reward_backend(cfg.reward.model, cfg.rollout))
        if reward.gpu_server:
            tp = max(1, int(cfg.reward.model.gpus_per_engine))
            servers.append(("reward.model.backend", reward, tp, "reward.model.gpus_per_engine",
                            f"{reward.label} reward servers", "reward.model.backend=embedded"))  # fmt: skip
    cuda = probes.cuda_devices() if servers or cfg.trainer.device == "cuda" else 0
    out = []
    for key, kind, tp, tp_key, what, instead in servers:
        version = probes.package_version(kind.package)
        for problem, fix in kind.load("preflight")(version, probes.env, instead):
            out.append(Finding(key=key, problem=problem, fix=fix))
        if not cuda:
            out.append(Finding(key=key, problem=f"{what} need CUDA; torch sees no CUDA device here",
                               fix=f"run on GPU nodes (--address), or {instead} on CPU"))  # fmt: skip
        elif tp > cuda:
            out.append(Finding(key=tp_key, problem=f"{what} of tensor-parallel size {tp} need {tp} GPUs of one node; this node has {cuda}",
                               fix=f"{tp_key} <= {cuda}, or run on larger GPU nodes (--address)"))  # fmt: skip
    if cfg.trainer.device == "cuda" and not cuda:
        out.append(
            Finding(
                key="trainer.device",
                problem="cuda, but torch sees no CUDA device here",
                fix="run on GPU nodes (--address), or trainer.device=cpu or auto",
            )
        )
    return out


def check_reward_urls(cfg: RunConfig, probes: Probes) -> list[Finding]:
    """``reward.model.urls`` are http URLs that answer; their key is set when they are off
    this machine (the folder itself: ``launcher.preflight_rewards``)."""
    model = cfg.reward.model
    out = []
    for i, url in enumerate(model.urls):
        parsed = urlparse(url)
        key = f"reward.model.urls[{i}]"
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            out.append(Finding(key=key, problem=f"{url!r} is not an http(s)://HOST:PORT URL", fix="give the server's base URL, e.g. http://10.0.0.5:30000"))  # fmt: skip
            continue
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        if not probes.reachable(parsed.hostname, port):
            out.append(Finding(key=key, problem=f"nothing answers at {parsed.hostname}:{port}", fix="start the reward server (`fleetrl engine --model RM_DIR`, or SGLang with --is-embedding), or fix the URL"))  # fmt: skip
        elif not probes.env.get(model.api_key_env):  # every server requires a key, loopback too
            out.append(Finding(key="reward.model.api_key_env", problem=f"${model.api_key_env} is empty: the client sends no key, and {url} requires one", fix=f"export {model.api_key_env}=<the key the server was started with>"))  # fmt: skip
    return out


def check_colocation(cfg: RunConfig, probes: Probes, *, local: bool) -> list[Finding]:
    """A co-located run on this machine: SGLang's memory saver is there, and every device
    holds the larger of its two phases (``launcher.plan_colocated``)."""
    if not (cfg.rollout.colocated and local):
        return []
    from launcher.plan import learner_on_gpu, model_shape
    from launcher.plan_colocated import colocated_phases
    from rollout_fleet.engine_kinds import engine_kind

    out = []
    kind = engine_kind(cfg.rollout.backend)
    needs = kind.colocation_package
    if needs and probes.package_version(needs) is None:
        out.append(
            Finding(
                key="rollout.placement",
                problem=f"co-located {kind.label} engines release memory with {needs}, "
                "and it is not installed",
                fix=f"pip install {needs}, or rollout.placement=disaggregated",
            )
        )
    on_gpu = learner_on_gpu(cfg)
    device_gb = (
        probes.cuda_memory_gb() if on_gpu else probes.host_memory_gb() / cfg.learner.num_ranks
    )
    try:
        shape = model_shape(cfg)
    except (OSError, KeyError, ValueError):
        return out  # no config.json yet: the model is built at start (plan it with fleetrl plan)
    if device_gb <= 0:
        return out  # no device seen here: check_backend says so
    phases = colocated_phases(cfg, shape, device_gb, on_gpu=on_gpu)
    if not phases.fits:
        where = "device" if on_gpu else "host share per rank"
        out.append(
            Finding(
                key="rollout.placement",
                problem=f"a co-located {where} must hold {phases.larger_gb:.1f} GiB while "
                f"{phases.larger} (+{phases.reserve_gb:.0f} GiB of CUDA contexts) and has "
                f"{device_gb:.1f} GiB",
                fix="lower rollout.mem_fraction_static, set rollout.colocate.offload_learner="
                "true, release the weights too (rollout.colocate.release), add learner ranks "
                "(see fleetrl plan), or rollout.placement=disaggregated",
            )
        )
    return out


def wandb_logged_in(env: Mapping[str, str]) -> bool:
    """WANDB_API_KEY, or a netrc entry for the wandb host (what ``wandb login`` writes)."""
    if env.get("WANDB_API_KEY"):
        return True
    host = urlparse(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or ""
    home = env.get("HOME") or os.path.expanduser("~")
    paths = [env["NETRC"]] if env.get("NETRC") else [os.path.join(home, ".netrc"), os.path.join(home, "_netrc")]  # fmt: skip
    for path in paths:
        try:
            entry = netrc.netrc(path).authenticators(host)
        except (OSError, netrc.NetrcParseError):
            continue
        if entry and entry[2]:
            return True
    return False


def check_tracking(cfg: RunConfig, probes: Probes) -> list[Finding]:
    out = []
    if cfg.logging.mlflow and probes.package_version("mlflow-skinny") is None and probes.package_version("mlflow") is None:  # fmt: skip
        out.append(
            Finding(
                key="logging.mlflow",
                problem="MLflow is not installed",
                fix='pip install ".[mlflow]" in fleetrl\'s checkout, or logging.mlflow=false',
            )
        )
    return out + check_wandb(cfg, probes)


def check_wandb(cfg: RunConfig, probes: Probes) -> list[Finding]:
    if not cfg.logging.wandb:
        return []
    if probes.package_version("wandb") is None:
        return [
            Finding(
                key="logging.wandb",
                problem="wandb is not installed",
                fix="pip install wandb, or logging.wandb=false",
            )
        ]
    if probes.env.get("WANDB_MODE", "").lower() in WANDB_OFF_MODES:
        return []
    if wandb_logged_in(probes.env):
        return []
    return [
        Finding(
            key="logging.wandb",
            problem="no wandb credentials (no WANDB_API_KEY, no netrc entry for the wandb host)",
            fix="run 'wandb login', or set WANDB_MODE=offline, or logging.wandb=false",
        )
    ]


def memo_sections(cfg: RunConfig, *names: str) -> dict[str, Any]:
    """The config sections a remembered check reads, as values (``launcher.preflight_memo``)."""
    out = {name: msgspec.to_builtins(getattr(cfg, name)) for name in names}
    if "data" in out:  # the seed picks no row a check reads (the rows read are in the key)
        out["data"].pop("seed", None)
    return out


def _passed(findings: list[Finding]) -> bool:
    return not any(f.fatal for f in findings)


def check_model_files(cfg: RunConfig, samples: list[Any]) -> tuple[list[Finding], list[Finding]]:
    """The tokenizer's rendering of ``samples`` and the model's family, each remembered by
    what it reads: a passed check of unchanged files, config and code is not run again."""
    model = [cfg.model.path]
    critic = [cfg.learner.critic.model_path] if cfg.learner.critic.model_path else []
    rendering, rendering_kept = remembered(
        "rendering",
        lambda: check_rendering(cfg, samples),
        inputs={**memo_sections(cfg, "model", "data", "rollout"), "rows": samples},
        folders=model,
        result_type=list[Finding],
        keep=_passed,
    )
    family, family_kept = remembered(
        "family",
        lambda: check_model_family(cfg),
        inputs=memo_sections(cfg, "model", "data", "rollout", "learner"),
        folders=model + critic,
        result_type=list[Finding],
        keep=_passed,
    )
    if rendering_kept or family_kept:
        log.info(
            "preflight: the model folder's checks as they passed before (same files, config "
            "and code; FLEETRL_CACHE_DIR=off checks again)"
        )
    return rendering, family


def estimate_parameters(cfg: RunConfig) -> int | None:
    """From config.json (or the tiny-model settings), else the weight files' size."""
    try:
        return ModelShape.from_model_config(cfg.model).params()
    except (OSError, ValueError, KeyError, TypeError):
        pass
    folder = Path(cfg.model.path)
    weights = list(folder.glob("*.safetensors")) if folder.is_dir() else []
    if weights:
        bytes_per = 2 if cfg.model.dtype in ("bfloat16", "float16") else 4
        return sum(p.stat().st_size for p in weights) // bytes_per
    return None


def checkpoints_on_disk(cfg: RunConfig) -> int:
    """Checkpoints the run holds at most: every one written, or the newest
    ``trainer.keep_checkpoints`` (at least 2: the fallback) when that bounds them."""
    tr = cfg.trainer
    if tr.save_freq == 0:
        return 0
    written = (tr.total_steps // tr.save_freq if tr.save_freq > 0 else 0) + 1
    return written if tr.keep_checkpoints == 0 else min(written, max(2, tr.keep_checkpoints))


def snapshots_on_disk(cfg: RunConfig) -> int:
    """Policy snapshots the run writes (``trainer.save_hf_freq``: step 0, every N, the last)."""
    tr = cfg.trainer
    if tr.save_hf_freq <= 0:
        return 0
    return 1 + tr.total_steps // tr.save_hf_freq + (1 if tr.total_steps % tr.save_hf_freq else 0)


def disk_needed(cfg: RunConfig, params: int) -> int:
    """Bytes the run will write: the checkpoints it keeps, its policy snapshots
    (``trainer.save_hf_freq``) and the rollout bank (at most ``buffer.bank_max_bytes``)."""
    tr = cfg.trainer
    critic = cfg.learner.critic.enabled == "on" or (
        cfg.learner.critic.enabled == "auto" and cfg.learner.algorithm.adv_estimator == "gae"
    )
    per_ckpt = params * CKPT_BYTES_PER_PARAM * (2 if critic else 1)
    per_snapshot = params * (2 if cfg.model.dtype in ("bfloat16", "float16") else 4)
    samples = tr.total_steps * cfg.data.train_batch_size * cfg.rollout.n
    per_sample = (
        cfg.data.max_prompt_length * BANK_BYTES_PER_PROMPT_TOKEN
        + cfg.rollout.max_new_tokens * BANK_BYTES_PER_RESPONSE_TOKEN  # at most; usually less
        + BANK_BYTES_PER_SAMPLE
    )
    bank = samples * per_sample
    if cfg.buffer.bank_max_bytes > 0:
        bank = min(bank, cfg.buffer.bank_max_bytes)
    written = checkpoints_on_disk(cfg) * per_ckpt + snapshots_on_disk(cfg) * per_snapshot + bank
    return int(written * DISK_HEADROOM)


def existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output_dir(cfg: RunConfig, probes: Probes) -> list[Finding]:
    out_dir = Path(cfg.trainer.output_dir)
    where = existing_ancestor(out_dir)
    error = probes.writable(where)
    if error is not None:
        return [
            Finding(
                key="trainer.output_dir",
                problem=f"{shown(out_dir)} cannot be written ({where}: {error})",
                fix="choose a writable folder: trainer.output_dir=PATH",
            )
        ]
    params, _ = remembered(
        "parameters",
        lambda: estimate_parameters(cfg),
        inputs=memo_sections(cfg, "model"),
        folders=[cfg.model.path],
        result_type=int | None,
    )
    if params is None:
        return []
    need, free = disk_needed(cfg, params), probes.disk_free(where)
    if free >= need:
        return []
    snapshots = f", {n} policy snapshots" if (n := snapshots_on_disk(cfg)) else ""
    return [
        Finding(
            key="trainer.output_dir",
            problem=(
                f"the run will write up to about {_gib(need)} ({checkpoints_on_disk(cfg)} "
                f"checkpoints of a {_count(params)}-parameter model{snapshots} plus the rollout "
                f"bank), {where} has {_gib(free)} free"
            ),
            fix=(
                "free disk there, choose another trainer.output_dir, save less often "
                "(trainer.save_freq, trainer.save_hf_freq), keep fewer checkpoints "
                "(trainer.keep_checkpoints) or bound the bank (buffer.bank_max_bytes)"
            ),
        )
    ]


def resolve_address(cfg: RunConfig, address: str | None, env: Mapping[str, str]) -> str:
    """The cluster the run joins, as launcher.placement resolves it ("" = a new local instance)."""
    return address or cfg.ray.address or env.get("RAY_ADDRESS") or ""


def check_cluster(
    cfg: RunConfig, address: str, probes: Probes
) -> tuple[list[Finding], list[Node] | None]:
    """Something answers at a pinned address, and Ray there lists its nodes."""
    key = "ray.address"
    fix = "start the cluster (ray start --head), or fix --address / ray.address / RAY_ADDRESS"
    hostport = address.removeprefix("ray://")
    if address != "auto" and ":" in hostport:
        host, _, port = hostport.rpartition(":")
        if not port.isdigit():
            return [Finding(key=key, problem=f"{address!r} is not HOST:PORT", fix=fix)], None
        if not probes.reachable(host.strip("[]"), int(port)):
            return [Finding(key=key, problem=f"nothing answers at {hostport}", fix=fix)], None
    try:
        return [], probes.cluster_nodes(address)
    except (ConnectionError, RuntimeError) as err:  # no cluster there, or not a usable one
        token = "; a cluster with token authentication also needs RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN or ~/.ray/auth_token)"  # fmt: skip
        return [Finding(key=key, problem=f"cannot join Ray at {address!r}: {_first_line(err)}", fix=fix + token)], None  # fmt: skip


def run_checks(
    cfg: RunConfig,
    address: str | None = None,
    probes: Probes | None = None,
    *,
    resume_with_changes: bool = False,
    after_quick_checks: Callable[[], None] | None = None,
) -> list[Finding]:
    """Every check; every finding (warnings included), in the order a user fixes them
    (``resume_with_changes``: the run folder may hold this run with other keys).

    The quick checks (files, config, resources, the run folder) run first; when none
    failed, ``after_quick_checks()`` is called before the slow ones (the tokenizer, the
    model family, the reward function, the output folder's room for a checkpoint: each
    imports transformers or user code), so that what can start beside them does
    (``launcher.early_ray``).
    """
    from launcher.run_folder import check_run_folder

    probes = probes or Probes()
    target = resolve_address(cfg, address, probes.env)
    rows = data_rows(cfg)
    model = check_model(cfg)
    reward_urls = check_reward_urls(cfg, probes)
    placement: list[Finding] = []
    if target:
        cluster_findings, nodes = check_cluster(cfg, target, probes)
        placement += cluster_findings
        if nodes is not None:
            placement += check_resources(cfg, nodes, local=False, autoscaling=cfg.ray.autoscaling)
    else:
        placement += check_resources(cfg, [local_node(cfg, probes)], local=True)
    placement += check_backend(cfg, probes, local=not target)
    placement += check_colocation(cfg, probes, local=not target)
    placement += check_tracking(cfg, probes)
    run_folder = check_run_folder(cfg, resume_with_changes)
    quick = rows.findings + model + reward_urls + placement + run_folder
    if after_quick_checks is not None and _passed(quick):
        after_quick_checks()
    rendering, family = check_model_files(cfg, rows.samples)
    rewards = check_rewards(cfg, rows.samples) + check_agent(cfg)
    output_dir = check_output_dir(cfg, probes)  # the checkpoint's size: the model's shape
    return (
        rows.findings + rendering + model + family + rewards + reward_urls + placement
        + output_dir + run_folder
    )  # fmt: skip


def ensure_ready(
    cfg: RunConfig,
    address: str | None = None,
    probes: Probes | None = None,
    config_errors: list[str] | None = None,
    resume_with_changes: bool = False,
    after_quick_checks: Callable[[], None] | None = None,
) -> None:
    """Run every check; log the warnings; raise ``PreflightFailed`` listing every failure
    (after ``config_errors``, the config's own rule errors, so that all come at once).
    ``after_quick_checks``: as ``run_checks`` calls it, and only without ``config_errors``."""
    findings = run_checks(
        cfg,
        address,
        probes,
        resume_with_changes=resume_with_changes,
        after_quick_checks=None if config_errors else after_quick_checks,
    )
    for f in findings:
        if not f.fatal:
            log.warning("%s", f.line())
    failures = [f for f in findings if f.fatal]
    if failures or config_errors:
        raise PreflightFailed(failures, config_errors)


def load_for_run(
    path: str | None, overrides: list[str]
) -> tuple[RunConfig, Callable[[str], str], list[str]]:
    """The config ``fleetrl train`` runs (training rules included) and how to name its keys;
    its rule errors come back as lines, not raised, so preflight reports them with its own.
    A config whose fields do not convert raises as before (nothing to check yet)."""
    try:
        cfg, name = load_run_config_named(path, overrides, training=True)
    except ConfigErrors as err:
        if err.config is None:
            raise
        return err.config, str, err.lines
    return cfg, name, []


def main(args: argparse.Namespace) -> int:
    """`fleetrl check`: the checks of `fleetrl train`, alone; exit 2 listing every failure."""
    cfg, name, config_errors = load_for_run(args.config, args.overrides)
    try:
        ensure_ready(
            cfg,
            args.address,
            config_errors=config_errors,
            resume_with_changes=args.resume_with_changes,
        )
    except PreflightFailed as err:
        raise err.named(name) from None
    target = resolve_address(cfg, args.address, os.environ)
    where = target or f"a local Ray instance ({_local_offer(cfg)})"
    print(f"fleetrl check: ready to run on {where}")  # the CLI's result, on stdout
    return 0


def _local_offer(cfg: RunConfig) -> str:
    """What this machine has for the run: its usable CPUs (affinity, cgroup quota) and GPUs."""
    probes = Probes()
    gpus = probes.cuda_devices() if needs_gpus(cfg) else 0
    return f"this machine has {_count(probes.cpu_count())} usable CPUs and {gpus} GPUs"
