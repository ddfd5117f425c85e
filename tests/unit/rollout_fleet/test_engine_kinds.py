"""The rollout backends' table (rollout_fleet.engine_kinds): one row per backend the config
accepts, every field naming something that exists, the two client pairs chosen by the API
each row names, and no module outside the table branching on a backend's name."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest

from rollout_fleet.config import RolloutConfig
from rollout_fleet.engine_api import rollout_client_class
from rollout_fleet.engine_kinds import KINDS, engine_kind
from weight_sync.engine_api import weight_client
from weight_sync.engine_client import EngineEndpoint

REPO = Path(__file__).resolve().parents[3]
PACKAGES = ("launcher", "rollout_fleet", "weight_sync", "learner", "buffer", "fleetrl", "bench")
# a comparison of a backend (or an engine API) with one backend's name
BRANCH = re.compile(r"""\b(backend|api)\)?\s*(==|!=|\bin\b|\bnot in\b)\s*[(\[{]?\s*["'](sglang|vllm|embedded)["']""")  # fmt: skip


def test_one_row_per_backend_the_config_accepts():
    hints = typing.get_type_hints(RolloutConfig, include_extras=True)
    accepted = typing.get_args(typing.get_args(hints["backend"])[0])
    assert sorted(KINDS) == sorted(accepted)
    assert [k.backend for k in KINDS.values() if not k.gpu_server] == ["embedded"]
    with pytest.raises(ValueError, match="backend 'trtllm'; accepted: embedded, sglang, vllm"):
        engine_kind("trtllm")


@pytest.mark.parametrize("backend", sorted(KINDS))
def test_every_field_names_a_config_field_or_a_function_that_exists(backend):
    kind, config = engine_kind(backend), RolloutConfig(backend=backend)
    for field in (kind.memory_field, kind.load_format_field, kind.extra_args_field):
        assert not field or hasattr(config, field), field
    assert kind.load_format(config) in ("dummy", "auto") and isinstance(kind.extra_args(config), list)  # fmt: skip
    if kind.gpu_server:
        assert 0 < kind.memory_fraction(config) <= 1 and kind.package
        server_class, spec_of = kind.load("server")()
        assert callable(spec_of) and hasattr(server_class, "start")
        assert kind.load("preflight")(None, {}, "rollout.backend=embedded")[0][0]  # not installed


def test_each_backend_gets_the_clients_of_the_api_it_names():
    from rollout_fleet.client import EngineClient
    from rollout_fleet.vllm_client import VllmEngineClient
    from weight_sync.vllm_engine_client import VllmWeightClient

    assert rollout_client_class("embedded") is EngineClient
    assert rollout_client_class("sglang") is EngineClient
    assert rollout_client_class("vllm") is VllmEngineClient
    vllm = weight_client(EngineEndpoint("e", "http://127.0.0.1:1", api="vllm"), 5.0)
    assert type(vllm) is VllmWeightClient and not vllm.takes_per_tensor_broadcasts
    with pytest.raises(ValueError, match="api 'trtllm'; accepted: sglang, vllm"):
        weight_client(EngineEndpoint("e", "http://127.0.0.1:1", api="trtllm"), 5.0)


def test_no_module_outside_the_table_branches_on_a_backends_name():
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if BRANCH.search(line):
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert found == []


def test_the_branch_pattern_finds_the_forms_a_branch_takes():
    for line in ('if cfg.rollout.backend == "vllm":', "x = a if backend != 'sglang' else b",
                 'if rollout.backend in ("embedded", "sglang"):', 'if endpoint.api == "vllm":'):  # fmt: skip
        assert BRANCH.search(line), line
    assert not BRANCH.search('if cfg.weight_sync.backend == "nccl":')
