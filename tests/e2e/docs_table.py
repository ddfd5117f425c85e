"""How the docs test runs each command the README and docs/*.md show.

Every command is classified here by its text (whitespace collapsed): run as written on
this CPU (``Run``, ``Export`` for a variable later commands read, ``Findings`` for a command whose job is to report what is missing),
kept running for the commands after it (``Serve``, ``Training``), run through
``fleetrl config show`` and ``fleetrl check`` on the same config and overrides because it
needs GPUs or a cluster (``ViaCheck``), or excluded with the reason and the test that
covers it instead (``Excluded``). A command in no table fails the docs test with its file
and line: that keeps what the docs show honest.

Placeholders a reader replaces with their own files (and ports, free ones on the test
machine) are substituted in SUBSTITUTIONS, in order; ``{name}`` is a fixture of the test.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GSM8K_7B = "configs/gsm8k_grpo_qwen2.5_7b.yaml"


@dataclass(frozen=True)
class Run:
    """Run as written; exit 0; the files it writes exist; the JSON it prints parses to
    ``prints_json`` (list or dict). ``reduced`` appends overrides to a heavy command whose
    text promises no figure from it (``why`` says so)."""

    writes: tuple[str, ...] = ()
    prints_json: type | None = None
    reduced: tuple[str, ...] = ()
    why: str = ""


@dataclass(frozen=True)
class Export:
    """``export NAME=...``: run as written; NAME, non-empty, holds for the commands after it
    (a reader's shell keeps it)."""

    name: str


@dataclass(frozen=True)
class Findings:
    """A command that reports what this machine lacks: run as written; exit 0, or exit 2
    with one-line ``fleetrl:`` findings; never a traceback."""


@dataclass(frozen=True)
class ViaCheck:
    """Needs GPUs or a cluster: ``fleetrl config show`` (exit 0) and ``fleetrl check`` (as
    Findings) on its config, ``--address`` and overrides."""


@dataclass(frozen=True)
class Serve:
    """A server: started in the background, its port waited for, stopped by pid after its
    block (and ``more_blocks`` blocks after it, whose commands use it)."""

    more_blocks: int = 0


@dataclass(frozen=True)
class Training:
    """A run the next commands of its block steer ("in two terminals"): started in the
    background, the next command waits for ``ready`` to exist; it must end with exit 0
    after the block."""

    ready: str


@dataclass(frozen=True)
class Excluded:
    """Not run: ``reason``; ``covered_by`` is the test (file or folder) that covers it."""

    reason: str
    covered_by: str


@dataclass(frozen=True)
class Prerequisite:
    """What the text tells the reader to have done before a command, run just before it."""

    command: str
    why: str
    unless: str = field(default="")  # a file that, when present, means it is done


SUBSTITUTIONS: list[tuple[str, str, str]] = [
    ("/data/gsm8k_raw", "{gsm8k_raw}", "a tiny raw GSM8K folder (train.jsonl, test.jsonl)"),
    ("--out /data/gsm8k", "--out runs/docs/gsm8k", "the Parquet folder it writes"),
    ("runs/gsm8k_grpo_qwen2.5_7b", "runs/docs/run", "the 7B run's folder: a short CPU demo run"),
    ("/models/my-policy", "runs/docs/my-policy", "the exported model's folder"),
    ("verl_ppo.yaml", "configs/verl_ppo_gsm8k.yaml", "a verl PPO config: the repo's own"),
    ("fleetrl_ppo.yaml", "runs/docs/fleetrl_ppo.yaml", "the translated file"),
    ("~/fleetrl/configs/", "configs/", "the repo on the cluster's head"),
    ("/home/ubuntu/fleetrl/configs/", "configs/", "the repo on the cluster's head"),
    (" /configs/", " configs/", "the configs ConfigMap in the KubeRay pod"),
    ("my_run.yaml", "configs/demo_cpu.yaml", "the reader's run config: the CPU demo's"),
    ("my_agent.py", "examples/agents/calculator_agent.py", "the reader's agent: the example"),
    ("--model rm ", "--model runs/demo/rm/reward_model ", "a reward model folder"),
    ("30001", "{port_classify}", "a free port"),
    ("30010", "{port_rm}", "a free port"),
]

_GPU = "needs GPUs or a Ray cluster"
_CLOUD = "needs a real cloud account and its cluster"
_SHARED_RAY = (
    "starts Ray daemons on the fixed port 6379 for other machines to join; on a shared test "
    "machine that port and `ray stop` belong to every user"
)

DOC_COMMANDS: dict[str, object] = {
    "export FLEETRL_API_KEY=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')": (
        Export("FLEETRL_API_KEY")
    ),
    "make demo": Run(writes=("runs/demo/run/summary.json",)),
    "make test": Excluded("it is the suite this test runs in", ".ci/run"),
    "fleetrl engine --model runs/demo/rm/reward_model --port 30010": Serve(),
    "fleetrl train --config configs/demo_rlhf_cpu.yaml trainer.output_dir=runs/demo/rlhf_urls "
    "'reward.model.urls=[http://127.0.0.1:30010]'": Run(
        writes=("runs/demo/rlhf_urls/summary.json",)
    ),
    "fleetrl data gsm8k --input /data/gsm8k_raw --out /data/gsm8k": Run(
        writes=("runs/docs/gsm8k/train.parquet", "runs/docs/gsm8k/test.parquet")
    ),
    f"fleetrl config show --config {GSM8K_7B}": Run(),
    f"fleetrl check --config {GSM8K_7B}": Findings(),
    f"fleetrl plan --config {GSM8K_7B}": Findings(),
    f"fleetrl train --config {GSM8K_7B} learner.optim.lr=2e-6 rollout.n=8": ViaCheck(),
    "fleetrl eval --config runs/gsm8k_grpo_qwen2.5_7b/config.yaml "
    "--snapshots runs/gsm8k_grpo_qwen2.5_7b": Run(),
    "fleetrl export --ckpt runs/gsm8k_grpo_qwen2.5_7b/checkpoints --out /models/my-policy": Run(
        writes=("runs/docs/my-policy/config.json",)
    ),
    "fleetrl check --config verl_ppo.yaml": Findings(),
    "fleetrl config show --config verl_ppo.yaml": Run(),
    "fleetrl train --config verl_ppo.yaml actor_rollout_ref.actor.optim.lr=2e-6": ViaCheck(),
    "fleetrl config from-verl verl_ppo.yaml --out fleetrl_ppo.yaml": Run(
        writes=("runs/docs/fleetrl_ppo.yaml",)
    ),
    "ray up configs/cluster/aws.yaml": Excluded(
        _CLOUD, "tests/unit/launcher/test_cluster_configs.py"
    ),
    "ray attach configs/cluster/aws.yaml": Excluded(
        _CLOUD, "tests/unit/launcher/test_cluster_configs.py"
    ),
    f"fleetrl check --config {GSM8K_7B} --address auto": Findings(),
    f"fleetrl train --config {GSM8K_7B} --address auto": ViaCheck(),
    f"fleetrl plan --config {GSM8K_7B} "
    "--model-config configs/models/Qwen2.5-7B-Instruct.config.json": Run(),
    "make format": Run(),
    "make docs": Run(writes=("docs/configuration.md", "docs/verl.md")),
    "make bench": Excluded(
        "every benchmark suite at its quick size: ~12 minutes of measurements on a 2-core "
        "machine, recorded in docs/benchmarks.md",
        "tests/integration/bench",
    ),
    "make demo-rm": Run(writes=("runs/demo/rm/reward_model/config.json",)),
    "make gpu-check": Excluded("needs a CUDA GPU", "tests/e2e/test_gpu_check_cpu.py"),
    "ray start --head --port=6379 --dashboard-host=127.0.0.1": Excluded(
        _SHARED_RAY, "tests/e2e/test_elastic_cluster.py"
    ),
    "ray start --address=HEAD_IP:6379 --resources='{\"rollout\": 8}'": Excluded(
        _SHARED_RAY, "tests/e2e/test_elastic_cluster.py"
    ),
    "ray start --address=HEAD_IP:6379 --resources='{\"learner\": 8}'": Excluded(
        _SHARED_RAY, "tests/e2e/test_elastic_cluster.py"
    ),
    f"fleetrl train --config {GSM8K_7B} --address auto rollout.backend=sglang "
    "rollout.num_engines=16 rollout.gpus_per_engine=1 learner.num_ranks=8 "
    "learner.gpus_per_rank=1": ViaCheck(),
    "ray exec --tmux configs/cluster/aws.yaml 'fleetrl train --config "
    "~/fleetrl/configs/gsm8k_grpo_qwen2.5_7b.yaml --address auto'": ViaCheck(),
    "ray attach configs/cluster/aws.yaml --tmux": Excluded(
        _CLOUD, "tests/unit/launcher/test_cluster_configs.py"
    ),
    "ray down configs/cluster/aws.yaml": Excluded(
        _CLOUD, "tests/unit/launcher/test_cluster_configs.py"
    ),
    "ray dashboard configs/cluster/aws.yaml": Excluded(
        _CLOUD, "tests/unit/launcher/test_cluster_configs.py"
    ),
    "ray job submit --address http://127.0.0.1:8265 -- fleetrl train --config "
    "/home/ubuntu/fleetrl/configs/gsm8k_grpo_qwen2.5_7b.yaml --address auto": ViaCheck(),
    "HEAD=$(kubectl get pod -n fleetrl -l ray.io/cluster=fleetrl,ray.io/node-type=head "
    "-o name)": Excluded(
        "needs a Kubernetes cluster with KubeRay", "tests/unit/launcher/test_cluster_configs.py"
    ),
    'kubectl exec -n fleetrl -it "$HEAD" -- fleetrl train --config '
    "/configs/gsm8k_grpo_qwen2.5_7b.yaml --address auto": ViaCheck(),
    "make demo-elastic": Run(writes=("runs/demo/elastic/elastic_demo.json",)),
    "fleetrl train --config configs/demo_cpu.yaml rollout.elastic=true rollout.max_engines=3 "
    "trainer.output_dir=runs/demo/elastic-by-hand": Training(
        ready="runs/demo/elastic-by-hand/fleet_control.json"
    ),
    "fleetrl fleet status --run runs/demo/elastic-by-hand": Run(),
    "fleetrl fleet scale --run runs/demo/elastic-by-hand --engines 3": Run(),
    "fleetrl fleet scale --run runs/demo/elastic-by-hand --engines 1": Run(),
    "ray exec --tmux configs/cluster/aws.yaml 'fleetrl train --config "
    "~/fleetrl/configs/gsm8k_grpo_qwen2.5_7b.yaml --address auto ray.autoscaling=true "
    "rollout.elastic=true rollout.num_engines=1 rollout.max_engines=4 "
    "rollout.gpus_per_engine=8 trainer.output_dir=/shared/runs/grow'": ViaCheck(),
    "ray exec configs/cluster/aws.yaml 'fleetrl fleet scale --run /shared/runs/grow "
    "--engines 4'": Excluded(_CLOUD, "tests/e2e/test_elastic_cluster.py"),
    "ray exec configs/cluster/aws.yaml 'fleetrl fleet status --run /shared/runs/grow'": (
        Excluded(_CLOUD, "tests/e2e/test_elastic_cluster.py")
    ),
    "fleetrl engine --model rm --port 30001": Serve(more_blocks=1),
    'curl -s localhost:30001/classify -H "Authorization: Bearer $FLEETRL_API_KEY" '
    "-H 'Content-Type: application/json' -d '{\"input_ids\": [[12, 13, 14], [20, 21]]}'": Run(
        prints_json=list
    ),
    'curl -s localhost:30001/classify -H "Authorization: Bearer $FLEETRL_API_KEY" '
    '-d \'{"text": "2 + 2 = 4"}\'': Run(prints_json=dict),
    "fleetrl rm train --config configs/demo_rm_cpu.yaml": Run(
        writes=("runs/demo/rm/reward_model/config.json",),
        reduced=("trainer.total_steps=4", "trainer.test_freq=4", "trainer.save_freq=4"),
        why="its text promises the folder it writes, not a figure; `make demo-rm` ran it whole",
    ),
    "make device-bundle": Excluded(
        "downloads ~28 MiB of Python 3.12 wheels from PyPI",
        "tests/integration/scripts/test_device_bundle.py",
    ),
    "python3.12 -m venv /tmp/dev312 && /tmp/dev312/bin/pip install torch==2.11.0 "
    "transformers==5.17.0 peft safetensors accelerate pyarrow numpy pyyaml requests aiohttp "
    "psutil matplotlib packaging click filelock msgpack protobuf attrs typing-extensions "
    "httpx": Excluded(
        "downloads torch for Python 3.12 (GBs) to simulate the GPU machine",
        "tests/e2e/test_gpu_check_cpu.py",
    ),
    "PYTHON=/tmp/dev312/bin/python DEVICE=cpu OUT=/tmp/sim/out BUDGET_S=2400 "
    "bash scripts/device/gpu_check.sh": Excluded(
        "the GPU check at its full 40-minute budget, in the Python 3.12 venv above",
        "tests/e2e/test_gpu_check_cpu.py",
    ),
}

_SLURM = "needs a Slurm cluster"
DOC_COMMANDS.update(
    {
        "make wheel": Run(writes=("dist",)),
        "make demo-agent": Run(
            reduced=(
                'AGENT_BUILD_ARGS="--steps 20 --train-size 64 --test-size 8"',
                'OVERRIDES="trainer.total_steps=2 trainer.test_freq=2 data.val_max_samples=8"',
            ),
            why="the whole demo is a 1500-step warm start and 30 GRPO steps (13 min on 2 "
            "cores); its figures are docs/benchmarks.md's; this runs the target's path",
        ),
        "make image": Excluded("builds a container image", "tests/cluster/test_image.py"),
        "docker tag fleetrl:0.1.0 REGISTRY/fleetrl:0.1.0 && docker push "
        "REGISTRY/fleetrl:0.1.0": Excluded(
            "needs a container registry", "tests/cluster/test_image.py"
        ),  # fmt: skip
        "docker run --rm --shm-size=8g fleetrl:0.1.0 fleetrl train --config configs/demo_cpu.yaml "
        "trainer.output_dir=runs/demo/run": Excluded(
            "needs the image `make image` builds", "tests/cluster/test_image.py"
        ),
        "kubectl create namespace fleetrl": Excluded(
            "needs a Kubernetes cluster", "tests/unit/launcher/test_cluster_configs.py"
        ),
        "kubectl apply -n fleetrl -f configs/cluster/kuberay.yaml": Excluded(
            "needs a Kubernetes cluster with KubeRay", "tests/unit/launcher/test_cluster_configs.py"
        ),
        "fleetrl train --config my_run.yaml rollout.agent.entrypoint=my_agent.py:run": ViaCheck(),
        "sbatch -N 4 --gpus-per-node=8 scripts/slurm/fleetrl.sbatch --config "
        "configs/gsm8k_grpo_qwen2.5_7b.yaml rollout.backend=sglang rollout.num_engines=16 "
        "learner.num_ranks=8": ViaCheck(),
        "sbatch -N 4 --gpus-per-node=8 scripts/slurm/fleetrl.sbatch --config "
        "configs/gsm8k_grpo_qwen2.5_7b.yaml": ViaCheck(),
        "FLEETRL_LEARNER_NODES=2 FLEETRL_REWARD_NODES=1 sbatch -N 9 --gpus-per-node=8 "
        "scripts/slurm/fleetrl.sbatch --config my_run.yaml learner.num_ranks=16 "
        "rollout.num_engines=40 reward.model.num_engines=8": ViaCheck(),
        "FLEETRL_LEARNER_NODES=node2 FLEETRL_ROLLOUT_NODES=node2 sbatch -N 2 -w node1,node2 "
        "scripts/slurm/fleetrl.sbatch --config configs/demo_cpu.yaml": ViaCheck(),
        "squeue --me": Excluded(_SLURM, "tests/cluster/test_slurm_job.py"),
        "tail -f fleetrl-<jobid>.out": Excluded(_SLURM, "tests/cluster/test_slurm_job.py"),
        "scancel <jobid>": Excluded(_SLURM, "tests/cluster/test_slurm_job.py"),
    }
)

# Before a command: what its text tells the reader to have done first.
PREREQUISITES: dict[str, Prerequisite] = {
    "fleetrl eval --config runs/gsm8k_grpo_qwen2.5_7b/config.yaml "
    "--snapshots runs/gsm8k_grpo_qwen2.5_7b": Prerequisite(
        "fleetrl train --config configs/demo_cpu.yaml trainer.output_dir=runs/docs/run "
        "trainer.total_steps=2 trainer.save_hf_freq=2 trainer.save_freq=2 trainer.test_freq=-1 "
        "trainer.val_before_train=false",
        "the 7B run the line above trains (on GPUs): a two-step CPU demo run in its place, "
        "with its policy snapshots and checkpoints",
    ),
    "fleetrl engine --model runs/demo/rm/reward_model --port 30010": Prerequisite(
        "fleetrl rm train --config configs/demo_rm_cpu.yaml trainer.total_steps=4 "
        "trainer.test_freq=4 trainer.save_freq=4",
        "the README's text has the reader run `make demo-rm` (run whole further on) first",
        unless="runs/demo/rm/reward_model/config.json",
    ),
}


def key(text: str) -> str:
    """A command's text as the tables spell it: whitespace collapsed."""
    return " ".join(text.split())
