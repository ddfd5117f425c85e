"""Preflight: each check against a fake environment, and the 7B GPU config on this CPU machine.

Every probe (resources, environment variables, disk, package versions, the cluster's
nodes) is injected, so these run in milliseconds and see no real GPU, wandb login or disk.
The last test runs the CLI as a new user would: the shipped 7B GPU config with a local
GSM8K file and a tiny model exits 2 within seconds, one line per unmet precondition.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetrl.data.schema import write_rows
from fleetrl.models.tiny import build_tokenizer
from launcher.config import load_run_config
from launcher.preflight import (
    PreflightFailed,
    Probes,
    check_backend,
    check_cluster,
    check_model,
    check_output_dir,
    check_tracking,
    ensure_ready,
    run_checks,
)
from launcher.preflight_findings import Node
from launcher.preflight_resources import check_resources, local_node
from learner.memory import ModelShape

REPO = Path(__file__).resolve().parents[3]
GIB = 2**30


def _probes(**over) -> Probes:
    base = dict(
        env={"HOME": "/nonexistent-home"},
        cpu_count=lambda: 8,
        cuda_devices=lambda: 0,
        package_version=lambda name: {"sglang": "0.5.23", "wandb": "0.31.0"}.get(name),
        disk_free=lambda path: 1000 * GIB,
        writable=lambda path: None,
        reachable=lambda host, port: True,
        cluster_nodes=lambda address: [],
    )
    base.update(over)
    return Probes(**base)


def _cfg(tmp_path, *overrides):
    data = tmp_path / "train.parquet"
    if not data.exists():
        write_rows([{"data_source": "synth/add", "prompt": "3+5=", "reward_model": {"style": "rule", "ground_truth": "8"}}], data)  # fmt: skip
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    if not (model / "tokenizer.json").exists():
        build_tokenizer().save_pretrained(model)
    (model / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "vocab_size": 100,
                "num_attention_heads": 4,
                "intermediate_size": 256,
            }  # fmt: skip
        )
    )
    return load_run_config(
        None,
        [
            f"data.train_files=[{data}]",
            "data.val_files=[]",
            f"model.path={model}",
            f"trainer.output_dir={tmp_path / 'run'}",
            *overrides,
        ],
    )


GPU_RUN = (
    "learner.num_ranks=2",
    "learner.gpus_per_rank=1",
    "rollout.num_engines=2",
    "rollout.gpus_per_engine=2",
)


# ---- resources ----------------------------------------------------------------------------


def test_cpu_config_fits_the_local_instance_even_on_fewer_cores(tmp_path):
    cfg = _cfg(tmp_path, "learner.num_ranks=4", "learner.cpus_per_rank=4")
    node = local_node(cfg, _probes(cpu_count=lambda: 2))
    # 4 ranks x 4 CPUs + 1 engine: the local instance oversubscribes, as init_ray does
    assert node.resources["CPU"] == 17
    assert check_resources(cfg, [node], local=True) == []


def test_missing_gpus_on_the_local_instance_name_the_keys_and_the_fix(tmp_path):
    cfg = _cfg(tmp_path, *GPU_RUN)
    found = check_resources(cfg, [local_node(cfg, _probes())], local=True)
    assert [f.key for f in found] == ["learner.gpus_per_rank", "rollout.gpus_per_engine"]
    assert "needs 2 ranks" in found[0].problem and "not enough GPU" in found[0].problem
    assert "2 GPU needed, 0 there" in found[0].problem
    assert "4 GPU needed, 0 there" in found[1].problem
    assert "learner.gpus_per_rank=0" in found[0].fix


def test_local_gpus_come_from_torch_or_ray_num_gpus(tmp_path):
    cfg = _cfg(tmp_path, *GPU_RUN)
    assert check_resources(cfg, [local_node(cfg, _probes(cuda_devices=lambda: 6))], local=True) == []  # fmt: skip
    cfg = _cfg(tmp_path, *GPU_RUN, "ray.num_gpus=6")
    assert check_resources(cfg, [local_node(cfg, _probes())], local=True) == []


def test_engine_and_learner_share_the_gpus_of_one_local_node(tmp_path):
    cfg = _cfg(tmp_path, *GPU_RUN)  # 2 learner GPUs + 4 engine GPUs
    found = check_resources(cfg, [local_node(cfg, _probes(cuda_devices=lambda: 5))], local=True)
    assert [f.key for f in found] == ["rollout.gpus_per_engine"]
    assert "1 fit" in found[0].problem


def test_a_bundle_fits_per_node_not_across_nodes(tmp_path):
    cfg = _cfg(tmp_path, "rollout.num_engines=1", "rollout.gpus_per_engine=8")
    nodes = [Node(f"node {i}", {"CPU": 32, "GPU": 4, "rollout": 4}) for i in range(2)]
    nodes.append(Node("learner node", {"CPU": 8, "learner": 1}))
    found = check_resources(cfg, nodes, local=False)
    assert [f.key for f in found] == ["rollout.gpus_per_engine"]
    assert "one needs 8 GPU on one node, the largest 'rollout' node has 4" in found[0].problem
    assert "ray.autoscaling=true" in found[0].fix


def test_cluster_without_the_learner_resource_names_it(tmp_path):
    cfg = _cfg(tmp_path)
    nodes = [Node("node a", {"CPU": 8, "rollout": 1})]
    found = check_resources(cfg, nodes, local=False)
    assert [f.key for f in found] == ["ray.learner_resource"]
    assert "no node offers the 'learner' resource" in found[0].problem
    assert """ray start --resources '{"learner": N}'""" in found[0].fix


def test_cluster_cpus_short_per_node(tmp_path):
    cfg = _cfg(tmp_path, "learner.num_ranks=3", "learner.cpus_per_rank=4")
    nodes = [Node("node a", {"CPU": 8, "learner": 8}), Node("node b", {"CPU": 2, "rollout": 8})]
    found = check_resources(cfg, nodes, local=False)
    assert [f.key for f in found] == ["learner.cpus_per_rank"]
    assert "2 fit" in found[0].problem


def test_autoscaling_cluster_makes_shortfalls_warnings(tmp_path):
    cfg = _cfg(tmp_path, *GPU_RUN, "ray.autoscaling=true")
    nodes = [Node("head", {"CPU": 8})]
    probes = _probes(cluster_nodes=lambda address: nodes)
    findings = run_checks(cfg, "10.0.0.1:6379", probes)
    assert findings and not any(f.fatal for f in findings)
    ensure_ready(cfg, "10.0.0.1:6379", probes)  # warnings only: no raise


# ---- address --------------------------------------------------------------------------------


def test_unreachable_address_is_one_finding(tmp_path):
    cfg = _cfg(tmp_path)
    found, nodes = check_cluster(cfg, "10.9.9.9:6379", _probes(reachable=lambda h, p: False))
    assert nodes is None
    assert [f.key for f in found] == ["ray.address"]
    assert "nothing answers at 10.9.9.9:6379" in found[0].problem


def test_no_cluster_for_auto_is_one_finding(tmp_path):
    def no_cluster(address):
        raise ConnectionError("Could not find any running Ray instance.\nmore")

    found, _ = check_cluster(_cfg(tmp_path), "auto", _probes(cluster_nodes=no_cluster))
    assert found[0].key == "ray.address" and "Could not find any running Ray" in found[0].problem


def test_address_from_ray_address_env_joins_the_cluster(tmp_path):
    seen = []
    probes = _probes(
        env={"RAY_ADDRESS": "10.0.0.2:6379"},
        cluster_nodes=lambda a: (
            seen.append(a) or [Node("n", {"CPU": 8, "rollout": 1, "learner": 1})]
        ),  # fmt: skip
    )
    assert run_checks(_cfg(tmp_path), None, probes) == []
    assert seen == ["10.0.0.2:6379"]


# ---- backend ------------------------------------------------------------------------------


def test_sglang_backend_needs_a_tested_sglang_and_cuda_locally(tmp_path):
    cfg = _cfg(tmp_path, "rollout.backend=sglang", "rollout.gpus_per_engine=1")
    assert check_backend(cfg, _probes(cuda_devices=lambda: 1), local=True) == []
    old = _probes(cuda_devices=lambda: 1, package_version=lambda n: "0.4.9")
    [f] = check_backend(cfg, old, local=True)
    assert f.key == "rollout.backend" and "SGLang 0.4.9" in f.problem and ">=0.5.23" in f.fix
    missing = _probes(package_version=lambda n: None)
    found = check_backend(cfg, missing, local=True)
    assert [f.problem.split(";")[0] for f in found] == [
        "backend sglang, but SGLang is not installed",
        "SGLang engines need CUDA",
    ]
    assert check_backend(cfg, missing, local=False) == []  # a cluster: node resources instead


def test_cuda_device_without_cuda(tmp_path):
    [f] = check_backend(
        _cfg(tmp_path, "trainer.device=cuda", "learner.gpus_per_rank=1"), _probes(), local=True
    )
    assert f.key == "trainer.device" and "trainer.device=cpu" in f.fix


# ---- tracking -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "ok"),
    [
        ({}, False),
        ({"WANDB_API_KEY": "k"}, True),
        ({"WANDB_MODE": "offline"}, True),
        ({"WANDB_MODE": "disabled"}, True),
        ({"WANDB_MODE": "online"}, False),
    ],
)
def test_wandb_needs_a_login_or_offline_mode(tmp_path, env, ok):
    cfg = _cfg(tmp_path, "logging.wandb=true")
    found = check_tracking(cfg, _probes(env={"HOME": str(tmp_path), **env}))
    assert (found == []) is ok
    if not ok:
        assert found[0].key == "logging.wandb"
        assert (
            found[0].fix == "run 'wandb login', or set WANDB_MODE=offline, or logging.wandb=false"
        )


def test_wandb_netrc_entry_counts_as_a_login(tmp_path):
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    os.chmod(tmp_path / ".netrc", 0o600)
    cfg = _cfg(tmp_path, "logging.wandb=true")
    assert check_tracking(cfg, _probes(env={"HOME": str(tmp_path)})) == []
    other = {"HOME": str(tmp_path), "WANDB_BASE_URL": "https://wandb.example.com"}
    assert check_tracking(cfg, _probes(env=other)) != []  # an entry for another host


def test_wandb_off_needs_nothing(tmp_path):
    assert check_tracking(_cfg(tmp_path), _probes(package_version=lambda n: None)) == []


# ---- output directory and disk -----------------------------------------------------------


def test_output_dir_not_writable(tmp_path):
    [f] = check_output_dir(_cfg(tmp_path), _probes(writable=lambda p: "Read-only file system"))
    assert f.key == "trainer.output_dir" and "Read-only file system" in f.problem


def test_disk_estimate_counts_every_checkpoint_and_the_bank(tmp_path):
    cfg = _cfg(tmp_path, "trainer.total_steps=100", "trainer.save_freq=10")
    assert check_output_dir(cfg, _probes()) == []
    [f] = check_output_dir(cfg, _probes(disk_free=lambda p: 1000))
    assert f.key == "trainer.output_dir" and "11 checkpoints" in f.problem
    assert "trainer.save_freq" in f.fix


def test_disk_estimate_counts_only_kept_checkpoints_a_bounded_bank_and_snapshots(tmp_path):
    from launcher.preflight import disk_needed

    endless = ["trainer.total_steps=10000000", "trainer.save_freq=5"]
    cfg = _cfg(tmp_path, *endless, "trainer.keep_checkpoints=2", "buffer.bank_max_bytes=1000")
    kept_two_bank_bound = disk_needed(cfg, params=1000)
    assert kept_two_bank_bound < 1_000_000  # two 12 KB checkpoints and a 1 KB bank, with headroom
    [f] = check_output_dir(cfg, _probes(disk_free=lambda p: 10))
    assert "2 checkpoints" in f.problem and "trainer.keep_checkpoints" in f.fix
    # keep_checkpoints=1 still keeps 2 (the fallback); 0 keeps every one
    one = _cfg(tmp_path, *endless, "trainer.keep_checkpoints=1", "buffer.bank_max_bytes=1000")
    assert disk_needed(one, params=1000) == kept_two_bank_bound
    every = _cfg(tmp_path, *endless, "buffer.bank_max_bytes=1000")
    assert disk_needed(every, params=1000) > 1000 * kept_two_bank_bound
    # each policy snapshot is the weights once more (fp32 here)
    short = ["trainer.total_steps=10", "trainer.save_freq=-1"]
    base = disk_needed(_cfg(tmp_path, *short), params=1000)
    with_snapshots = disk_needed(_cfg(tmp_path, *short, "trainer.save_hf_freq=5"), params=1000)
    assert with_snapshots > base
    [f] = check_output_dir(
        _cfg(tmp_path, *short, "trainer.save_hf_freq=5"), _probes(disk_free=lambda p: 10)
    )
    assert "3 policy snapshots" in f.problem


def test_parameter_count_of_qwen2_7b_config():
    qwen7b = {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    }
    assert 7.4e9 < ModelShape.from_config_dict(qwen7b).params() < 7.8e9  # Qwen2.5-7B: 7.62B


# ---- all at once ---------------------------------------------------------------------------


def test_every_failure_is_listed_at_once(tmp_path):
    cfg = _cfg(tmp_path, *GPU_RUN, "logging.wandb=true", "data.val_files=[/no/such.parquet]")
    with pytest.raises(PreflightFailed) as err:
        ensure_ready(cfg, None, _probes(disk_free=lambda p: 0))
    keys = [f.key for f in err.value.findings]
    assert keys == [
        "data.val_files",
        "learner.gpus_per_rank",
        "rollout.gpus_per_engine",
        "logging.wandb",
        "trainer.output_dir",
    ]
    assert all(line.startswith("preflight error at ") for line in err.value.lines)
    assert all("\n" not in line for line in err.value.lines)


def _gsm8k_file(tmp_path: Path) -> Path:
    raw = tmp_path / "raw"
    raw.mkdir()
    row = {"question": "What is 2+3?", "answer": "2+3=5\n#### 5"}
    for split in ("train", "test"):
        (raw / f"{split}.jsonl").write_text(json.dumps(row) + "\n")
    out = tmp_path / "gsm8k"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher.cli",
            "data",
            "gsm8k",
            "--input",
            str(raw),
            "--out",
            str(out),
        ],  # fmt: skip
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=120,
    )
    return out


@pytest.mark.parametrize("command", ["train", "check"])
def test_7b_gpu_config_on_this_cpu_machine_exits_2_listing_gpus_and_wandb(tmp_path, command):
    data = _gsm8k_file(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "RAY_ADDRESS"))}
    env.update(HOME=str(home), PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    model = tmp_path / "model"
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable, "-m", "launcher.cli", command,
            "--config", "configs/gsm8k_grpo_qwen2.5_7b.yaml",
            f"data.train_files=[{data / 'train.parquet'}]",
            f"data.val_files=[{data / 'test.parquet'}]",
            f"model.path={model}", "model.create_tiny=true", "model.tiny.max_positions=2048",
            f"trainer.output_dir={tmp_path / 'run'}",
        ],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert all(line.startswith("fleetrl: preflight error at ") for line in lines), lines
    by_key = {line.split(" at ", 1)[1].split(":", 1)[0]: line for line in lines}
    assert "GPU" in by_key["learner.gpus_per_rank"] and "16 GPU needed, 0 there" in by_key["learner.gpus_per_rank"]  # fmt: skip
    assert "32 GPU needed, 0 there" in by_key["rollout.gpus_per_engine"]
    assert "run 'wandb login', or set WANDB_MODE=offline" in by_key["logging.wandb"]
    assert not model.exists() and not (tmp_path / "run").exists()  # nothing built or started
    assert elapsed < 60  # seconds, not a model build or a wait for GPUs (2 shared cores)


def test_check_passes_on_the_cpu_demo_and_builds_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [
            sys.executable, "-m", "launcher.cli", "check", "--config", "configs/demo_cpu.yaml",
            f"model.path={tmp_path / 'model'}", f"trainer.output_dir={tmp_path / 'run'}",
            f"data.train_files=[{tmp_path / 'data' / 'train.parquet'}]",
            f"data.val_files=[{tmp_path / 'data' / 'test.parquet'}]",
        ],
        cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("fleetrl check: ready to run on a local Ray instance (")
    assert list(tmp_path.iterdir()) == []  # no model, data or run directory made


def test_too_few_learner_units_name_the_learner_resource(tmp_path):
    cfg = _cfg(tmp_path, "learner.num_ranks=3")
    nodes = [Node("node a", {"CPU": 64, "learner": 2, "rollout": 1})]
    [f] = check_resources(cfg, nodes, local=False)
    assert f.key == "ray.learner_resource" and "not enough learner (3 learner needed, 2 there" in f.problem  # fmt: skip


def test_a_critic_folder_and_a_checkpoint_to_resume_that_are_not_there_are_findings(tmp_path):
    fine = _cfg(tmp_path)
    assert check_model(fine) == []
    cfg = _cfg(
        tmp_path,
        f"learner.critic.model_path={tmp_path / 'no_critic'}",
        f"trainer.resume_from_path={tmp_path / 'run/checkpoints/step_3'}",
    )
    findings = {f.key: f for f in check_model(cfg)}
    assert set(findings) == {"learner.critic.model_path", "trainer.resume_from_path"}
    assert "not a Hugging Face model folder" in findings["learner.critic.model_path"].problem
    assert "not a complete fleetrl checkpoint" in findings["trainer.resume_from_path"].problem


# ---- co-location ---------------------------------------------------------------------------

COLOCATED_GPU = (
    "rollout.placement=colocated",
    "rollout.backend=sglang",
    "trainer.device=cuda",
    "learner.num_ranks=2",
    "learner.gpus_per_rank=1",
    "rollout.num_engines=2",
    "rollout.gpus_per_engine=1",
)


def test_colocated_sglang_needs_the_memory_saver_and_room_for_the_larger_phase(tmp_path):
    from launcher.preflight import check_colocation

    cfg = _cfg(tmp_path, *COLOCATED_GPU)
    versions = {"sglang": "0.5.23", "torch_memory_saver": "0.0.9"}
    ready = _probes(package_version=versions.get, cuda_memory_gb=lambda: 80.0)
    assert check_colocation(cfg, ready, local=True) == []
    no_saver = _probes(package_version={"sglang": "0.5.23"}.get, cuda_memory_gb=lambda: 80.0)
    [f] = check_colocation(cfg, no_saver, local=True)
    assert f.key == "rollout.placement" and "torch_memory_saver" in f.problem
    # SGLang takes mem_fraction_static of the device while generating: with 0.97 x 80 GiB
    # there is no room left for the two processes' CUDA contexts
    greedy = _cfg(tmp_path, *COLOCATED_GPU, "rollout.mem_fraction_static=0.97")
    [f] = check_colocation(greedy, ready, local=True)
    assert "while generating" in f.problem and "rollout.mem_fraction_static" in f.fix
    assert check_colocation(cfg, no_saver, local=False) == []  # a cluster: not seen from here


def test_a_colocated_cpu_run_shares_the_host_memory_among_its_ranks(tmp_path):
    from launcher.preflight import check_colocation

    cfg = _cfg(tmp_path, "rollout.placement=colocated")
    assert check_colocation(cfg, _probes(host_memory_gb=lambda: 16.0), local=True) == []
    [f] = check_colocation(cfg, _probes(host_memory_gb=lambda: 1e-4), local=True)
    assert "host share per rank" in f.problem
