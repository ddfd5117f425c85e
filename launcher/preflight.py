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
- data files and the model folder (what ``launcher.prepare`` cannot make);
- resources: the learner group's bundles and the engines against what Ray offers,
  per node (a rank or an engine fits on one node or not at all). Locally: the
  instance ``fleetrl train`` would start (this machine's CPUs, the GPUs torch
  sees); on a cluster: ``ray.nodes()``. With ``ray.autoscaling`` a shortfall is a
  warning (nodes may still come) and ``ray.placement_timeout_s`` bounds the wait;
- the rollout backend where engines run locally: SGLang installed at a tested
  version, CUDA present; ``trainer.device=cuda`` with CUDA;
- tracking: wandb logged in, offline, or off;
- the run directory: writable, with free disk for the checkpoints and the bank;
- the Ray address the run pins: something answers there.

Left out: the SGLang version on remote rollout nodes (on a cluster the node
resources Ray reports stand for them); GPU memory per device.
"""

from __future__ import annotations

import argparse
import json
import math
import netrc
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import msgspec

from fleetrl.log import get_logger
from launcher.config import RunConfig, load_run_config
from launcher.placement import LOCAL_CUSTOM_UNITS, requested_cpus
from rollout_fleet.actors import NODE_MARKER_SHARE
from rollout_fleet.sglang_version import TESTED_SGLANG

log = get_logger(__name__)

# The SGLang releases fleetrl is tested against (one definition, shared with the launcher's gate).
SGLANG_SUPPORTED = TESTED_SGLANG

CKPT_BYTES_PER_PARAM = 12  # fp32 master weights + AdamW's two fp32 moments (DCP shards)
# the rollout bank, per sample: prompt token ids; per response token an id, a behaviour
# logprob and a version; per sample its metadata, score and metrics (measured ~0.6 KiB)
BANK_BYTES_PER_PROMPT_TOKEN = 4
BANK_BYTES_PER_RESPONSE_TOKEN = 12
BANK_BYTES_PER_SAMPLE = 1024
DISK_HEADROOM = 1.1  # segments, metrics, plots, hf/ copies in checkpoints
ADDRESS_TIMEOUT_S = 3.0
WANDB_OFF_MODES = ("offline", "disabled", "dryrun")


class Finding(msgspec.Struct, frozen=True, kw_only=True):
    """One unmet precondition: the config key (or variable) it concerns, what is wrong, the fix.

    ``fatal=False`` findings are warnings: logged, the run goes on (an autoscaling cluster
    may still add the nodes).
    """

    key: str
    problem: str
    fix: str
    fatal: bool = True

    def line(self) -> str:
        kind = "preflight error" if self.fatal else "preflight warning"
        return f"{kind} at {self.key}: {self.problem} ({self.fix})"


class Node(msgspec.Struct, frozen=True):
    """A Ray node as the checks see it: a name for messages and its resource totals."""

    name: str
    resources: dict[str, float]


class PreflightFailed(ValueError):
    """Raised by ``ensure_ready``; the CLI prints ``lines`` (one per finding) and exits 2."""

    def __init__(self, findings: list[Finding]):
        self.findings = findings
        self.lines = [f.line() for f in findings]
        super().__init__("; ".join(self.lines))


@dataclass
class Probes:
    """What the checks ask the machine or cluster; tests replace any of these with fakes."""

    env: Mapping[str, str] = field(default_factory=lambda: os.environ)
    cpu_count: Callable[[], int] = lambda: os.cpu_count() or 1
    cuda_devices: Callable[[], int] = lambda: _torch_cuda_devices()
    package_version: Callable[[str], str | None] = lambda name: _package_version(name)
    disk_free: Callable[[Path], int] = lambda path: shutil.disk_usage(path).free
    writable: Callable[[Path], str | None] = lambda path: _try_write(path)
    reachable: Callable[[str, int], bool] = lambda host, port: _tcp_reachable(host, port)
    cluster_nodes: Callable[[str], list[Node]] = lambda address: _ray_nodes(address)


# ---- the checks -----------------------------------------------------------------------------


def check_data(cfg: RunConfig) -> list[Finding]:
    if cfg.data.synth_task:
        return []  # launcher.prepare generates missing files
    out = []
    for key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):  # fmt: skip
        missing = [f for f in files if not Path(f).is_file()]
        if missing:
            out.append(
                Finding(
                    key=key,
                    problem=f"file not found: {missing[0]}",
                    fix="make it with 'fleetrl data gsm8k' or 'fleetrl data synth', or set data.synth_task",
                )
            )
    return out


def check_model(cfg: RunConfig) -> list[Finding]:
    if (Path(cfg.model.path) / "config.json").is_file() or cfg.model.create_tiny:
        return []
    return [
        Finding(
            key="model.path",
            problem=f"{cfg.model.path} is not a Hugging Face model folder",
            fix="point it at a local model folder, or set model.create_tiny=true for a tiny one",
        )
    ]


def learner_bundle(cfg: RunConfig) -> dict[str, float]:
    """One learner rank's bundle, as launcher.placement asks for it."""
    bundle = {"CPU": cfg.learner.cpus_per_rank, cfg.ray.learner_resource: 1.0}
    if cfg.learner.gpus_per_rank:
        bundle["GPU"] = cfg.learner.gpus_per_rank
    return bundle


def engine_demand(cfg: RunConfig) -> dict[str, float]:
    """One engine actor's resources, as rollout_fleet.actors asks for them."""
    demand = {"CPU": cfg.rollout.cpus_per_engine, cfg.ray.rollout_resource: NODE_MARKER_SHARE}
    if cfg.rollout.gpus_per_engine:
        demand["GPU"] = cfg.rollout.gpus_per_engine
    return demand


def needs_gpus(cfg: RunConfig) -> bool:
    return bool(cfg.learner.gpus_per_rank or cfg.rollout.gpus_per_engine)


def local_node(cfg: RunConfig, probes: Probes) -> Node:
    """The node a local instance started by launcher.placement.init_ray would offer."""
    cpus = cfg.ray.num_cpus or max(probes.cpu_count(), math.ceil(requested_cpus(cfg)))
    gpus = cfg.ray.num_gpus or (probes.cuda_devices() if needs_gpus(cfg) else 0)
    return Node(
        "the local Ray instance",
        {
            "CPU": float(cpus),
            "GPU": float(gpus),
            cfg.ray.rollout_resource: float(LOCAL_CUSTOM_UNITS),
            cfg.ray.learner_resource: float(LOCAL_CUSTOM_UNITS),
        },
    )


def _fits(demand: Mapping[str, float], free: Mapping[str, float]) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in demand.items())


def place(demand: Mapping[str, float], count: int, free: list[dict[str, float]]) -> int:
    """First-fit ``count`` copies of ``demand`` onto ``free`` (updated in place); how many fit."""
    placed = 0
    for _ in range(count):
        node = next((f for f in free if _fits(demand, f)), None)
        if node is None:
            break
        for k, v in demand.items():
            node[k] -= v
        placed += 1
    return placed


def shortfall(
    what: str,
    unit: str,
    demand: Mapping[str, float],
    count: int,
    nodes: list[Node],
    free: list[dict[str, float]],
    keys: Mapping[str, str],
    fixes: Mapping[str, str],
) -> Finding | None:
    """Place ``count`` copies of ``demand``; a Finding naming the resource that runs out, if any."""
    before = [dict(f) for f in free]
    placed = place(demand, count, free)
    if placed == count:
        return None
    marker = next(k for k in demand if k not in ("CPU", "GPU"))
    marked = [(n, f) for n, f in zip(nodes, before, strict=True) if f.get(marker, 0.0) > 0]
    shape = ", ".join(f"{k} {_num(v)}" for k, v in demand.items() if k != marker)
    need = f"{what} needs {count} {unit if count != 1 else unit[:-1]} × {{{shape}}} on '{marker}' nodes, {placed} fit"
    if not marked:
        return Finding(
            key=keys["marker"],
            problem=f"{need}: no node offers the '{marker}' resource",
            fix=fixes["marker"],
        )
    # the binding resource: the one whose per-node supply runs out first
    limits = {
        k: sum(int((f.get(k, 0.0) + 1e-9) // v) for _, f in marked)
        for k, v in demand.items()
        if v > 0
    }
    binding = min(limits, key=lambda k: limits[k])
    largest = max(f.get(binding, 0.0) for _, f in marked)
    if 0 < largest < demand[binding]:  # a rank or an engine never spans nodes
        short = (
            f"one needs {_num(demand[binding])} {binding} on one node, "
            f"the largest '{marker}' node has {_num(largest)}"
        )
    else:
        total = sum(f.get(binding, 0.0) for _, f in marked)
        short = f"{_num(demand[binding] * count)} {binding} needed, {_num(total)} there"
    offers = "; ".join(
        f"{n.name} has {', '.join(f'{k} {_num(n.resources.get(k, 0.0))}' for k in ('GPU', 'CPU'))}"
        for n, _ in marked[:3]
    ) + ("; ..." if len(marked) > 3 else "")
    kind = binding if binding in ("CPU", "GPU") else "marker"
    return Finding(
        key=keys[kind],
        problem=f"{need}: not enough {binding} ({short}; {offers})",
        fix=fixes[kind],
    )


def check_resources(
    cfg: RunConfig,
    nodes: list[Node],
    *,
    local: bool,
    autoscaling: bool = False,
    parts: tuple[str, ...] = ("learner", "rollout"),
) -> list[Finding]:
    """The learner group, then the engines, placed per node on what ``nodes`` offer."""
    free = [dict(n.resources) for n in nodes]
    found = []
    groups = (
        ("the learner group", "ranks", learner_bundle(cfg), cfg.learner.num_ranks, "learner", "rank"),
        ("the rollout fleet", "engines", engine_demand(cfg), cfg.rollout.num_engines, "rollout", "engine"),
    )  # fmt: skip
    for what, unit, demand, count, section, per in groups:
        if section not in parts:
            continue
        marker = cfg.ray.learner_resource if section == "learner" else cfg.ray.rollout_resource
        count_key = "learner.num_ranks" if section == "learner" else "rollout.num_engines"
        keys = {
            "GPU": f"{section}.gpus_per_{per}",
            "CPU": f"{section}.cpus_per_{per}",
            "marker": f"ray.{section}_resource",
        }
        if local:
            fixes = {
                "GPU": f"run on GPU machines (--address), set ray.num_gpus if Ray misses GPUs, or {keys['GPU']}=0 for a CPU run",  # fmt: skip
                "CPU": f"raise ray.num_cpus (0 = every core), or lower {keys['CPU']} or {count_key}",
                "marker": f"lower {count_key} (a local instance offers {LOCAL_CUSTOM_UNITS} '{marker}')",
            }
        else:
            later = "" if autoscaling else "; set ray.autoscaling=true if the cluster starts nodes on demand"  # fmt: skip
            fixes = {
                k: f"add '{marker}' nodes with more {k} (ray start --resources '{{\"{marker}\": N}}'), or lower {keys[k]} or {count_key}{later}"  # fmt: skip
                for k in ("GPU", "CPU")
            }
            fixes["marker"] = (
                f"start {section} nodes with ray start --resources '{{\"{marker}\": N}}', "
                f"or set ray.{section}_resource to the name your nodes declare{later}"
            )
        finding = shortfall(what, unit, demand, count, nodes, free, keys, fixes)
        if finding is not None:
            found.append(msgspec.structs.replace(finding, fatal=not autoscaling))
    return found


def check_backend(cfg: RunConfig, probes: Probes, *, local: bool) -> list[Finding]:
    """SGLang at a tested version and CUDA, where engines (and the learner) run on this machine."""
    if not local:
        return []
    out = []
    cuda = None
    if cfg.rollout.backend == "sglang":
        from packaging.specifiers import SpecifierSet

        version = probes.package_version("sglang")
        if version is None:
            out.append(
                Finding(
                    key="rollout.backend",
                    problem="backend sglang, but SGLang is not installed",
                    fix='pip install "fleetrl[sglang]" on the rollout machines, or rollout.backend=embedded',
                )
            )
        elif version not in SpecifierSet(SGLANG_SUPPORTED):
            out.append(
                Finding(
                    key="rollout.backend",
                    problem=f"SGLang {version} is installed; fleetrl is tested with sglang{SGLANG_SUPPORTED}",
                    fix=f'pip install "sglang[srt]{SGLANG_SUPPORTED}" (or "fleetrl[sglang]")',
                )
            )
        cuda = probes.cuda_devices()
        if not cuda:
            out.append(
                Finding(
                    key="rollout.backend",
                    problem="SGLang engines need CUDA; torch sees no CUDA device here",
                    fix="run on GPU nodes (--address), or rollout.backend=embedded on CPU",
                )
            )
    if cfg.trainer.device == "cuda":
        cuda = probes.cuda_devices() if cuda is None else cuda
        if not cuda:
            out.append(
                Finding(
                    key="trainer.device",
                    problem="cuda, but torch sees no CUDA device here",
                    fix="run on GPU nodes (--address), or trainer.device=cpu or auto",
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


def count_parameters(model_config: Mapping[str, object]) -> int:
    """Parameters of a Llama/Qwen2-shaped decoder from its Hugging Face config.json."""
    h = int(model_config["hidden_size"])  # type: ignore[arg-type]
    layers = int(model_config["num_hidden_layers"])  # type: ignore[arg-type]
    vocab = int(model_config.get("vocab_size", 32000))  # type: ignore[arg-type]
    inter = int(model_config.get("intermediate_size", 4 * h))  # type: ignore[arg-type]
    heads = int(model_config.get("num_attention_heads", 1))  # type: ignore[arg-type]
    kv = int(model_config.get("num_key_value_heads", heads))  # type: ignore[arg-type]
    head_dim = int(model_config.get("head_dim") or h // heads)  # type: ignore[arg-type]
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
    per_layer = attn + 3 * h * inter + 2 * h
    embed = vocab * h * (1 if model_config.get("tie_word_embeddings") else 2)
    return layers * per_layer + embed + h


def estimate_parameters(cfg: RunConfig) -> int | None:
    """From config.json, else the weight files' size, else the tiny-model settings."""
    folder = Path(cfg.model.path)
    try:
        return count_parameters(json.loads((folder / "config.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    weights = [p for p in folder.glob("*.safetensors")] if folder.is_dir() else []
    if weights:
        bytes_per = 2 if cfg.model.dtype in ("bfloat16", "float16") else 4
        return sum(p.stat().st_size for p in weights) // bytes_per
    if cfg.model.create_tiny:
        t = cfg.model.tiny
        return count_parameters(
            {
                "hidden_size": t.hidden,
                "num_hidden_layers": t.layers,
                "vocab_size": 1024,
                "num_attention_heads": t.heads,
            }  # fmt: skip
        )
    return None


def disk_needed(cfg: RunConfig, params: int) -> int:
    """Bytes the run will write: every checkpoint kept (none are pruned) plus the rollout bank."""
    tr = cfg.trainer
    checkpoints = (tr.total_steps // tr.save_freq if tr.save_freq > 0 else 0) + 1
    critic = cfg.learner.critic.enabled == "on" or (
        cfg.learner.critic.enabled == "auto" and cfg.learner.algorithm.adv_estimator == "gae"
    )
    per_ckpt = params * CKPT_BYTES_PER_PARAM * (2 if critic else 1)
    samples = tr.total_steps * cfg.data.train_batch_size * cfg.rollout.n
    per_sample = (
        cfg.data.max_prompt_length * BANK_BYTES_PER_PROMPT_TOKEN
        + cfg.rollout.max_new_tokens * BANK_BYTES_PER_RESPONSE_TOKEN  # at most; usually less
        + BANK_BYTES_PER_SAMPLE
    )
    bank = samples * per_sample
    return int((checkpoints * per_ckpt + bank) * DISK_HEADROOM)


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
                problem=f"{out_dir} cannot be written ({where}: {error})",
                fix="choose a writable folder: trainer.output_dir=PATH",
            )
        ]
    params = estimate_parameters(cfg)
    if params is None:
        return []
    need, free = disk_needed(cfg, params), probes.disk_free(where)
    if free >= need:
        return []
    checkpoints = (
        cfg.trainer.total_steps // cfg.trainer.save_freq if cfg.trainer.save_freq > 0 else 0
    ) + 1
    return [
        Finding(
            key="trainer.output_dir",
            problem=(
                f"the run will write up to about {_gib(need)} ({checkpoints} checkpoints of a "
                f"{_count(params)}-parameter model plus the rollout bank), {where} has {_gib(free)} free"
            ),
            fix="free disk there, choose another trainer.output_dir, or save less often (trainer.save_freq)",
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
    cfg: RunConfig, address: str | None = None, probes: Probes | None = None
) -> list[Finding]:
    """Every check; every finding (warnings included), in the order a user fixes them."""
    probes = probes or Probes()
    target = resolve_address(cfg, address, probes.env)
    findings = check_data(cfg) + check_model(cfg)
    if target:
        cluster_findings, nodes = check_cluster(cfg, target, probes)
        findings += cluster_findings
        if nodes is not None:
            findings += check_resources(cfg, nodes, local=False, autoscaling=cfg.ray.autoscaling)
    else:
        findings += check_resources(cfg, [local_node(cfg, probes)], local=True)
    findings += check_backend(cfg, probes, local=not target)
    findings += check_tracking(cfg, probes)
    findings += check_output_dir(cfg, probes)
    return findings


def ensure_ready(cfg: RunConfig, address: str | None = None, probes: Probes | None = None) -> None:
    """Run every check; log the warnings; raise ``PreflightFailed`` listing every failure."""
    findings = run_checks(cfg, address, probes)
    for f in findings:
        if not f.fatal:
            log.warning("%s", f.line())
    failures = [f for f in findings if f.fatal]
    if failures:
        raise PreflightFailed(failures)


def main(args: argparse.Namespace) -> int:
    """`fleetrl check`: the checks of `fleetrl train`, alone; exit 2 listing every failure."""
    cfg = load_run_config(args.config, args.overrides)
    ensure_ready(cfg, args.address)
    target = resolve_address(cfg, args.address, os.environ) or "a local Ray instance"
    print(f"fleetrl check: ready to run on {target}")  # the CLI's result, on stdout
    return 0


# ---- real probes ----------------------------------------------------------------------------


def _torch_cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _try_write(folder: Path) -> str | None:
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as err:
        return err.strerror or str(err)


def _tcp_reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=ADDRESS_TIMEOUT_S):
            return True
    except OSError:
        return False


def _ray_nodes(address: str) -> list[Node]:
    """Join the cluster, read its live nodes, leave (the run joins again when it starts)."""
    import ray

    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    try:
        return [
            Node(n.get("NodeManagerAddress") or n["NodeID"][:8], dict(n.get("Resources", {})))
            for n in ray.nodes()
            if n.get("Alive")
        ]
    finally:
        ray.shutdown()


def _num(value: float) -> str:
    return f"{value:g}"


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__
