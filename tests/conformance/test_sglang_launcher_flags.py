"""SGLang's own parser accepts every command line the launcher builds, with the values meant.

``rollout_fleet.sglang_launcher.build_command`` writes ``python -m
sglang.launch_server ...``; a flag SGLang renamed or dropped would only show
when a GPU node starts an engine. Here each argv goes through
``sglang.srt.server_args.prepare_server_args`` - the function
``sglang.launch_server`` itself calls on ``sys.argv[1:]`` - and the parsed
``ServerArgs`` fields are compared with the spec (an unknown flag or a bad
value makes argparse exit). A second test runs SGLang's resolution
(``ServerArgs.resolve_once``, what ``launch_server.run_server`` does next) on
every argv with ``--device cpu`` and a tiny model folder, in a subprocess
because resolution writes environment variables.

The API key is never on the command line: the launcher writes it to a 0600 YAML file that
the argv names with ``--config``, and SGLang's own ``prepare_server_args`` reads it there.

Specs: defaults, tensor parallel 2, an API key on a node IP, real weights,
extra arguments, in_place vs abort pause, the memory saver of co-located engines
(``--enable-memory-saver``; a shipped GPU config made co-located), LoRA serving (SGLang's
``check_lora_server_args`` runs in the resolution), the shipped GPU configs turned into
specs the way the launcher does (``engine_spec`` -> ``sglang_server_spec``), and
reward-model servers as the reward fleet builds them (``reward_server_specs``:
``--is-embedding``, their own weights, tensor parallel, the run's key on a node IP),
resolved over a tiny reward-model folder.
Needs no GPU; SGLang's Python code is installed by ``make venv``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.config import load_run_config
from rollout_fleet.actors import engine_spec, sglang_server_spec
from rollout_fleet.rewards.fleet import reward_server_specs
from rollout_fleet.sglang_launcher import (
    LORA_SLOTS,
    SGLangServerSpec,
    build_command,
    remove_key_config,
    write_key_config,
)

REPO = Path(__file__).resolve().parents[2]
PORT = 31000
NODE_IP = "10.0.0.5"


def _config_spec(config: str, *overrides: str) -> SGLangServerSpec:
    """The SGLang spec of engine-0 of a run config, built as the launcher builds it."""
    cfg = load_run_config(REPO / "configs" / config, list(overrides))
    spec = engine_spec(
        cfg.rollout,
        "engine-0",
        cfg.model.path,
        device="cuda",
        dtype=cfg.model.dtype,
        api_key="run-key",
        expose_on_node_ip=True,  # a multi-node fleet binds the node IP, with a key
        pause_mode=cfg.weight_sync.pause_mode,
        colocated=cfg.rollout.is_colocated_slot(0),
    )
    server_spec = sglang_server_spec(spec, host=NODE_IP)
    server_spec.port = PORT  # SGLangServer picks a free port at launch
    return server_spec


def _reward_spec(*overrides: str) -> SGLangServerSpec:
    """The SGLang spec of reward-0 of a run placing SGLang reward servers."""
    cfg = load_run_config(
        None, ["reward.model.path=/models/rm", "reward.model.backend=sglang", *overrides]
    )
    spec = reward_server_specs(
        cfg.reward.model,
        cfg.rollout,
        dtype=cfg.model.dtype,
        api_key="run-key",
        expose_on_node_ip=True,
    )[0]
    server_spec = sglang_server_spec(spec, host=NODE_IP)
    server_spec.port = PORT
    return server_spec


CASES: dict[str, SGLangServerSpec] = {
    "defaults": SGLangServerSpec(model_path="/models/m", port=PORT),
    "tp2": SGLangServerSpec(model_path="/models/m", port=PORT, tp_size=2, base_gpu_id=2),
    "api_key_node_ip": SGLangServerSpec(
        model_path="/models/m", host=NODE_IP, port=PORT, api_key="secret"
    ),
    "auto_weights": SGLangServerSpec(
        model_path="/models/m",
        port=PORT,
        load_format="auto",
        dtype="bfloat16",
        mem_fraction_static=0.5,
        max_running_requests=32,
        random_seed=7,
    ),
    "extra_args": SGLangServerSpec(
        model_path="/models/m",
        port=PORT,
        extra_args=["--attention-backend", "fa3", "--chunked-prefill-size", "4096"],
    ),
    "in_place_radix_off": SGLangServerSpec(
        model_path="/models/m", port=PORT, disable_radix_cache=True
    ),
    "grpo_7b_config": _config_spec("gsm8k_grpo_qwen2.5_7b.yaml"),
    "ppo_7b_config": _config_spec("gsm8k_ppo_qwen2.5_7b.yaml"),
    "grpo_7b_config_abort": _config_spec(
        "gsm8k_grpo_qwen2.5_7b.yaml", "weight_sync.pause_mode=abort"
    ),
    "memory_saver": SGLangServerSpec(model_path="/models/m", port=PORT, enable_memory_saver=True),
    "grpo_7b_config_colocated": _config_spec(
        "gsm8k_grpo_qwen2.5_7b.yaml",
        "rollout.placement=colocated",
        "rollout.gpus_per_engine=1",
        "rollout.num_engines=4",
        "learner.num_ranks=4",
    ),
    "lora_all_linear": SGLangServerSpec(model_path="/models/m", port=PORT, lora_rank=8),
    "lora_named_modules": SGLangServerSpec(
        model_path="/models/m", port=PORT, lora_rank=64, lora_target_modules=["q_proj", "v_proj"]
    ),
    "reward_server": _reward_spec("reward.model.gpus_per_engine=1"),
    "reward_server_tp2": _reward_spec(
        "reward.model.gpus_per_engine=2",
        "reward.model.mem_fraction_static=0.6",
        "model.dtype=bfloat16",
        "reward.model.sglang_extra_args=['--chunked-prefill-size','2048']",
    ),
}


@contextlib.contextmanager
def _root_logging_kept():
    """prepare_server_args reconfigures the root logger (basicConfig(force=True)); undo it."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)


_KEY_FILES: list[Path] = []


def _command(spec: SGLangServerSpec) -> list[str]:
    """The launcher's argv for ``spec``; its key (if any) in a file, as the launcher writes it."""
    key_file = write_key_config(spec.api_key) if spec.api_key else None
    if key_file is not None:
        _KEY_FILES.append(key_file)
    return build_command(spec, key_file)


@pytest.fixture(autouse=True, scope="module")
def _remove_key_files():
    yield
    for path in _KEY_FILES:
        remove_key_config(path)


def _parse(argv: list[str]):
    from sglang.srt.server_args import prepare_server_args

    with _root_logging_kept():
        return prepare_server_args(argv)


def _expected(spec: SGLangServerSpec) -> dict[str, object]:
    return {
        "model_path": spec.model_path,
        "host": spec.host,
        "port": spec.port,
        "tp_size": spec.tp_size,
        "mem_fraction_static": spec.mem_fraction_static,
        "api_key": spec.api_key,
        "load_format": spec.load_format,
        "dtype": spec.dtype,
        "log_level": spec.log_level,
        "weight_version": spec.weight_version,
        "disable_radix_cache": spec.disable_radix_cache,
        "max_running_requests": spec.max_running_requests,
        "random_seed": spec.random_seed,
        "base_gpu_id": spec.base_gpu_id if spec.base_gpu_id is not None else 0,
        "is_embedding": spec.is_embedding,
        "enable_memory_saver": spec.enable_memory_saver,
    }


def test_the_command_runs_sglangs_launch_server_module():
    for spec in CASES.values():
        assert _command(spec)[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert importlib.util.find_spec("sglang.launch_server") is not None


@pytest.mark.parametrize("case", list(CASES))
def test_sglang_parses_the_argv_into_the_specs_values(case):
    spec = CASES[case]
    argv = _command(spec)[3:]
    assert not spec.api_key or spec.api_key not in " ".join(argv)  # SGLang reads it from --config
    args = _parse(argv)
    parsed = {name: getattr(args, name) for name in _expected(spec)}
    assert parsed == _expected(spec)


def test_lora_specs_enable_sglangs_lora_serving():
    for case, rank, modules in (
        ("lora_all_linear", 8, {"all"}),
        ("lora_named_modules", 64, {"q_proj", "v_proj"}),
    ):
        args = _parse(_command(CASES[case])[3:])
        assert args.enable_lora is True
        assert args.max_lora_rank == rank
        assert set(args.lora_target_modules) == modules
        assert args.max_loras_per_batch == args.max_loaded_loras == LORA_SLOTS
    assert not _parse(_command(CASES["defaults"])[3:]).enable_lora


def test_extra_args_reach_sglang_verbatim():
    args = _parse(_command(CASES["extra_args"])[3:])
    assert args.attention_backend == "fa3"
    assert args.chunked_prefill_size == 4096


def test_the_shipped_gpu_configs_launch_what_they_say():
    for case in ("grpo_7b_config", "ppo_7b_config"):
        args = _parse(_command(CASES[case])[3:])
        assert args.model_path == "/models/Qwen2.5-7B-Instruct"
        assert args.tp_size == 2  # rollout.gpus_per_engine
        assert args.dtype == "bfloat16"
        assert args.load_format == "dummy"  # first weights come from the learner
        assert args.api_key == "run-key" and args.host == NODE_IP
        assert args.disable_radix_cache is True  # weight_sync.pause_mode: in_place
    abort = _parse(_command(CASES["grpo_7b_config_abort"])[3:])
    assert abort.disable_radix_cache is False  # abort flushes the cache per update
    colocated = _parse(_command(CASES["grpo_7b_config_colocated"])[3:])
    assert colocated.enable_memory_saver is True  # release frees memory (torch_memory_saver)
    assert colocated.tp_size == 1 and colocated.disable_radix_cache is False  # abort pause
    assert colocated.enable_weights_cpu_backup is False  # every resume is followed by a push


def test_reward_servers_serve_their_own_weights_as_an_embedding_model():
    for case, tp in (("reward_server", 1), ("reward_server_tp2", 2)):
        args = _parse(_command(CASES[case])[3:])
        assert args.is_embedding is True and args.load_format == "auto"  # never pushed
        assert args.model_path == "/models/rm" and args.tp_size == tp
        assert args.api_key == "run-key" and args.host == NODE_IP
        assert args.max_running_requests is None  # SGLang sizes it from memory
    tp2 = _parse(_command(CASES["reward_server_tp2"])[3:])
    assert tp2.mem_fraction_static == 0.6 and tp2.dtype == "bfloat16"
    assert tp2.chunked_prefill_size == 2048
    assert not _parse(_command(CASES["defaults"])[3:]).is_embedding


RESOLVE = """
import json, sys
from sglang.srt.server_args import prepare_server_args
from sglang.srt.arg_groups.overrides import resolving_view
out = []
for argv in json.load(sys.stdin):
    args = prepare_server_args(argv)
    args.resolve_once()
    view = resolving_view(args)
    out.append({k: getattr(view, k) for k in
                ("tp_size", "load_format", "disable_radix_cache", "weight_version", "api_key",
                 "is_embedding", "enable_memory_saver")}
               | {"enable_lora": bool(view.enable_lora)})
print("RESOLVED " + json.dumps(out))
"""


def _with_model(argv: list[str], model_path: str) -> list[str]:
    argv = list(argv)
    argv[argv.index("--model-path") + 1] = model_path
    return argv + ["--device", "cpu"]


def test_sglang_resolves_every_argv_on_cpu(tiny_model_dir, tiny_reward_dir):
    argvs = [
        _with_model(
            _command(spec)[3:], str(tiny_reward_dir if spec.is_embedding else tiny_model_dir)
        )
        for spec in CASES.values()
    ]
    proc = subprocess.run(
        [sys.executable, "-c", RESOLVE],
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESOLVED "))
    resolved = json.loads(line.removeprefix("RESOLVED "))
    for spec, view in zip(CASES.values(), resolved, strict=True):
        assert view == {
            "tp_size": spec.tp_size,
            "load_format": spec.load_format,
            "disable_radix_cache": spec.disable_radix_cache,
            "weight_version": spec.weight_version,
            "api_key": spec.api_key,
            "is_embedding": spec.is_embedding,
            "enable_memory_saver": spec.enable_memory_saver,
            "enable_lora": spec.lora_rank > 0,
        }
